"""What a server's answers say about it: reasoning visible or not, in which field, with token ids or not.

Generation judges each endpoint's first answers with `check_form` before keeping any record from it, and its
early-abort test names the cause of empty reasoning with `why_empty`, so every way a server hides or loses
reasoning stops the run with the same one-line fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_datagen.errors import UserError
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion


class ServerCheckFailed(UserError):
    """The servers are not fit for this run; the message says what to fix."""


@dataclass(frozen=True)
class ProbeFinding:
    """What the checks saw on one endpoint, recorded in the manifest's `probe` list.

    The context is read before any request; how reasoning arrives is filled in from the endpoint's first answers.
    """

    endpoint: str
    served_models: list[str]
    max_model_len: int | None = None
    checkpoint: str | None = None  # what is served under the name (`root` of /v1/models)
    server_version: str | None = None  # vLLM's version (/version)
    context_warning: str | None = None  # prompts too long for the served context, which the server will refuse
    reasoning_field: str | None = None  # `reasoning`, `reasoning_content` or `inline`; None until answers came
    token_ids_returned: bool | None = None
    sequence_source: str | None = None  # how this endpoint's sequences are built: `server` ids or `text` rebuilt
    reasoning_chars: int | None = None  # the shortest reasoning among the first answers


def check_form(endpoint: str, served: list[str], done: Completion, profile: ModelProfile, allow_inline: bool,
               sequence_source: str = "auto") -> None:
    """Raise ServerCheckFailed, naming the fix, when an answer shows the server hides or mangles reasoning, or
    sends too little to build exact sequences the way `sequences.source` asks."""
    parser_hint = f"restart vLLM with --reasoning-parser {profile.reasoning_parser}"
    if done.model and done.model not in served:
        raise ServerCheckFailed(f"{endpoint} answered as model {done.model!r}, not one of {served}")
    if done.prompt_token_ids is None or done.completion_token_ids is None:
        if sequence_source == "server":
            raise ServerCheckFailed(
                f"{endpoint} returns no token ids (`return_token_ids` is vLLM's, from 0.10.2; SGLang and hosted "
                "APIs do not send it): set sequences.source: auto to rebuild sequences from text, each checked "
                "against the server's token counts"
            )
        if not {"prompt_tokens", "completion_tokens"} <= done.usage.keys():
            raise ServerCheckFailed(
                f"{endpoint} returns neither token ids nor usage counts (prompt_tokens, completion_tokens), so a "
                "sequence rebuilt from text could not be checked: use a server that reports usage, or vLLM "
                ">= 0.10.2 for its own ids"
            )
    tags_in_content = profile.think_start in done.content or profile.think_end in done.content
    if done.reasoning_source == "inline" and not allow_inline:
        raise ServerCheckFailed(
            f"{endpoint} sends reasoning inline in content (`...{profile.think_end}`): the server has no "
            f"reasoning parser: {parser_hint}, or set validation.allow_inline_reasoning: true"
        )
    if done.reasoning_source == "none" and tags_in_content:
        raise ServerCheckFailed(
            f"{endpoint} sends think tags inside content: the server has no reasoning parser: {parser_hint}"
        )
    if done.reasoning_source == "none" and done.unread_fields:
        names = ", ".join(sorted(done.unread_fields))
        raise ServerCheckFailed(
            f"{endpoint} put text in message field(s) {names} that this run does not read as reasoning "
            "(it reads `reasoning`, `reasoning_content`, or inline tags): use a vLLM server with "
            f"--reasoning-parser {profile.reasoning_parser}"
        )


def _switch(profile: ModelProfile, mode: str) -> dict[str, object]:
    """Everything a request sends to switch a mode on, for a message that names it."""
    spec = profile.mode(mode)
    return {**spec.template_variables(), **({"system_prompt": spec.system_prompt} if spec.system_prompt else {})}


def why_empty(profile: ModelProfile) -> str:
    """The likely cause of answers without reasoning from a server whose answers are otherwise well formed."""
    return (f"no reasoning came back with thinking switched on ({_switch(profile, profile.thinking_mode)}): thinking "
            f"is off or the switch is ignored: check model.profile matches the served model and restart vLLM with "
            f"--reasoning-parser {profile.reasoning_parser}")


def why_unswitched(profile: ModelProfile, modes: list[str]) -> str:
    """The likely cause of reasoning in answers asked in a mode that answers without it (instant)."""
    switches = "; ".join(f"{mode}: {_switch(profile, mode)}" for mode in modes)
    return (f"the switch that turns thinking off ({switches}) is ignored: check that model.profile's modes match the "
            "served model's chat template, or take the mode out of generation.modes")


def reasoning_facts(completions: list[Completion], sequence_source: str = "auto") -> dict[str, object]:
    """The ProbeFinding fields an endpoint's first (well-formed) answers establish; answers of a mode without
    reasoning (instant) say nothing of where reasoning arrives."""
    ids = all(c.completion_token_ids is not None for c in completions)
    reasoned = [c for c in completions if c.reasoning_source != "none"] or completions
    return {
        "reasoning_field": reasoned[0].reasoning_source if reasoned[0].reasoning_source != "none" else None,
        "token_ids_returned": ids,
        "sequence_source": "server" if ids and sequence_source != "text" else "text",
        "reasoning_chars": min(len(c.reasoning) for c in reasoned),
    }
