"""What a draft's held-out scores say: per-step accuracy, expected acceptance length, by group, with intervals.

The trainer's training-time test gives, per sample and per step k, how many supervised targets the draft got right
with every step before it right too (`full`), over how many targets were supervised (`counted`) or still alive
(`alive`). Pooled over samples as the trainer pools its validation batches, `full_acc_k` = Σ full / Σ counted is
the share of positions where a chain drafts at least k + 1 accepted tokens, so chain drafting accepts on average
τ = 1 + Σ_k full_acc_k tokens per verification (the quantity vLLM reports as 1 + accepted / drafts). A sample's
tokens are not independent draws, so intervals resample whole samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

RESAMPLES = 1000  # bootstrap draws for each interval
LEVEL = 0.95


@dataclass(frozen=True)
class SampleScore:
    """One held-out sample's training-time-test counts (one entry per step) and what it is broken down by."""

    id: str
    mode: str
    turn: int
    source: str  # how its sequence was built: the server's ids, or rebuilt from text
    has_tool_call: bool
    full: tuple[float, ...]  # targets right with every earlier step right (the trainer's full_acc_k_sum)
    counted: tuple[float, ...]  # supervised targets at step k (full_acc_k_total)
    alive: tuple[float, ...]  # drafts still alive entering step k (cond_acc_k_total)


class GroupRow(TypedDict):
    """One line of the table: a group's value (`all` for every sample), its counts and figures."""

    group: str
    value: str
    samples: int
    tokens: int  # supervised positions at the first step
    full_acc: list[float]  # acc@k: positions whose first k + 1 drafted tokens are all accepted
    cond_acc: list[float]  # the same, given the step before was accepted
    acceptance_length: float  # τ = 1 + Σ acc@k
    interval: list[float]  # τ's bootstrap interval at LEVEL


class Evaluation(TypedDict):
    """What `evaluate` writes to evaluation.json and returns."""

    run: str
    draft: str
    name: str  # its folder under RUN/evaluations/
    target: str
    steps: int
    device: str
    samples: int
    seconds: float
    acceptance_length: float
    full_acc: list[float]
    rows: list[GroupRow]


GROUPS: dict[str, Callable[[SampleScore], str]] = {
    "mode": lambda score: score.mode,
    "turn": lambda score: str(score.turn),
    "source": lambda score: score.source,
    "has tool call": lambda score: "yes" if score.has_tool_call else "no",
}


def pooled(scores: Sequence[SampleScore]) -> dict[str, list[float]]:
    """The trainer's validation figures over these samples: full_acc_k and cond_acc_k per step."""
    full, counted, alive = (np.array([getattr(s, name) for s in scores], dtype=np.float64).reshape(len(scores), -1)
                            .sum(axis=0) for name in ("full", "counted", "alive"))
    return {"full_acc": _ratio(full, counted).tolist(), "cond_acc": _ratio(full, alive).tolist()}


def acceptance_length(full_acc: Sequence[float]) -> float:
    return 1.0 + float(sum(full_acc))


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)


def interval(scores: Sequence[SampleScore], seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of τ over samples (the same draws for the same scores)."""
    full = np.array([s.full for s in scores], dtype=np.float64)
    counted = np.array([s.counted for s in scores], dtype=np.float64)
    if len(scores) < 2:
        tau = acceptance_length(_ratio(full.sum(axis=0), counted.sum(axis=0)))
        return tau, tau
    draws = np.random.default_rng(seed).integers(0, len(scores), size=(RESAMPLES, len(scores)))
    taus = 1.0 + _ratio(full[draws].sum(axis=1), counted[draws].sum(axis=1)).sum(axis=1)
    low, high = np.quantile(taus, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(low), float(high)


def summary_row(group: str, value: str, scores: Sequence[SampleScore]) -> GroupRow:
    figures = pooled(scores)
    low, high = interval(scores)
    return {
        "group": group,
        "value": value,
        "samples": len(scores),
        "tokens": int(sum(s.counted[0] for s in scores)),
        "full_acc": [round(a, 4) for a in figures["full_acc"]],
        "cond_acc": [round(a, 4) for a in figures["cond_acc"]],
        "acceptance_length": round(acceptance_length(figures["full_acc"]), 4),
        "interval": [round(low, 4), round(high, 4)],
    }


def breakdown(scores: Sequence[SampleScore]) -> list[GroupRow]:
    """All samples, then each group's values in order: one row each."""
    rows = [summary_row("all", "all", scores)]
    for group, key in GROUPS.items():
        values = sorted({key(score) for score in scores}, key=lambda v: (len(v), v))
        rows += [summary_row(group, value, [s for s in scores if key(s) == value]) for value in values]
    return rows


def table(rows: Sequence[GroupRow]) -> list[str]:
    """The breakdown as a markdown table: acc@k is the share of positions accepting at least k tokens."""
    steps = len(rows[0]["full_acc"]) if rows else 0
    head = ["group", "value", "samples", "tokens", *(f"acc@{k + 1}" for k in range(steps)), "τ", f"{LEVEL:.0%} CI"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["group"], row["value"], str(row["samples"]), str(row["tokens"]),
                 *(f"{a:.3f}" for a in row["full_acc"]), f"{row['acceptance_length']:.3f}",
                 f"{row['interval'][0]:.3f}-{row['interval'][1]:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
