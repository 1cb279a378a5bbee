"""What the extraction stage knows of its target, whichever backend runs it, and the aux layers it reads."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from eagle3_datagen.errors import ConfigurationError


@dataclass(frozen=True)
class TargetInfo:
    """What every backend knows of the target: the shapes to check states against, and what the index records."""

    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    fingerprint: str
    norm_weight: torch.Tensor  # [H], the final RMSNorm's scale
    norm_eps: float

def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features as input-to-layer ids (= transformers' hidden_states index)."""
    return [2, num_layers // 2, num_layers - 3]

def resolve_aux_layers(configured: Sequence[int] | None, num_layers: int) -> list[int]:
    """The configured ids, or the default, refused unless they are three increasing inputs of real layers.

    Id 0 is the embedding output and id N would be after the final norm (the final state), so 1..N-1.
    """
    layers = list(configured) if configured is not None else default_aux_layers(num_layers)
    if len(layers) == 3 and layers == sorted(set(layers)) and all(1 <= i < num_layers for i in layers):
        return layers
    what = f"{layers} is invalid" if configured is not None else f"the default {layers} does not fit"
    raise ConfigurationError(
        f"config key hidden_states.aux_layers: {what}; give 3 increasing input-to-layer ids in "
        f"1..{num_layers - 1} (the valid range for this {num_layers}-layer target)"
    )

def target_num_layers(path: str, trust_remote_code: bool = False) -> int:
    """Decoder layer count from the config alone, to validate aux layers before loading any weights."""
    with remote_code_named(path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return config.get_text_config().num_hidden_layers


@contextmanager
def remote_code_named(path: str) -> Iterator[None]:
    """transformers' refusal of a model that needs its own code, as one line naming the setting."""
    try:
        yield
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise ConfigurationError(
            f"config key model.trust_remote_code: {path} ships its own model code (e.g. Kimi-K2.5's multimodal "
            "wrapper); set model.trust_remote_code: true if you trust it"
        ) from None
