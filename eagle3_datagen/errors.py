"""User-facing errors: which exceptions are the user's to fix, and keeping secrets out of every message."""

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


def user_error_message(error: BaseException) -> tuple[str | None, int]:
    """(one-line message, exit status) for errors a user can fix; (None, 1) for bugs, which keep their trace."""
    from eagle3_datagen.config import ConfigError
    from eagle3_datagen.storage import StoragePathError
    from eagle3_datagen.think_tokens import ThinkTokenError
    from tasks.export import ExportError
    from tasks.generation import GenerationError
    from tasks.health import ServerCheckFailed
    from tasks.report import RunIncomplete
    from tasks.validation import ShardQuarantined

    config_errors = (ConfigError, ThinkTokenError, StoragePathError)
    run_errors = (ServerCheckFailed, GenerationError, ShardQuarantined, RunIncomplete, ExportError, FileNotFoundError)
    if isinstance(error, config_errors):
        status = 2
    elif isinstance(error, run_errors) or type(error) is ValueError:
        status = 1
    else:
        return None, 1
    return redact(" ".join(str(error).split())), status
