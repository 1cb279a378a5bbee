"""Run bookkeeping: the manifest at the start and end of a run, the run report, and its reasoning-length plot.

Status is read back from the run's artifacts, not from task results, so the manifest is right whichever tasks
failed, and `rerun-failed` can trust it.
"""

from __future__ import annotations

import io
import json
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow.parquet as pq
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal

from eagle3_datagen import __version__
from eagle3_datagen.artifacts import MANIFEST, artifact_path, prompt_id_of, rejected_path, sha256_hex, shard_name
from eagle3_datagen.config import ConfigError, PipelineConfig, parse_config
from eagle3_datagen.errors import UserError, one_line
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.redaction import redact
from eagle3_datagen.storage import RunStore, parse_jsonl
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


@task(name="start-run", cache_policy=NO_CACHE)
def start_run(config: PipelineConfig) -> RunContext:
    """Prove the think tokens before any request, and record config and fingerprints in the manifest."""
    store = RunStore(config.output_uri, config.run_name)
    store.check_writable()
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
        raise ConfigError(f"{run_uri} has no {MANIFEST}: pass a run folder such as runs/demo or s3://bucket/x/run")
    return parse_config(store.read_json(MANIFEST)["config"], overrides)


def _reasoning_tokens(record: dict[str, Any], end_id: int) -> int:
    ids = record.get("completion_token_ids") or []
    return ids.index(end_id) if end_id in ids else len(ids)


def shard_status(store: RunStore, index: int, hidden_states: bool, end_id: int) -> dict[str, Any]:
    """Per-stage status and counts of one shard, read from its artifacts."""
    status: dict[str, Any] = {}
    prompts = artifact_path("prompts", index)
    status["prompts"] = {"status": "done", "records": len(store.read_jsonl(prompts))}
    generations = artifact_path("generations", index)
    if not store.exists(generations):
        status["generations"] = {"status": "pending"}
        return status
    data = store.read_bytes(generations)
    records = parse_jsonl(data)
    rejected = rejected_path("generations", index)
    reasoning_lengths = [_reasoning_tokens(r, end_id) for r in records]
    status["generations"] = {
        "status": "done",
        "sha256": sha256_hex(data),
        "records": len(records),
        "rejected": len(store.read_jsonl(rejected)) if store.exists(rejected) else 0,
        "reasoning_coverage": sum(bool(r["reasoning"].strip()) for r in records) / max(1, len(records)),
        "truncated": sum(r["finish_reason"] == "length" for r in records),
        "mean_reasoning_tokens": statistics.fmean(reasoning_lengths) if records else 0.0,
        "mean_answer_tokens": statistics.fmean(
            [len(r.get("completion_token_ids") or []) - n for r, n in zip(records, reasoning_lengths, strict=True)]
        ) if records else 0.0,
        "reasoning_lengths": reasoning_lengths,
    }
    validation = artifact_path("validation", index)
    if not store.exists(validation):
        status["validation"] = {"status": "pending"}
        return status
    report = store.read_json(validation)
    status["validation"] = {"status": report["status"], "reasons": report["reasons"], "rates": report["rates"]}
    sequences = artifact_path("sequences", index)
    if report["status"] != "pass" or not store.exists(sequences):
        status["sequences"] = {"status": "skipped" if report["status"] != "pass" else "pending"}
        return status
    data = store.read_bytes(sequences)
    table = pq.read_table(io.BytesIO(data), columns=["id", "num_tokens", "agrees"])
    agrees = [a for a in table.column("agrees").to_pylist() if a is not None]
    seq_rejected = rejected_path("sequences", index)
    status["sequences"] = {
        "status": "done",
        "sha256": sha256_hex(data),
        "records": table.num_rows,
        "rejected": len(store.read_jsonl(seq_rejected)) if store.exists(seq_rejected) else 0,
        "tokens": sum(table.column("num_tokens").to_pylist()),
        "accepted_prompts": len({prompt_id_of(i) for i in table.column("id").to_pylist()}),
        "text_rebuild_agreement": sum(agrees) / len(agrees) if agrees else None,
    }
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
            }
        else:
            status["hidden_states"] = {"status": "pending"}
    return status


def _final_stage(status: dict[str, Any]) -> str:
    return next(reversed(status))


def _plot(lengths: list[int]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.hist(lengths, bins=min(40, max(5, len(set(lengths)))), color="#3b6ea8")
    axis.set_xlabel("reasoning tokens per sample")
    axis.set_ylabel("samples")
    axis.set_title("Reasoning length distribution")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def render_report(run_name: str, shards: dict[str, dict[str, Any]], totals: dict[str, Any]) -> str:
    lines = [f"# Run {run_name}", "", "| shard | records | reasoning coverage | truncated | mean reasoning tok | "
             "mean answer tok | validation | last stage |", "|---|---|---|---|---|---|---|---|"]
    for name, status in shards.items():
        gen = status.get("generations", {})
        lines.append(
            f"| {name} | {gen.get('records', '-')} | {gen.get('reasoning_coverage', 0):.1%} | "
            f"{gen.get('truncated', '-')} | {gen.get('mean_reasoning_tokens', 0):.1f} | "
            f"{gen.get('mean_answer_tokens', 0):.1f} | {status.get('validation', {}).get('status', '-')} | "
            f"{_final_stage(status)}: {status[_final_stage(status)]['status']} |"
        )
    lines += ["", "| total | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in totals.items()]
    return "\n".join(lines) + "\n"


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(config: PipelineConfig, context: RunContext, rows: int, prompt_rejections: int,
               num_shards: int) -> dict[str, Any]:
    """Manifest, report.md, the plot and a UI artifact; fail the run if any shard fell short."""
    store = RunStore(config.output_uri, config.run_name)
    with_hidden = config.hidden_states.backend != "none"
    end_id = context.think_tokens["end_id"]
    shards = {shard_name(i): shard_status(store, i, with_hidden, end_id) for i in range(num_shards)}
    lengths = [n for s in shards.values() for n in s.get("generations", {}).pop("reasoning_lengths", [])]
    last_stage = "hidden_states" if with_hidden else "sequences"
    finished = [s for s in shards.values() if s.get(last_stage, {}).get("status") == "done"]
    rejected = prompt_rejections + sum(
        s.get(stage, {}).get("rejected", 0) for s in shards.values() for stage in ("generations", "sequences"))
    records = sum(s.get("generations", {}).get("records", 0) for s in shards.values())
    covered = sum(s["generations"]["records"] * s["generations"]["reasoning_coverage"]
                  for s in shards.values() if "records" in s.get("generations", {}))
    totals = {
        "input rows": rows,
        "rejected": rejected,
        "shards": num_shards,
        "shards finished": len(finished),
        "records generated": records,
        "reasoning coverage": f"{covered / max(1, records):.1%}",
        "sequence tokens": sum(s.get("sequences", {}).get("tokens", 0) for s in shards.values()),
        "hidden-state bytes": sum(s.get("hidden_states", {}).get("bytes", 0) for s in shards.values()),
    }
    report = render_report(config.run_name, shards, totals)
    store.write_text("report.md", report)
    if lengths:
        store.write_bytes("reasoning_lengths.png", _plot(lengths))
    create_markdown_artifact(key="run-report", markdown=report, description=f"eagle3-datagen {config.run_name}")
    cause = run_shortfall(shards, last_stage, num_shards, config.validation.min_accepted_rate, store)
    end_run(store, "failed" if cause else "completed", cause, shards=shards, totals=totals)
    if cause:
        raise RunFailed(cause)
    return {"run_uri": store.uri, "totals": totals, "report": report}


def run_shortfall(shards: dict[str, dict[str, Any]], last_stage: str, num_shards: int, min_accepted_rate: float,
                  store: RunStore) -> str | None:
    """Why the run produced less than it should, as one line; None when it is complete."""
    short = [name for name, s in shards.items() if s.get(last_stage, {}).get("status") != "done"]
    if short:
        return (f"{len(short)} of {num_shards} shards did not finish ({', '.join(short[:10])}): see "
                f"{store.uri}/{MANIFEST}; fix the cause and run again (finished shards are not redone)")
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
