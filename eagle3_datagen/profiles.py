"""Model profiles: how each reasoning model is switched into each of its modes and how it marks its thoughts.

A profile is data, not a code path: a user adds a model by writing one under `profiles:` in the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from eagle3_datagen.forms import form_title
from eagle3_datagen.modes import DEFAULT_MODE, INSTANT_MODE, ModeSpec


class ModelProfile(BaseModel):
    """What the pipeline must know about a reasoning model to ask for, read and rebuild its thinking."""

    model_config = ConfigDict(extra="forbid", frozen=True, field_title_generator=form_title)

    reasoning_parser: str = Field(description="vLLM `--reasoning-parser` the server must be started with.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Template switches that turn thinking on (the `thinking` mode), sent top-level as "
        "`chat_template_kwargs`; a profile with `modes` sets them there instead.",
    )
    thinking_off_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Template switches that turn thinking off: the `instant` mode, answered without reasoning; a "
        "profile with `modes` sets them there instead.",
    )
    reasoning_effort: str | None = Field(
        default=None, description="OpenAI `reasoning_effort` value of the `thinking` mode, for models switched that "
        "way; a profile with `modes` sets it there instead.",
    )
    modes: dict[str, ModeSpec] = Field(
        default_factory=dict,
        description="The model's modes by name, its default mode first (e.g. gpt-oss `high`, `medium`, `low`). "
        "Empty: `thinking` from chat_template_kwargs and reasoning_effort, and `instant` from thinking_off_kwargs "
        "when they are set.",
    )
    think_start: str = Field(default="<think>", description="Text of the think start tag.")
    think_end: str = Field(default="</think>", description="Text of the think end tag.")
    end_of_turn: str = Field(description="Text of the token that closes the assistant's turn.")
    template_writes_start_tag: bool = Field(
        description="True when the generation prompt already ends with the think start tag."
    )
    single_token_tags: bool = Field(
        default=True, description="False for formats whose reasoning markers are several tokens (gpt-oss harmony)."
    )
    image_token: str | None = Field(
        default=None, description="The token a vision-language server repeats for each image's pixels (Kimi-K2.5 "
        "`<|media_pad|>`, Qwen-VL `<|image_pad|>`, Idefics3 and SmolVLM `<image>`): image prompts need it, to "
        "find each image's positions in the server's ids.",
    )

    @model_validator(mode="after")
    def _modes_in_one_place(self) -> ModelProfile:
        legacy = [name for name in ("chat_template_kwargs", "thinking_off_kwargs", "reasoning_effort")
                  if getattr(self, name)]
        if self.modes and legacy:
            raise ValueError(f"a profile with `modes` sets its switches there: move {', '.join(legacy)} into a mode")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leaves an unset `modes` and `image_token` out of the dump: fingerprints recorded without them stay
        valid."""
        dumped: dict[str, Any] = handler(self)
        if not self.modes:
            dumped.pop("modes", None)
        if self.image_token is None:
            dumped.pop("image_token", None)
        return dumped

    @property
    def mode_specs(self) -> dict[str, ModeSpec]:
        """Every mode of the model by name, the default first."""
        if self.modes:
            return dict(self.modes)
        derived = {DEFAULT_MODE: ModeSpec(chat_template_kwargs=self.chat_template_kwargs,
                                          reasoning_effort=self.reasoning_effort)}
        if self.thinking_off_kwargs:
            derived[INSTANT_MODE] = ModeSpec(chat_template_kwargs=self.thinking_off_kwargs, reasoning="absent")
        return derived

    @property
    def default_mode(self) -> str:
        """The mode a run asks in when `generation.modes` is not set."""
        return next(iter(self.mode_specs))

    @property
    def thinking_mode(self) -> str:
        """The mode the think tags are discovered in: the first that answers with reasoning."""
        return next((name for name, spec in self.mode_specs.items() if spec.thinks), self.default_mode)

    def mode(self, name: str | None) -> ModeSpec:
        """A mode's spec by name; None is the default mode."""
        return self.mode_specs[name or self.default_mode]

    def mode_of(self, record: Mapping[str, Any]) -> str:
        """A generated record's mode: recorded in runs with `generation.modes`, else the default mode."""
        return record.get("mode") or self.default_mode


_THINK_TAGS_IM_END = {"think_start": "<think>", "think_end": "</think>", "end_of_turn": "<|im_end|>"}

BUILTIN_PROFILES: dict[str, ModelProfile] = {
    "kimi-k2.5": ModelProfile(
        reasoning_parser="kimi_k2",
        chat_template_kwargs={"thinking": True},
        thinking_off_kwargs={"thinking": False},
        template_writes_start_tag=True,
        image_token="<|media_pad|>",
        **_THINK_TAGS_IM_END,
    ),
    "kimi-k2-thinking": ModelProfile(
        reasoning_parser="kimi_k2",
        template_writes_start_tag=False,
        **_THINK_TAGS_IM_END,
    ),
    "qwen3": ModelProfile(
        reasoning_parser="qwen3",
        chat_template_kwargs={"enable_thinking": True},
        thinking_off_kwargs={"enable_thinking": False},
        template_writes_start_tag=False,
        **_THINK_TAGS_IM_END,
    ),
    "qwen3-thinking-2507": ModelProfile(
        reasoning_parser="qwen3",
        template_writes_start_tag=True,
        **_THINK_TAGS_IM_END,
    ),
    "qwen3-vl-thinking": ModelProfile(
        reasoning_parser="qwen3",
        template_writes_start_tag=True,
        image_token="<|image_pad|>",
        **_THINK_TAGS_IM_END,
    ),
    "deepseek-r1": ModelProfile(
        reasoning_parser="deepseek_r1",
        end_of_turn="<｜end▁of▁sentence｜>",
        template_writes_start_tag=True,
    ),
    "glm-4.5": ModelProfile(
        reasoning_parser="glm45",
        chat_template_kwargs={"enable_thinking": True},
        thinking_off_kwargs={"enable_thinking": False},
        end_of_turn="<|user|>",
        template_writes_start_tag=False,
    ),
    "gpt-oss": ModelProfile(
        reasoning_parser="openai_gptoss",
        modes={effort: ModeSpec(reasoning_effort=effort) for effort in ("high", "medium", "low")},
        think_start="<|channel|>analysis<|message|>",
        think_end="<|end|><|start|>assistant<|channel|>final<|message|>",
        end_of_turn="<|return|>",
        template_writes_start_tag=False,
        single_token_tags=False,
    ),
}


def resolve_profile(name: str, custom: dict[str, ModelProfile]) -> ModelProfile:
    """A profile from the config's own `profiles:` first, then the built-in ones."""
    if name in custom:
        return custom[name]
    if name in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name]
    known = ", ".join(sorted({*BUILTIN_PROFILES, *custom}))
    raise ValueError(f"model.profile {name!r} is unknown: use one of {known}, or define it under `profiles:`")
