"""Thinking modes: how one mode of a model is switched on, and which prompts of a run are asked in which mode.

A draft trained only on thinking-mode data serves instant-mode requests worse, so a run can mix a model's modes
(`generation.modes`). A prompt's mode is a pure function of its id and the mix: the same on every machine and in
every re-run, so a resumed run asks each prompt in the mode it was asked in before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eagle3_datagen.forms import form_title

DEFAULT_MODE = "thinking"
INSTANT_MODE = "instant"


class ModeSpec(BaseModel):
    """One mode of a model: the switches that turn it on, and whether its answers carry reasoning."""

    model_config = ConfigDict(extra="forbid", frozen=True, field_title_generator=form_title)

    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Template switches of this mode, sent top-level as `chat_template_kwargs`."
    )
    reasoning_effort: str | None = Field(
        default=None, description="OpenAI `reasoning_effort` value of this mode (gpt-oss: low, medium, high)."
    )
    system_prompt: str | None = Field(
        default=None, description="Text that switches this mode from the system message: put before the "
        "conversation's own system message (joined by a blank line), or sent as one."
    )
    reasoning: Literal["required", "absent"] = Field(
        default="required", description="`required`: an answer without reasoning is a failure; `absent`: an answer "
        "with reasoning is (the switch was ignored)."
    )

    @property
    def thinks(self) -> bool:
        return self.reasoning == "required"

    def template_variables(self) -> dict[str, Any]:
        """What the chat template reads in this mode: its kwargs, and the reasoning effort vLLM hands it too."""
        return {**self.chat_template_kwargs, **({"reasoning_effort": self.reasoning_effort}
                                                 if self.reasoning_effort else {})}


class ModeWeight(BaseModel):
    """One entry of `generation.modes`: a mode of the profile and its share of the prompts."""

    model_config = ConfigDict(extra="forbid", frozen=True, field_title_generator=form_title)

    mode: str = Field(description="A mode of the model's profile, e.g. `thinking` or `instant`.")
    weight: float = Field(description="Its share of the prompts, relative to the other modes' weights (>= 0).")


def with_system_prompt(messages: list[dict[str, str]], spec: ModeSpec) -> list[dict[str, str]]:
    """The messages as sent in this mode: its system prompt before the conversation's own, or as a new one.

    Templates read one system message, the first: a second one would be rendered as a turn or dropped.
    """
    if not spec.system_prompt:
        return messages
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{spec.system_prompt}\n\n{messages[0]['content']}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": spec.system_prompt}, *messages]


def _unit_interval(prompt_id: str) -> float:
    """A prompt id mapped to [0, 1), salted so the mode split is independent of the cross-check sample's."""
    digest = hashlib.sha256(b"mode\0" + prompt_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_mode(prompt_id: str, mix: Sequence[ModeWeight]) -> str:
    """The mode a prompt is asked in: its id's place in [0, 1) against the mix's cumulative weights."""
    total = sum(entry.weight for entry in mix)
    point, reached = _unit_interval(prompt_id) * total, 0.0
    for entry in mix:
        reached += entry.weight
        if point < reached:
            return entry.mode
    return next(entry.mode for entry in reversed(mix) if entry.weight > 0)
