"""The report's plots as PNG bytes: reasoning and answer lengths, shard outcomes, request latency over time.

A plot is drawn again only when what it shows changed: drawing was most of a cached re-run's finishing step
(benchmarks/README.md, million_prompts.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_datagen import plotting
from eagle3_datagen.plotting import png, pyplot
from eagle3_datagen.storage import RunStore
from tasks.run.status import ShardStatus


def plot_lengths(reasoning: np.ndarray, answers: np.ndarray) -> bytes:
    """Histograms of reasoning and answer tokens per sample."""
    figure, axes = pyplot().subplots(1, 2, figsize=(8, 3))
    for axis, lengths, what in ((axes[0], reasoning, "reasoning"), (axes[1], answers, "answer")):
        axis.hist(lengths, bins=min(40, max(5, len(np.unique(lengths)))), color="#3b6ea8")
        axis.set_xlabel(f"{what} tokens per sample")
        axis.set_ylabel("samples")
        axis.set_title(f"{what.capitalize()} length")
    return png(figure)


def plot_shard_outcomes(names: list[str], accepted: list[int], rejected: list[int]) -> bytes:
    """Prompts accepted into the training set and prompts rejected, per shard."""
    figure, axis = pyplot().subplots(figsize=(8, 3))
    positions = range(len(names))
    axis.bar(positions, accepted, color="#3b8a4a", label="accepted")
    axis.bar(positions, rejected, bottom=accepted, color="#b8433a", label="rejected")
    axis.set_xticks(list(positions), [n.removeprefix("shard-") for n in names], rotation=90 if len(names) > 20 else 0)
    axis.set_xlabel("shard")
    axis.set_ylabel("prompts")
    axis.set_title("Accepted and rejected per shard")
    axis.legend()
    return png(figure)


def latency_over_time(timeline: list[dict[str, float]], points: int = 60) -> list[tuple[float, float]]:
    """(seconds into the attempt, mean request latency) from generation's samples, by Little's law.

    Each row counts the prompts finished by then and the mean requests in flight since the row before; over a
    window, mean latency = mean requests in flight ÷ completions per second. Windows without a completion have
    no latency and are left out; each attempt of a resumed run starts its own time axis.
    """
    attempts: dict[float, list[dict[str, float]]] = {}
    for sample in timeline:
        attempts.setdefault(sample["started_at"], []).append(sample)
    curve = []
    for samples in attempts.values():
        step = max(1, len(samples) // points)
        for at in range(step, len(samples), step):
            window = samples[at - step:at + 1]
            finished = window[-1]["done"] - window[0]["done"]
            if finished <= 0:
                continue
            busy = sum(b["in_flight"] * (b["t"] - a["t"]) for a, b in pairwise(window))
            curve.append((window[-1]["t"], busy / finished))
    return curve


def plot_latency(curve: list[tuple[float, float]]) -> bytes:
    figure, axis = pyplot().subplots(figsize=(8, 3))
    axis.plot([t for t, _ in curve], [latency for _, latency in curve], marker=".", color="#6a4c93")
    axis.set_xlabel("seconds into generation")
    axis.set_ylabel("seconds")
    axis.set_title("Mean request latency (requests in flight ÷ completions per second)")
    axis.set_ylim(bottom=0)
    return png(figure)


PLOT_FILES = {"reasoning and answer lengths": "reasoning_lengths.png",
              "accepted and rejected per shard": "shard_outcomes.png",
              "request latency over time": "request_latency.png"}


@dataclass(frozen=True)
class Plot:
    """A plot to draw, and the digest of what it is drawn from (its data, the plotting code, matplotlib's
    version)."""

    draw: Callable[[], bytes]
    digest: str


@cache
def _drawing_code() -> bytes:
    return b"".join([Path(__file__).read_bytes(), Path(plotting.__file__).read_bytes(),
                     importlib.metadata.version("matplotlib").encode()])


def _plot(draw: Callable[..., bytes], *data: Any) -> Plot:
    digest = hashlib.sha256(_drawing_code() + draw.__name__.encode())
    for values in map(np.asarray, data):
        digest.update(f"{values.dtype.str}{values.shape}".encode() + values.tobytes())
    return Plot(partial(draw, *data), digest.hexdigest())


def run_plots(shards: dict[str, ShardStatus], rows: list[dict[str, Any]],
              timeline: list[dict[str, float]]) -> dict[str, Plot]:
    """The report's plots, by title; a plot without data is left out."""
    reasoning = np.concatenate([np.asarray(s.reasoning_lengths) for s in shards.values()] or [np.empty(0)])
    answers = np.concatenate([np.asarray(s.answer_lengths) for s in shards.values()] or [np.empty(0)])
    plots = {}
    if len(reasoning):
        plots["reasoning and answer lengths"] = _plot(plot_lengths, reasoning, answers)
    if rows:
        plots["accepted and rejected per shard"] = _plot(
            plot_shard_outcomes, [r["shard"] for r in rows], [r["accepted"] for r in rows],
            [r["rejected"] for r in rows])
    curve = latency_over_time(timeline)
    if curve:
        plots["request latency over time"] = _plot(plot_latency, curve)
    return plots


def drawn_plots(store: RunStore, plots: dict[str, Plot], drawn: dict[str, str]) -> dict[str, bytes]:
    """Each plot's PNG, written to the run folder where it was not there already drawn from the same inputs
    (`drawn`: file -> digest, as the manifest recorded them)."""
    pngs = {}
    for title, plot in plots.items():
        file = PLOT_FILES[title]
        if drawn.get(file) == plot.digest and store.exists(file):
            pngs[title] = store.read_bytes(file)
        else:
            pngs[title] = plot.draw()
            store.write_bytes(file, pngs[title])
    return pngs
