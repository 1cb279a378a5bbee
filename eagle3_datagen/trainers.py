"""The trainers' own code, where the pipeline runs it (judging a draft): found in the environment or in the folder
`EAGLE3_TRAINERS` names (`make setup` installs them there without their GPU-only dependencies)."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any, Literal

from eagle3_datagen.errors import UserError

SPECULATORS_VERSION = "0.9.0"
Trainer = Literal["specforge", "speculators"]
FINAL_STATE_FOR: dict[Trainer, str] = {"specforge": "after_norm", "speculators": "before_norm"}


class TrainerMissing(UserError):
    """speculators is not importable here."""


def speculators() -> ModuleType:
    """The speculators package, from the environment or from $EAGLE3_TRAINERS."""
    folder = os.environ.get("EAGLE3_TRAINERS")
    if folder and folder not in sys.path:
        sys.path.append(folder)
    try:
        return importlib.import_module("speculators")
    except ImportError as why:
        raise TrainerMissing(f"evaluate runs the draft with speculators' own code, which does not import here ({why})"
                             f": pip install speculators=={SPECULATORS_VERSION}, or set EAGLE3_TRAINERS to a folder "
                             "holding it") from None


def speculators_call_kwargs(steps: int) -> dict[str, Any]:
    """What speculators' Trainer passes to an EAGLE-3 draft's forward, with the loss that runs on any device (its
    fused one needs Triton; the eager one computes the same KL)."""
    speculators()
    loss = importlib.import_module("speculators.losses").resolve_loss_config("kl_div", "eager")
    return {"ttt_steps": steps, "ttt_step_loss_decay": 1.0, "loss_config": loss}
