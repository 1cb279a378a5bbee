"""A speculators EAGLE-3 draft, loaded with speculators' own model code and run on held-out samples as its trainer's
validation runs it: the sample made into its batch by speculators' own collate and shift, then the draft's forward
with its training-time test unrolled, whose metrics are the counts the trainer pools.

On a CPU its default flex attention cannot run and its fused loss needs Triton: the draft runs with SDPA attention
and the eager KL loss there, which give the same figures.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_datagen.errors import UserError
from eagle3_datagen.trainers import speculators_call_kwargs

PAD_TO = 128  # flex attention's block: a batch's length is a multiple of it


class DraftRefused(UserError):
    """A draft this run cannot judge: not a speculators EAGLE-3 checkpoint, or built for another target."""


@dataclass(frozen=True)
class RunTarget:
    """What a draft must match: the target the run's hidden states come from."""

    path: str
    hidden_size: int
    vocab_size: int
    aux_layers: list[int]  # as inputs to layer i (speculators' `eagle_aux_hidden_state_layer_ids`)


def draft_config(draft: str) -> dict[str, Any]:
    config = Path(draft, "config.json")
    if not config.is_file():
        raise DraftRefused(f"{draft} has no config.json: give a speculators EAGLE-3 checkpoint folder (the trainer's "
                           "save path, e.g. checkpoints/checkpoint_best)")
    data = json.loads(config.read_text())
    if data.get("speculators_model_type") != "eagle3":
        raise DraftRefused(f"{draft} is not a speculators EAGLE-3 draft (speculators_model_type "
                           f"{data.get('speculators_model_type')!r}): evaluate judges EAGLE-3 drafts")
    return data


def check_draft(draft: str, target: RunTarget) -> dict[str, Any]:
    """The draft's config, refused in one line naming the first setting that differs from the run's target."""
    config = draft_config(draft)
    layer = config.get("transformer_layer_config", {})
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    for what, drafts, runs in (("hidden size", layer.get("hidden_size"), target.hidden_size),
                               ("vocabulary", layer.get("vocab_size"), target.vocab_size),
                               ("aux layers", aux, target.aux_layers)):
        if drafts is not None and drafts != runs:
            raise another_target(draft, target, what, drafts, runs)
    return config


def another_target(draft: str, target: RunTarget, what: str, drafts: Any, runs: Any) -> DraftRefused:
    return DraftRefused(f"{draft} was built for another target: {what} {drafts}, where this run's target "
                        f"({target.path}) has {runs}; judge it on a run of its own target")


def load_draft(draft: str, target: RunTarget, device: str) -> Any:
    """The draft (checked with `check_draft` first) on `device` in float32, its verifier's head and norm read from
    the run's target; aux layers the config left to the verifier's defaults are checked once resolved."""
    eagle3 = importlib.import_module("speculators.models.eagle3")
    config = eagle3.Eagle3DraftModel.config_class.from_pretrained(draft)
    config.speculators_config.verifier.name_or_path = target.path
    if device == "cpu":  # flex attention has no CPU kernel to run here; SDPA computes the same attention
        config.transformer_layer_config._attn_implementation = "sdpa"  # as speculators' own CLI sets it
    model = eagle3.Eagle3DraftModel.from_pretrained(draft, config=config)
    if (aux := list(model.config.eagle_aux_hidden_state_layer_ids)) != target.aux_layers:
        raise another_target(draft, target, "aux layers", aux, target.aux_layers)
    return model.to(device=device, dtype=torch.float32).eval()


def trained_steps(config: dict[str, Any]) -> int:
    """How many tokens the draft was trained to propose (its training-time test's steps)."""
    methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 3)


def batch_of(sample: dict[str, torch.Tensor], hidden_size: int) -> dict[str, Any]:
    """One sample (as speculators' ArrowDataset yields it) as the trainer's collate makes its batch."""
    data = importlib.import_module("speculators.train.data")
    shift = importlib.import_module("speculators.models.eagle3.data").shift_batch
    length = max(PAD_TO, math.ceil((len(sample["input_ids"]) - 1) / PAD_TO) * PAD_TO)
    collate = data.CollateFn(max_len=length, hidden_size=hidden_size, dtype=torch.float32, preprocess=shift)
    return collate([sample])


@torch.inference_mode()
def score(model: Any, sample: dict[str, torch.Tensor], steps: int, device: str
          ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """The trainer's counts for one sample: (full_acc_k_sum, full_acc_k_total, cond_acc_k_total) per step."""
    batch = {key: value.to(device) if isinstance(value, torch.Tensor) else value
             for key, value in batch_of(sample, model.hidden_size).items()}
    _, _, metrics = model(**batch, **speculators_call_kwargs(steps))
    return tuple(tuple(float(metrics[f"{name}_{k}_{part}"]) for k in range(steps))  # type: ignore[return-value]
                 for name, part in (("full_acc", "sum"), ("full_acc", "total"), ("cond_acc", "total")))
