"""Answers fed by hand to the early-abort test, and the verdict they get (the unit tests of generation and modes)."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_datagen.config import ValidationConfig
from eagle3_datagen.profiles import BUILTIN_PROFILES, ModelProfile
from eagle3_datagen.protocol import Completion
from tasks.generation.probation import Outcome, Probation

ENDPOINT = "http://127.0.0.1:8000"


def answer(reasoning: str, mode: str | None = None) -> Outcome:
    done = Completion(reasoning, "42", "stop", "reasoning" if reasoning else "none", [1, 2], [3, 4], {}, "m")
    return Outcome(ENDPOINT, completions=[done], mode=mode)


def judge(outcomes: list[Outcome], size: int = 32, profile: ModelProfile = BUILTIN_PROFILES["qwen3"],
          modes: Sequence[str] = (), **validation: object) -> tuple[Probation, int]:
    """Feed answers until the verdict; returns the probation and how many answers it took."""
    probation = Probation(size, [ENDPOINT], "m", profile, ValidationConfig(**validation), modes=modes)
    for seen, outcome in enumerate(outcomes, 1):
        probation.observe(outcome)
        if probation.passed or probation.error:
            return probation, seen
    return probation, len(outcomes)
