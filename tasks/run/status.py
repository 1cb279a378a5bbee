"""Each shard's status and counts per stage, read back from its artifacts (or their completion markers).

Read from storage, not from task results, so the manifest is right whichever tasks failed, and `rerun-failed`
can trust it.
"""

from __future__ import annotations

import io
import json
import statistics
from array import array
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from eagle3_datagen.artifacts import GenerationRecord, ShardRef, artifact_path, prompt_id_of, rejected_path, sha256_hex
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.storage import RunStore, iter_jsonl


def _reasoning_tokens(record: GenerationRecord, end_id: int, thinks: bool) -> int:
    ids = record.get("completion_token_ids") or []
    if not thinks:
        return 0
    return ids.index(end_id) if end_id in ids else len(ids)


def _summarized(store: RunStore, path: str, key: str, summarize: Callable[[bytes], dict[str, Any]]) -> dict[str, Any]:
    """A shard file's counts, kept in its completion marker under `key` the first time they are read: a re-run
    of a finished run reads markers, not shards."""
    marker = store.read_marker(path)
    if marker is not None and key in marker:
        return dict(marker[key])
    data = store.read_bytes(path)
    summary = {"sha256": sha256_hex(data), **summarize(data)}
    if marker is not None and marker["sha256"] == summary["sha256"]:
        store.add_to_marker(marker, **{key: summary})
    return summary


def _generations_summary(data: bytes, end_id: int, profile: ModelProfile) -> dict[str, Any]:
    """Counts and lengths of a shard's records, read one at a time; reasoning is measured on the records of modes
    that think."""
    reasoning_lengths, answer_lengths, records, with_reasoning, truncated = [], [], 0, 0, 0
    by_mode: dict[str, dict[str, int]] = {}
    by_turn: dict[str, Counter[str]] = {}  # per user turn of a rollout: samples, with tool calls, endings
    tool_calls = 0
    for record in iter_jsonl(data):
        mode = profile.mode_of(record)
        thinks = profile.mode(mode).thinks
        reasoning = _reasoning_tokens(record, end_id, thinks)
        answer = len(record.get("completion_token_ids") or []) - reasoning
        has_reasoning = bool(record["reasoning"].strip())
        records += 1
        truncated += record["finish_reason"] == "length"
        answer_lengths.append(answer)
        if thinks:
            reasoning_lengths.append(reasoning)
            with_reasoning += has_reasoning
        counts = by_mode.setdefault(mode, {"records": 0, "with_reasoning": 0, "reasoning_tokens": 0,
                                           "answer_tokens": 0})
        counts["records"] += 1
        counts["with_reasoning"] += has_reasoning
        counts["reasoning_tokens"] += reasoning
        counts["answer_tokens"] += answer
        tool_calls += bool(record.get("tool_calls"))
        if "turn" in record:
            counts_of_turn = by_turn.setdefault(str(record["user_turn"]), Counter())
            counts_of_turn["samples"] += 1
            counts_of_turn["with tool calls"] += bool(record.get("tool_calls"))
            if "ended" in record:
                counts_of_turn[record["ended"]] += 1
    return {
        "records": records,
        "reasoning_coverage": with_reasoning / max(1, len(reasoning_lengths)),
        "truncated": truncated,
        "mean_reasoning_tokens": statistics.fmean(reasoning_lengths) if reasoning_lengths else 0.0,
        "mean_answer_tokens": statistics.fmean(answer_lengths) if records else 0.0,
        "reasoning_lengths": reasoning_lengths,
        "answer_lengths": answer_lengths,
        "modes": by_mode,
        **({"samples_with_tool_calls": tool_calls} if tool_calls else {}),
        **({"user_turns": {turn: dict(counts) for turn, counts in by_turn.items()}} if by_turn else {}),
    }


def _sequences_summary(data: bytes) -> dict[str, Any]:
    names = pq.read_schema(io.BytesIO(data)).names
    with_mode, with_images = "mode" in names, "image_spans" in names
    table = pq.read_table(io.BytesIO(data), columns=["id", "num_tokens", "agrees", *(["mode"] if with_mode else []),
                                                     *(["image_spans"] if with_images else [])])
    agrees = [a for a in table.column("agrees").to_pylist() if a is not None]
    by_mode: dict[str, dict[str, int]] = {}
    if with_mode:
        for mode, tokens in zip(table.column("mode").to_pylist(), table.column("num_tokens").to_pylist(), strict=True):
            counts = by_mode.setdefault(mode, {"records": 0, "tokens": 0})
            counts["records"] += 1
            counts["tokens"] += tokens
    return {
        "records": table.num_rows,
        "tokens": sum(table.column("num_tokens").to_pylist()),
        "accepted_prompts": len({prompt_id_of(i) for i in table.column("id").to_pylist()}),
        "cross_checked": len(agrees),  # samples with server ids also rebuilt from text (sequences.cross_check_rate)
        "text_rebuild_agreement": sum(agrees) / len(agrees) if agrees else None,
        "modes": by_mode,
        **(_image_figures(table.column("image_spans").to_pylist()) if with_images else {}),
    }


def _image_figures(spans: list[list[list[int]]]) -> dict[str, int]:
    """Samples that show images, and the image tokens they hold (as the server expanded them)."""
    return {"image_samples": sum(1 for runs in spans if runs),
            "image_tokens": sum(end - start for runs in spans for start, end in runs)}


def _rejected(store: RunStore, path: str, mode_of: Callable[[str], str]) -> dict[str, Any]:
    """Refused prompts or samples, in all and per mode: a prompt's mode is a function of its id, so a refusal
    needs no record."""
    rows = store.read_jsonl(path) if store.exists(path) else []
    by_mode = Counter(mode_of(row["id"]) for row in rows)
    by_turn = Counter(str(row["user_turn"]) for row in rows if "user_turn" in row)
    return {"rejected": by_mode.total(), "rejected_by_mode": dict(by_mode),
            **({"rejected_by_turn": dict(by_turn)} if by_turn else {})}


@dataclass(frozen=True)
class StageStatus:
    """Where one stage of one shard stands (`done`, `pending`, `skipped`, `failed`, or validation's verdict), and
    the figures read from its artifacts, under the keys the manifest keeps."""

    status: str
    figures: Mapping[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status == "done"

    def get(self, key: str, default: Any = 0) -> Any:
        return self.figures.get(key, default)

    def as_manifest(self) -> dict[str, Any]:
        return {"status": self.status, **self.figures}


PENDING = StageStatus("pending")
NOT_REACHED = StageStatus("-")  # a stage after the one a shard stopped at


@dataclass(frozen=True)
class ShardStatus:
    """One shard's stages in pipeline order, as far as its artifacts go (a stage not reached is None), and the
    per-sample lengths its generations hold (plotted, not kept in the manifest)."""

    prompts: StageStatus
    generations: StageStatus | None = None
    validation: StageStatus | None = None
    sequences: StageStatus | None = None
    hidden_states: StageStatus | None = None
    # 4 bytes a sample (a tuple of ints held 8 to 36): a million samples' lengths stay 8 MB
    reasoning_lengths: array[int] = field(default_factory=lambda: array("I"))
    answer_lengths: array[int] = field(default_factory=lambda: array("I"))

    def stage(self, name: str) -> StageStatus:
        """The stage `name`, or NOT_REACHED (status `-`, no figures) when the shard stopped before it."""
        return getattr(self, name) or NOT_REACHED

    def stages(self) -> dict[str, StageStatus]:
        return {name: getattr(self, name) for name in SHARD_STATUS_STAGES if getattr(self, name) is not None}

    @property
    def reached(self) -> tuple[str, StageStatus]:
        """The last stage the shard has a status for, and that status."""
        return next(reversed(self.stages().items()))

    def as_manifest(self) -> dict[str, Any]:
        return {name: stage.as_manifest() for name, stage in self.stages().items()}


SHARD_STATUS_STAGES = ("prompts", "generations", "validation", "sequences", "hidden_states")


def shard_status(store: RunStore, prompts: ShardRef, hidden_states: bool, end_id: int, profile: ModelProfile,
                 mode_of: Callable[[str], str]) -> ShardStatus:
    """Per-stage status and counts of one shard, read from its artifacts (or their completion markers).

    `mode_of` names the mode of a prompt or sample id (the run's mix), for the per-mode counts.
    """
    index = prompts.index
    reached = {"prompts": StageStatus("done", {"records": prompts.num_records})}
    generations = artifact_path("generations", index)
    if not store.exists(generations):
        return ShardStatus(**reached, generations=PENDING)
    summary = _summarized(store, generations, f"report_by_mode_think_end_{end_id}",
                          lambda data: _generations_summary(data, end_id, profile))
    lengths = {key: array("I", summary.pop(key)) for key in ("reasoning_lengths", "answer_lengths")}
    reached["generations"] = StageStatus("done", {**summary,
                                                  **_rejected(store, rejected_path("generations", index), mode_of)})
    validation = artifact_path("validation", index)
    if not store.exists(validation):
        return ShardStatus(**reached, validation=PENDING, **lengths)
    report = store.read_json(validation)
    reached["validation"] = StageStatus(report["status"], {"reasons": report["reasons"], "rates": report["rates"]})
    sequences = artifact_path("sequences", index)
    seq_rejected = rejected_path("sequences", index)
    if report["status"] != "pass":
        return ShardStatus(**reached, sequences=StageStatus("skipped"), **lengths)
    if not store.exists(sequences):
        if store.exists(seq_rejected):  # the stage stopped the shard after writing why each sample was refused
            reasons = Counter(row["reason"] for row in store.read_jsonl(seq_rejected))
            reason, count = reasons.most_common(1)[0]
            return ShardStatus(**reached, sequences=StageStatus("failed", {"reasons": [f"{count} samples refused: "
                                                                                       f"{reason}"]}), **lengths)
        return ShardStatus(**reached, sequences=PENDING, **lengths)
    reached["sequences"] = StageStatus("done", {**_summarized(store, sequences, "report_by_mode", _sequences_summary),
                                                **_rejected(store, seq_rejected, mode_of)})
    if hidden_states:
        reached["hidden_states"] = _hidden_states_status(store, artifact_path("hidden_states", index))
    return ShardStatus(**reached, **lengths)


def _hidden_states_status(store: RunStore, index_path: str) -> StageStatus:
    if not store.exists(index_path):
        return PENDING
    data = store.read_bytes(index_path)
    hs = json.loads(data)
    return StageStatus("done", {
        "sha256": sha256_hex(data),
        "records": sum(p["num_samples"] for p in hs["parts"]),
        "accepted_prompts": len({prompt_id_of(i) for i in hs["samples"]}),
        "bytes": sum(p["bytes"] for p in hs["parts"]),
        "layers": {k: hs[k] for k in hs if "layer" in k or k == "final_state"},
        "compression": hs["compression"],
        **({"fp8_cosine": hs["fp8_cosine"]} if "fp8_cosine" in hs else {}),
    })


def fp8_fidelity(shards: dict[str, ShardStatus]) -> str | None:
    """What fp8 cost, in one line over the shards stored in fp8 (None if none is): the worst row's cosine, the
    lowest shard p1 and median, and how many rows (token x layer) fell under the 0.999 goal."""
    stats = [s.stage("hidden_states").get("fp8_cosine") for s in shards.values()]
    stats = [stat for stat in stats if stat]
    if not stats:
        return None
    under = sum(stat["under_0.999"] for stat in stats)
    rows = sum(stat["rows"] for stat in stats)
    return (f"min {min(stat['min'] for stat in stats):.4f}, p1 {min(stat['p1'] for stat in stats):.4f}, "
            f"p50 {min(stat['p50'] for stat in stats):.4f} (lowest shard); {under} of {rows} rows under 0.999")
