"""Sequences grouped into forward passes within a token budget."""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence positions so batch_size x longest stays within max_tokens; one too long runs alone.

    Longest first: similar lengths waste little padding, and an out-of-memory shows on the first batch.
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
