"""Stage 8, on demand: judge a draft on the run's held-out samples, before anyone trains or serves it for days.

For every held-out sample (`data.holdout`), the draft drafts `steps` tokens from the target's own features with
its earlier predictions fed back, exactly as its trainer's validation does (speculators' own code, the same counts
pooled the same way), and from that the expected acceptance length of chain drafting. Broken down by mode, turn,
how the sequence was built, and whether the answer calls a tool, with bootstrap intervals over samples.

Writes RUN/evaluations/DRAFT/ (evaluation.json, evaluation.md, acceptance.png) and the run report's last section.
"""

from __future__ import annotations

import io
import posixpath
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_datagen.artifacts import (
    EVALUATIONS,
    EVALUATIONS_HEADING,
    MANIFEST,
    REPORT,
    artifact_path,
    evaluations_section,
)
from eagle3_datagen.errors import UserError
from eagle3_datagen.hidden_state_format import (
    Sample,
    check_format,
    part_split,
    read_part_samples,
    sample_ids_by_part,
    split_samples,
)
from eagle3_datagen.plotting import png, pyplot
from eagle3_datagen.storage import RunStore
from eagle3_datagen.trainers import speculators
from eagle3_datagen.training_reader import speculators_sample
from tasks.evaluate.acceptance import Evaluation, GroupRow, SampleScore, breakdown, table
from tasks.evaluate.draft import RunTarget, check_draft, load_draft, score, trained_steps

SEQUENCE_COLUMNS = ("id", "mode", "turn", "source", "has_tool_call")


class NothingToEvaluate(UserError):
    """The run has no finished held-out samples to judge a draft on."""


def run_target(indexes: list[dict[str, Any]]) -> RunTarget:
    """The target the run's hidden states come from; its vocabulary is read from its config."""
    from transformers import AutoConfig

    first = indexes[0]
    path = first["model"]["path"]
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError:
        raise NothingToEvaluate(f"the run's target {path} is not readable here: evaluate where the run's target "
                                "model is (the draft's targets are its own head and norm)") from None
    config = getattr(config, "text_config", config)
    return RunTarget(path, first["hidden_size"], config.vocab_size, list(first["aux_layers"]["input_to_layer"]))


def finished_indexes(store: RunStore, run_uri: str) -> list[tuple[int, dict[str, Any]]]:
    """Every shard's hidden-state index; a run with shards not extracted yet is refused (its estimate would be of
    part of the split)."""
    if not store.exists(MANIFEST):
        raise NothingToEvaluate(f"{run_uri} has no {MANIFEST}: give the folder of a run (e.g. runs/demo)")
    manifest = store.read_json(MANIFEST)
    if manifest["config"]["hidden_states"]["backend"] == "none":
        raise NothingToEvaluate(f"{run_uri} was run without hidden states (hidden_states.backend: none): run the "
                                "extract-only flow on it first")
    indexes = []
    for name in sorted(manifest.get("shards", {})):
        number = int(name.rsplit("-", 1)[1])
        rel = artifact_path("hidden_states", number)
        if not store.exists(rel):
            raise NothingToEvaluate(f"{run_uri}: {posixpath.dirname(rel)} is not finished: run `eagle3-datagen "
                                    f"rerun-failed {run_uri}` first")
        index = store.read_json(rel)
        check_format(index, rel)
        indexes.append((number, index))
    if not sum(split_samples(index, "holdout") for _, index in indexes):
        raise NothingToEvaluate(f"{run_uri} has no held-out samples (data.holdout was 0, or older than held-out "
                                "splits): run with data.holdout above 0")
    return indexes


def held_out_samples(store: RunStore, indexes: list[tuple[int, dict[str, Any]]]
                     ) -> Iterator[tuple[dict[str, Any], Sample]]:
    """Each held-out sample's row of the sequences stage (mode, turn, source, tool call) and its states."""
    for number, index in indexes:
        index_rel = artifact_path("hidden_states", number)
        data = store.read_bytes(artifact_path("sequences", number))
        columns = [c for c in SEQUENCE_COLUMNS if c in pq.read_schema(io.BytesIO(data)).names]
        rows = {row["id"]: row for row in pq.read_table(io.BytesIO(data), columns=columns).to_pylist()}
        ids = sample_ids_by_part(index)
        for part_number, part in enumerate(index["parts"]):
            if part_split(part) == "holdout":
                for sample in read_part_samples(store, index_rel, part, ids.get(part_number, [])):
                    yield rows[sample.id], sample


def draft_name(draft: str) -> str:
    """The evaluation's folder: the checkpoint folder's name, with its parent's for trainer layouts (`0`,
    `checkpoint_best`)."""
    path = Path(draft).resolve()
    name = f"{path.parent.name}-{path.name}" if path.name.isdigit() or path.name.startswith("checkpoint") \
        else path.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "draft"


def evaluate_draft(run_uri: str, draft: str, steps: int | None = None, device: str = "cpu",
                   progress: Callable[[int, int], None] = lambda done, total: None) -> Evaluation:
    """Judge `draft` on the run's held-out samples; write the evaluation and the report's section; its summary."""
    store = RunStore.at(run_uri)
    indexes = finished_indexes(store, run_uri)
    speculators()
    target = run_target([index for _, index in indexes])
    steps = steps or trained_steps(check_draft(draft, target))
    model = load_draft(draft, target, device)
    total = sum(split_samples(index, "holdout") for _, index in indexes)
    scores: list[SampleScore] = []
    started = time.monotonic()
    for row, sample in held_out_samples(store, indexes):
        if len(sample.input_ids) < 2:
            continue  # no next token to draft
        full, counted, alive = score(model, speculators_sample(sample), steps, device)
        scores.append(SampleScore(sample.id, row.get("mode") or "-", row.get("turn") or 0, row.get("source") or "-",
                                  bool(row.get("has_tool_call")), full, counted, alive))
        progress(len(scores), total)
    rows = breakdown(scores)
    name = draft_name(draft)
    summary = Evaluation(run=store.uri, draft=str(Path(draft).resolve()), name=name, target=target.path, steps=steps,
                         device=device, samples=len(scores), seconds=round(time.monotonic() - started, 1),
                         acceptance_length=rows[0]["acceptance_length"], full_acc=rows[0]["full_acc"], rows=rows)
    write_evaluation(store, summary, plot_acceptance(rows))
    return summary


def plot_acceptance(rows: list[GroupRow]) -> bytes:
    """Share of positions accepting at least k tokens, per mode and over all held-out samples."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(5, 3.2))
    for row in rows:
        if row["group"] in ("all", "mode"):
            steps = range(1, len(row["full_acc"]) + 1)
            label = "all" if row["group"] == "all" else row["value"]
            axes.plot(steps, row["full_acc"], marker="o", label=f"{label} (τ {row['acceptance_length']:.2f})")
    axes.set(xlabel="drafted tokens k", ylabel="P(accepted ≥ k)", ylim=(0, 1))
    axes.legend(fontsize=8)
    return png(figure)


def evaluation_markdown(summary: Evaluation, plot: str) -> str:
    return "\n".join([
        f"### Draft {summary['name']}", "",
        f"{summary['samples']} held-out samples, {summary['steps']} drafted tokens per step, target "
        f"{summary['target']}: expected acceptance length τ = {summary['acceptance_length']:.3f} (chain drafting, "
        "1 + Σ P(accepted ≥ k); intervals resample whole samples).", "",
        *table(summary["rows"]), "", f"![acceptance of {summary['name']}]({plot})", ""])


def write_evaluation(store: RunStore, summary: Evaluation, plot: bytes) -> None:
    """The evaluation's folder, then the report's section listing every evaluation of the run."""
    folder = posixpath.join(EVALUATIONS, summary["name"])
    store.write_bytes(posixpath.join(folder, "acceptance.png"), plot)
    store.write_text(posixpath.join(folder, "evaluation.md"),
                     evaluation_markdown(summary, "acceptance.png"))
    store.write_json(posixpath.join(folder, "evaluation.json"), summary)
    evaluations = [store.read_json(posixpath.join(folder, "evaluation.json")) for folder in store.list(EVALUATIONS)
                   if store.exists(posixpath.join(folder, "evaluation.json"))]
    sections = [evaluation_markdown(evaluation, posixpath.join(EVALUATIONS, evaluation["name"], "acceptance.png"))
                for evaluation in evaluations]
    report = store.read_text(REPORT) if store.exists(REPORT) else f"# Run {posixpath.basename(store.uri)}\n"
    kept = report[: len(report) - len(evaluations_section(report))]
    store.write_text(REPORT, kept + EVALUATIONS_HEADING + "\n" + "\n".join(sections))
