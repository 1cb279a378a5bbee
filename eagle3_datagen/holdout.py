"""Held-out prompts: the samples a draft is judged on, never trained on.

A prompt is held out when a salted hash of its id falls under its mode's cut. The salt makes the split independent
of the mode draw (a hash of the same id), and a rollout's samples share their conversation's id, so a conversation
is held out whole. The prompt stage, which sees every id, sets each mode's cut: `data.holdout`, raised so a mode
keeps at least `data.holdout_min_per_mode` held-out prompts (never more than a quarter of that mode's prompts,
so a small run still trains on most of its data); `data.holdout: 0` holds out nothing. The cuts are recorded
with the run, so the split is the same in every re-run and on every machine.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

Split = Literal["train", "holdout"]
SPLITS: tuple[Split, ...] = ("train", "holdout")
MINIMUM_AT_MOST = 0.25  # of a mode's prompts: the minimum never takes more than this


def holdout_point(prompt_id: str) -> float:
    """A prompt id mapped to [0, 1), salted apart from the mode draw's and the cross-check's."""
    digest = hashlib.sha256(b"holdout\0" + prompt_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class HoldoutSplit(BaseModel):
    """Each mode's cut: a prompt of that mode is held out when its point is below it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float
    min_per_mode: int
    cuts: dict[str, float]  # mode -> cut; a mode no prompt was drawn for is cut at `share`
    prompts: dict[str, int]  # mode -> prompts held out, as counted by the prompt stage

    def split_of(self, prompt_id: str, mode: str) -> Split:
        """`prompt_id`: the prompt's (a rollout's conversation's) id, not a sample's."""
        return "holdout" if holdout_point(prompt_id) < self.cuts.get(mode, self.share) else "train"


NO_HOLDOUT = HoldoutSplit(share=0.0, min_per_mode=0, cuts={}, prompts={})


class HoldoutChooser:
    """Sets the cuts in one pass over the prompts, holding `min_per_mode` points per mode."""

    def __init__(self, share: float, min_per_mode: int) -> None:
        self.share, self.min_per_mode = share, min_per_mode
        self.counts: dict[str, int] = {}
        self.under_share: dict[str, int] = {}
        self.lowest: dict[str, list[float]] = {}  # per mode, a max-heap (negated) of its lowest points

    def add(self, prompt_id: str, mode: str) -> None:
        point = holdout_point(prompt_id)
        self.counts[mode] = self.counts.get(mode, 0) + 1
        self.under_share[mode] = self.under_share.get(mode, 0) + (point < self.share)
        heap = self.lowest.setdefault(mode, [])
        if len(heap) < self.min_per_mode:
            heapq.heappush(heap, -point)
        elif heap and -heap[0] > point:
            heapq.heapreplace(heap, -point)

    def split(self) -> HoldoutSplit:
        cuts: dict[str, float] = {}
        held: dict[str, int] = {}
        for mode, count in sorted(self.counts.items()):
            wanted = min(self.min_per_mode, math.floor(count * MINIMUM_AT_MOST)) if self.share else 0
            if self.under_share[mode] >= wanted:
                cuts[mode], held[mode] = self.share, self.under_share[mode]
            else:
                kept = sorted(-point for point in self.lowest[mode])[:wanted]
                cuts[mode], held[mode] = math.nextafter(kept[-1], 1.0), wanted
        return HoldoutSplit(share=self.share, min_per_mode=self.min_per_mode, cuts=cuts, prompts=held)
