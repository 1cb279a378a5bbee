"""Run bookkeeping: where the run lives, the manifest at its start and end, the run report and its plots.

Status is read back from the run's artifacts, not from task results, so the manifest is right whichever tasks
failed, and `rerun-failed` can trust it. The report is a markdown file in the run folder and a Prefect artifact
scoped to the run, its plots inline, so the UI shows what the run made without opening the storage.
"""

from __future__ import annotations

import base64
import io
import json
import posixpath
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal

from eagle3_datagen import __version__
from eagle3_datagen.artifacts import (
    MANIFEST,
    TIMELINE,
    ShardRef,
    artifact_path,
    prompt_id_of,
    rejected_path,
    sha256_hex,
    shard_name,
    ui_key,
)
from eagle3_datagen.config import PipelineConfig, absolute_uri, parse_config
from eagle3_datagen.errors import ConfigurationError, UserError, one_line
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.modes import assign_mode
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.redaction import redact
from eagle3_datagen.storage import RunStore, iter_jsonl
from eagle3_datagen.think_tokens import discover_think_tokens, load_tokenizer


class RunFailed(UserError):
    """The run produced less than it should: shards that did not finish, or too few prompts accepted."""


@dataclass(frozen=True)
class RunContext:
    """Facts fixed at the start of a run that later stages' cache keys depend on."""

    tokenizer_fingerprint: str
    target_fingerprint: str
    think_tokens: dict[str, Any]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _started_in() -> Path | None:
    """The directory a run was started from; None for a deployment run (its worker's folder is temporary)."""
    from prefect.runtime import deployment

    return None if deployment.id else Path.cwd()


def settled_output(config: PipelineConfig) -> PipelineConfig:
    """The config with `output_uri` absolute, resolved once where the run started (refused under a worker)."""
    return config.model_copy(update={"output_uri": absolute_uri(config.output_uri, _started_in(), "output_uri")})


def settled_run(run: str) -> str:
    """A run folder given as a parameter, absolute (refused relative under a worker, like `output_uri`)."""
    return absolute_uri(run, _started_in(), "run")


def run_named(kind: str = "") -> Callable[[], str]:
    """A flow-run name after the run it works on (`my-run`, `my-run/rerun-failed`), not Prefect's random one."""

    def name() -> str:
        from prefect.runtime import flow_run

        parameters = flow_run.parameters
        config = parameters.get("config")
        run = config.get("run_name") if isinstance(config, dict) else getattr(config, "run_name", None)
        run = run or posixpath.basename(str(parameters.get("run", "")).rstrip("/")) or "eagle3"
        return f"{run}/{kind}" if kind else run

    return name


def where_outputs_are(uri: str) -> str:
    """The run folder as text to copy, with the commands that list and check it: a browser opens no `file://`
    link from an http page, nor an `s3://` one at all."""
    listing = f"aws s3 ls {uri}/" if uri.startswith("s3://") else f"ls {uri}"
    return f"`{uri}` (list it: `{listing}`; check it: `eagle3-datagen verify {uri}`)"


@task(name="start-run", task_run_name="{config.run_name}/start-run", cache_policy=NO_CACHE)
def start_run(config: PipelineConfig) -> RunContext:
    """Prove the think tokens before any request, and record config and fingerprints in the manifest."""
    store = RunStore(config.output_uri, config.run_name)
    store.check_writable()
    create_markdown_artifact(key=ui_key(config.run_name, "output"), markdown=f"Output: {where_outputs_are(store.uri)}",
                             description=f"where {config.run_name} writes its outputs")
    spec = discover_think_tokens(load_tokenizer(config.model.tokenizer), config.profile)
    context = RunContext(
        tokenizer_fingerprint=fingerprint(config.model.tokenizer),
        target_fingerprint=fingerprint(config.target_model),
        think_tokens=spec.as_dict(),
    )
    manifest = store.read_json(MANIFEST) if store.exists(MANIFEST) else {"created_at": _now()}
    if manifest.get("status") == "running":
        get_run_logger().warning(
            "the previous run of %s did not end (killed, or still running elsewhere; last update %s): resuming "
            "from what it wrote", store.uri, manifest.get("updated_at"))
        manifest.setdefault("interrupted", []).append(manifest.get("started_at") or manifest.get("updated_at"))
    for stale in ("cause", "ended_at"):
        manifest.pop(stale, None)
    manifest.update(
        status="running",
        started_at=_now(),
        updated_at=_now(),
        package_version=__version__,
        config=config.model_dump(mode="json"),
        fingerprints={"tokenizer": context.tokenizer_fingerprint, "target_model": context.target_fingerprint},
        think_tokens=context.think_tokens,
    )
    store.write_json(MANIFEST, manifest)
    return context


def recorded_config(run_uri: str, overrides: list[str] | None = None) -> PipelineConfig:
    """The config a run was started with, from its manifest (for re-runs and extraction-only runs)."""
    store = RunStore.at(run_uri)
    if not store.exists(MANIFEST):
        raise ConfigurationError(f"{run_uri} has no {MANIFEST}: pass a run folder such as runs/demo or s3://bucket/x/run")
    return parse_config(store.read_json(MANIFEST)["config"], overrides)


def _reasoning_tokens(record: dict[str, Any], end_id: int, thinks: bool) -> int:
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
    return {
        "records": records,
        "reasoning_coverage": with_reasoning / max(1, len(reasoning_lengths)),
        "truncated": truncated,
        "mean_reasoning_tokens": statistics.fmean(reasoning_lengths) if reasoning_lengths else 0.0,
        "mean_answer_tokens": statistics.fmean(answer_lengths) if records else 0.0,
        "reasoning_lengths": reasoning_lengths,
        "answer_lengths": answer_lengths,
        "modes": by_mode,
    }


def _sequences_summary(data: bytes) -> dict[str, Any]:
    with_mode = "mode" in pq.read_schema(io.BytesIO(data)).names
    table = pq.read_table(io.BytesIO(data), columns=["id", "num_tokens", "agrees", *(["mode"] if with_mode else [])])
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
    }


def _rejected(store: RunStore, path: str, mode_of: Callable[[str], str]) -> dict[str, Any]:
    """Refused prompts or samples, in all and per mode: a prompt's mode is a function of its id, so a refusal
    needs no record."""
    by_mode = Counter(mode_of(row["id"]) for row in store.read_jsonl(path)) if store.exists(path) else Counter()
    return {"rejected": by_mode.total(), "rejected_by_mode": dict(by_mode)}


def shard_status(store: RunStore, prompts: ShardRef, hidden_states: bool, end_id: int, profile: ModelProfile,
                 mode_of: Callable[[str], str]) -> dict[str, Any]:
    """Per-stage status and counts of one shard, read from its artifacts (or their completion markers).

    `mode_of` names the mode of a prompt or sample id (the run's mix), for the per-mode counts.
    """
    index = prompts.index
    status: dict[str, Any] = {"prompts": {"status": "done", "records": prompts.num_records}}
    generations = artifact_path("generations", index)
    if not store.exists(generations):
        status["generations"] = {"status": "pending"}
        return status
    summary = _summarized(store, generations, f"report_by_mode_think_end_{end_id}",
                          lambda data: _generations_summary(data, end_id, profile))
    status["generations"] = {"status": "done", **summary,
                             **_rejected(store, rejected_path("generations", index), mode_of)}
    validation = artifact_path("validation", index)
    if not store.exists(validation):
        status["validation"] = {"status": "pending"}
        return status
    report = store.read_json(validation)
    status["validation"] = {"status": report["status"], "reasons": report["reasons"], "rates": report["rates"]}
    sequences = artifact_path("sequences", index)
    seq_rejected = rejected_path("sequences", index)
    if report["status"] != "pass":
        status["sequences"] = {"status": "skipped"}
        return status
    if not store.exists(sequences):
        status["sequences"] = {"status": "pending"}
        if store.exists(seq_rejected):  # the stage stopped the shard after writing why each sample was refused
            reasons = Counter(row["reason"] for row in store.read_jsonl(seq_rejected))
            reason, count = reasons.most_common(1)[0]
            status["sequences"] = {"status": "failed", "reasons": [f"{count} samples refused: {reason}"]}
        return status
    status["sequences"] = {"status": "done", **_summarized(store, sequences, "report_by_mode", _sequences_summary),
                           **_rejected(store, seq_rejected, mode_of)}
    if hidden_states:
        index_path = artifact_path("hidden_states", index)
        if store.exists(index_path):
            data = store.read_bytes(index_path)
            hs = json.loads(data)
            status["hidden_states"] = {
                "status": "done",
                "sha256": sha256_hex(data),
                "records": sum(p["num_samples"] for p in hs["parts"]),
                "accepted_prompts": len({prompt_id_of(i) for i in hs["samples"]}),
                "bytes": sum(p["bytes"] for p in hs["parts"]),
                "layers": {k: hs[k] for k in hs if "layer" in k or k == "final_state"},
                "compression": hs["compression"],
                **({"fp8_cosine": hs["fp8_cosine"]} if "fp8_cosine" in hs else {}),
            }
        else:
            status["hidden_states"] = {"status": "pending"}
    return status


def fp8_fidelity(shards: dict[str, dict[str, Any]]) -> str | None:
    """What fp8 cost, in one line over the shards stored in fp8 (None if none is): the worst row's cosine, the
    lowest shard p1 and median, and how many rows (token x layer) fell under the 0.999 goal."""
    stats = [s["hidden_states"]["fp8_cosine"] for s in shards.values() if "fp8_cosine" in s.get("hidden_states", {})]
    if not stats:
        return None
    under = sum(stat["under_0.999"] for stat in stats)
    rows = sum(stat["rows"] for stat in stats)
    return (f"min {min(stat['min'] for stat in stats):.4f}, p1 {min(stat['p1'] for stat in stats):.4f}, "
            f"p50 {min(stat['p50'] for stat in stats):.4f} (lowest shard); {under} of {rows} rows under 0.999")


def _final_stage(status: dict[str, Any]) -> str:
    return next(reversed(status))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(figure: Any) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    _pyplot().close(figure)
    return buffer.getvalue()


def plot_lengths(reasoning: list[int], answers: list[int]) -> bytes:
    """Histograms of reasoning and answer tokens per sample."""
    figure, axes = _pyplot().subplots(1, 2, figsize=(8, 3))
    for axis, lengths, what in ((axes[0], reasoning, "reasoning"), (axes[1], answers, "answer")):
        axis.hist(lengths, bins=min(40, max(5, len(set(lengths)))), color="#3b6ea8")
        axis.set_xlabel(f"{what} tokens per sample")
        axis.set_ylabel("samples")
        axis.set_title(f"{what.capitalize()} length")
    return _png(figure)


def plot_shard_outcomes(names: list[str], accepted: list[int], rejected: list[int]) -> bytes:
    """Prompts accepted into the training set and prompts rejected, per shard."""
    figure, axis = _pyplot().subplots(figsize=(8, 3))
    positions = range(len(names))
    axis.bar(positions, accepted, color="#3b8a4a", label="accepted")
    axis.bar(positions, rejected, bottom=accepted, color="#b8433a", label="rejected")
    axis.set_xticks(list(positions), [n.removeprefix("shard-") for n in names], rotation=90 if len(names) > 20 else 0)
    axis.set_xlabel("shard")
    axis.set_ylabel("prompts")
    axis.set_title("Accepted and rejected per shard")
    axis.legend()
    return _png(figure)


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
    figure, axis = _pyplot().subplots(figsize=(8, 3))
    axis.plot([t for t, _ in curve], [latency for _, latency in curve], marker=".", color="#6a4c93")
    axis.set_xlabel("seconds into generation")
    axis.set_ylabel("seconds")
    axis.set_title("Mean request latency (requests in flight ÷ completions per second)")
    axis.set_ylim(bottom=0)
    return _png(figure)


def shard_row(name: str, status: dict[str, Any], last_stage: str) -> dict[str, Any]:
    """What the report says of one shard: records, accepted and rejected prompts, reasoning, lengths, stage."""
    gen = status.get("generations", {})
    stage = _final_stage(status)
    return {
        "shard": name,
        "records": gen.get("records", 0),
        "accepted": status.get(last_stage, {}).get("accepted_prompts", 0),
        "rejected": gen.get("rejected", 0) + status.get("sequences", {}).get("rejected", 0),
        "reasoning coverage": f"{gen.get('reasoning_coverage', 0):.1%}",
        "truncated": gen.get("truncated", 0),
        "mean reasoning tok": f"{gen.get('mean_reasoning_tokens', 0):.1f}",
        "mean answer tok": f"{gen.get('mean_answer_tokens', 0):.1f}",
        "validation": status.get("validation", {}).get("status", "-"),
        "stage reached": f"{stage}: {status[stage]['status']}",
    }


def mode_rows(shards: dict[str, dict[str, Any]], weights: dict[str, float], last_stage: str) -> list[dict[str, Any]]:
    """What the report says of each mode of the run's mix: records, samples kept and refused, lengths.

    Kept samples are those of shards that reached the last stage; refused ones were refused by the server or by
    the sequences stage (not provably exact, or reasoning in a mode answered without it).
    """
    total_weight = sum(weights.values())
    rows = []
    for mode, weight in weights.items():
        generated = [s["generations"].get("modes", {}).get(mode, {}) for s in shards.values() if "generations" in s]
        records = sum(g.get("records", 0) for g in generated)
        kept = sum(s["sequences"].get("modes", {}).get(mode, {}).get("records", 0) for s in shards.values()
                   if s.get(last_stage, {}).get("status") == "done")
        refused = sum(s.get(stage, {}).get("rejected_by_mode", {}).get(mode, 0) for s in shards.values()
                      for stage in ("generations", "sequences"))
        rows.append({
            "mode": mode,
            "share asked": f"{weight / total_weight:.0%}",
            "records": records,
            "kept": kept,
            "refused": refused,
            "with reasoning": f"{sum(g.get('with_reasoning', 0) for g in generated) / max(1, records):.1%}",
            "mean reasoning tok": f"{sum(g.get('reasoning_tokens', 0) for g in generated) / max(1, records):.1f}",
            "mean answer tok": f"{sum(g.get('answer_tokens', 0) for g in generated) / max(1, records):.1f}",
        })
    return rows


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows)]


def render_report(run_name: str, run_uri: str, rows: list[dict[str, Any]], totals: dict[str, Any],
                  plots: dict[str, bytes], modes: list[dict[str, Any]]) -> str:
    """The report: output location, one row per shard, one per mode, totals, and the plots inline (PNG data URIs,
    which the Prefect UI renders in a markdown artifact)."""
    lines = [f"# Run {run_name}", "", f"Output: {where_outputs_are(run_uri)}", "", *_table(rows)]
    if modes:
        lines += ["", *_table(modes)]
    lines += ["", "| total | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in totals.items()]
    for title, png in plots.items():
        lines += ["", f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})"]
    return "\n".join(lines) + "\n"


PLOT_FILES = {"reasoning and answer lengths": "reasoning_lengths.png",
              "accepted and rejected per shard": "shard_outcomes.png",
              "request latency over time": "request_latency.png"}


def run_plots(shards: dict[str, dict[str, Any]], rows: list[dict[str, Any]],
              timeline: list[dict[str, float]]) -> dict[str, bytes]:
    """The report's plots, by title; a plot without data is left out."""
    reasoning = [n for s in shards.values() for n in s.get("generations", {}).get("reasoning_lengths", [])]
    answers = [n for s in shards.values() for n in s.get("generations", {}).get("answer_lengths", [])]
    plots = {}
    if reasoning:
        plots["reasoning and answer lengths"] = plot_lengths(reasoning, answers)
    if rows:
        plots["accepted and rejected per shard"] = plot_shard_outcomes(
            [r["shard"] for r in rows], [r["accepted"] for r in rows], [r["rejected"] for r in rows])
    curve = latency_over_time(timeline)
    if curve:
        plots["request latency over time"] = plot_latency(curve)
    return plots


@task(name="finish-run", task_run_name="{config.run_name}/finish-run", cache_policy=NO_CACHE)
def finish_run(config: PipelineConfig, context: RunContext, rows: int, prompt_rejections: int,
               prompt_shards: list[ShardRef], generation: list[Any] | BaseException) -> dict[str, Any]:
    """Manifest, report.md, its plots and the UI report; fail the run, naming the shards, if any fell short.

    `generation` is the generation task's result, or its error when it ended short.
    """
    store = RunStore(config.output_uri, config.run_name)
    with_hidden = config.hidden_states.backend != "none"
    end_id = context.think_tokens["end_id"]
    num_shards = len(prompt_shards)
    mix = config.generation.mode_mix(config.profile)
    shards = {shard_name(ref.index): shard_status(store, ref, with_hidden, end_id, config.profile,
                                                  lambda sample: assign_mode(prompt_id_of(sample), mix))
              for ref in prompt_shards}
    last_stage = "hidden_states" if with_hidden else "sequences"
    shard_rows = [shard_row(name, status, last_stage) for name, status in shards.items()]
    by_mode = mode_rows(shards, {entry.mode: entry.weight for entry in mix}, last_stage)
    timeline = store.read_jsonl(TIMELINE) if store.exists(TIMELINE) else []
    plots = run_plots(shards, shard_rows, timeline)
    for status in shards.values():
        for kept_out in ("reasoning_lengths", "answer_lengths"):  # per-sample lists: plotted, not in the manifest
            status.get("generations", {}).pop(kept_out, None)
    finished = [s for s in shards.values() if s.get(last_stage, {}).get("status") == "done"]
    rejected = prompt_rejections + sum(
        s.get(stage, {}).get("rejected", 0) for s in shards.values() for stage in ("generations", "sequences"))
    records = sum(s.get("generations", {}).get("records", 0) for s in shards.values())
    thinking = [counts for s in shards.values() for mode, counts in s.get("generations", {}).get("modes", {}).items()
                if config.profile.mode(mode).thinks]  # coverage is of the records of modes that think
    covered = sum(c["with_reasoning"] for c in thinking) / max(1, sum(c["records"] for c in thinking))
    totals = {
        "input rows": rows,
        "rejected": rejected,
        "shards": num_shards,
        "shards finished": len(finished),
        "records generated": records,
        "reasoning coverage": f"{covered:.1%}",
        "sequence tokens": sum(s.get("sequences", {}).get("tokens", 0) for s in shards.values()),
        "hidden-state bytes": sum(s.get("hidden_states", {}).get("bytes", 0) for s in shards.values()),
    }
    if fidelity := fp8_fidelity(shards):
        totals["fp8 cosine to the model-dtype states"] = fidelity
    for title, png in plots.items():
        store.write_bytes(PLOT_FILES[title], png)
    report = render_report(config.run_name, store.uri, shard_rows, totals, {}, by_mode)  # the file links its plots
    store.write_text("report.md", report + "".join(f"\n![{title}]({file})\n" for title, file in PLOT_FILES.items()
                                                   if title in plots))
    create_markdown_artifact(key=ui_key(config.run_name, "report"),
                             markdown=render_report(config.run_name, store.uri, shard_rows, totals, plots, by_mode),
                             description=f"eagle3-datagen run {config.run_name}: per shard, totals and plots")
    generation_error = one_line(generation) if isinstance(generation, BaseException) else None
    cause = run_shortfall(shards, last_stage, num_shards, config.validation.min_accepted_rate, store,
                          generation_error)
    end_run(store, "failed" if cause else "completed", cause, shards=shards, totals=totals, modes=by_mode)
    if cause and isinstance(generation, UserError):
        raise generation.restated(cause) from None  # its type and exit status, with what the run knows now
    if cause:
        raise RunFailed(cause)
    return {"run_uri": store.uri, "totals": totals, "report": report}


STAGES = ("generations", "validation", "sequences", "hidden_states")


def run_shortfall(shards: dict[str, dict[str, Any]], last_stage: str, num_shards: int, min_accepted_rate: float,
                  store: RunStore, generation_error: str | None = None) -> str | None:
    """Why the run produced less than it should, as one line naming the shards; None when it is complete."""
    short = [name for name, s in shards.items() if s.get(last_stage, {}).get("status") != "done"]
    if generation_error and not short:  # refused before asking (other settings): the shards are from before
        return generation_error
    if short:
        more = f" and {len(short) - 10} more" if len(short) > 10 else ""
        others = f"; the others went on to {last_stage}" if len(short) < num_shards else ""
        which = f"{len(short)} of {num_shards} shards did not finish ({', '.join(short[:10])}{more}{others})"
        if generation_error:
            return f"{generation_error}; {which}"
        why = next((f"{name} {stage}: {s[stage]['reasons'][0]}; " for name in short for stage in STAGES
                    if (s := shards[name]).get(stage, {}).get("reasons")), "")
        return (f"{which}: {why}see {store.uri}/{MANIFEST}; fix the cause and run again (finished shards are not "
                "redone)")
    prompts = sum(s["prompts"]["records"] for s in shards.values())
    accepted = sum(s[last_stage].get("accepted_prompts", 0) for s in shards.values())
    rate = accepted / max(1, prompts)
    if accepted and rate >= min_accepted_rate:
        return None
    reasons = Counter(row["reason"] for rel in store.list("rejected", ".jsonl") for row in store.read_jsonl(rel))
    common = ""
    if reasons:
        reason, count = reasons.most_common(1)[0]
        common = f"; most common reason ({count}×): {reason}"
    return (f"only {accepted} of {prompts} prompts reached the training set ({rate:.0%} < "
            f"validation.min_accepted_rate {min_accepted_rate:.0%}){common}; see {store.uri}/rejected/")


def end_run(store: RunStore, status: str, cause: str | None, **fields: Any) -> None:
    """The manifest's last word: completed, failed or cancelled, with the cause in one line."""
    manifest = store.read_json(MANIFEST) if store.exists(MANIFEST) else {}
    manifest.update(fields, status=status, updated_at=_now(), ended_at=_now())
    if cause:
        manifest["cause"] = redact(" ".join(cause.split()))
    store.write_json(MANIFEST, manifest)


def record_run_end(status: str) -> Callable[[Any, Any, Any], None]:
    """A Prefect flow hook that ends the manifest when the flow fails, crashes or is cancelled.

    The flow's `config` parameter names the run. A run that never got as far as its manifest leaves none.
    """

    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        config = PipelineConfig.model_validate(flow_run.parameters["config"])
        store = RunStore(config.output_uri, config.run_name)
        manifest = store.read_json(MANIFEST) if store.exists(MANIFEST) else {}
        if manifest.get("status") != "running":
            return  # finish-run already ended it, or the run failed before it began
        error = None if status == "cancelled" else state.result(raise_on_failure=False)
        if status == "cancelled" or isinstance(error, TerminationSignal | KeyboardInterrupt):
            end_run(store, "cancelled", "stopped by a termination signal or a cancel: run again to resume; "
                                        "finished work is kept")
            return
        end_run(store, status, one_line(error) if isinstance(error, BaseException) else state.message or state.name)

    hook.__name__ = f"record-run-{status}"
    return hook
