"""Keeping secrets out of every message, log line, artifact and manifest."""

from __future__ import annotations

import os

SECRET_ENV_VARS = ("VLLM_API_KEY", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN")

_REGISTERED: set[str] = set()


def register_secret(value: str) -> None:
    """A secret that came from elsewhere than the environment (a Prefect Secret block): redact it too."""
    if len(value) >= 4:
        _REGISTERED.add(value)


def redact(text: str) -> str:
    """Replace the value of every secret in the environment, and every registered one, by a marker."""
    names = [*SECRET_ENV_VARS, *(n for n in os.environ if n.endswith(("_API_KEY", "_SECRET", "_TOKEN")))]
    for name in names:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, f"<{name}>")
    for value in _REGISTERED:
        text = text.replace(value, "<secret>")
    return text
