"""How the config reads in the Prefect deployment form, where every field's title comes from its name."""

from __future__ import annotations

_TITLE_WORDS = {"api": "API", "uri": "URI", "gpus": "GPUs", "vllm": "vLLM", "s": "(seconds)", "bytes": "(bytes)"}
_TITLES = {"api_key_env": "API key variable", "api_key_secret": "API key Secret block", "n": "Samples per prompt",
           "max_in_flight": "Requests in flight", "top_p": "Top-p", "extra_body": "Extra request body",
           "max_seq_len": "Longest sequence (tokens)"}


def form_title(name: str, _: object) -> str:
    """The deployment form's title of a field, in words ("Startup timeout (seconds)", not "Startup Timeout S")."""
    if name in _TITLES:
        return _TITLES[name]
    words = name.split("_")
    text = " ".join(_TITLE_WORDS.get(word, word) if at else word for at, word in enumerate(words))
    return text[0].upper() + text[1:]
