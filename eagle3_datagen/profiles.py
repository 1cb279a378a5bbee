"""Model profiles: how each reasoning model is switched into thinking mode and how it marks its thoughts.

A profile is data, not a code path: a user adds a model by writing one under `profiles:` in the config.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ModelProfile(BaseModel):
    """What the pipeline must know about a reasoning model to ask for, read and rebuild its thinking."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reasoning_parser: str = Field(description="vLLM `--reasoning-parser` the server must be started with.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Template switches that turn thinking on, sent top-level as `chat_template_kwargs`.",
    )
    thinking_off_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Template switches that turn thinking off (used by the probe to tell 'off' from 'ignored').",
    )
    reasoning_effort: str | None = Field(
        default=None, description="OpenAI `reasoning_effort` value, for models switched that way (gpt-oss)."
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


_THINK_TAGS_IM_END = {"think_start": "<think>", "think_end": "</think>", "end_of_turn": "<|im_end|>"}

BUILTIN_PROFILES: dict[str, ModelProfile] = {
    "kimi-k2.5": ModelProfile(
        reasoning_parser="kimi_k2",
        chat_template_kwargs={"thinking": True},
        thinking_off_kwargs={"thinking": False},
        template_writes_start_tag=True,
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
        reasoning_effort="high",
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
