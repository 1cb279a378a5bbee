"""What a server's answers say about it: reasoning visible or not, thinking on or off, token ids or not.

Both the pre-flight probe and generation's early-abort window judge completions with `diagnose`, so a run is
stopped with the same one-line fix whichever of them sees the problem first.
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
    """What the probe saw on one endpoint, recorded in the manifest."""

    endpoint: str
    served_models: list[str]
    reasoning_field: str
    thinking_on: bool
    parser_split_tags: bool
    token_ids_returned: bool
    reasoning_chars: int
    max_model_len: int | None = None
    context_warning: str | None = None  # prompts too long for the served context, which the server will refuse


def diagnose(
    endpoint: str,
    served: list[str],
    completions: list[Completion],
    profile: ModelProfile,
    allow_inline: bool,
) -> ProbeFinding:
    """Turn the probe's completions into a finding, or a ServerCheckFailed that names the fix."""
    parser_hint = f"restart vLLM with --reasoning-parser {profile.reasoning_parser}"
    for done in completions:
        if done.model and done.model not in served:
            raise ServerCheckFailed(f"{endpoint} answered as model {done.model!r}, not one of {served}")
        if done.prompt_token_ids is None or done.completion_token_ids is None:
            raise ServerCheckFailed(
                f"{endpoint} returned no token ids for `return_token_ids`: use vLLM >= 0.10.2 "
                "(exact sequences need the server's own ids)"
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
        if not done.reasoning.strip():
            switch = profile.chat_template_kwargs or {"reasoning_effort": profile.reasoning_effort}
            raise ServerCheckFailed(
                f"{endpoint} returned no reasoning with thinking switched on ({switch}): thinking is off or "
                f"the switch is ignored: check model.profile matches the served model and {parser_hint}"
            )
    first = completions[0]
    return ProbeFinding(
        endpoint=endpoint,
        served_models=served,
        reasoning_field=first.reasoning_source,
        thinking_on=True,
        parser_split_tags=first.reasoning_source != "inline",
        token_ids_returned=True,
        reasoning_chars=min(len(c.reasoning) for c in completions),
    )
