"""The run from start to end: its folder settled, its manifest written at the start, and at the end the report
and the manifest's last word (completed, failed or cancelled), whichever way the flow ended."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.states import State
from prefect.tasks import Task

from eagle3_datagen import __version__
from eagle3_datagen.artifacts import (
    MANIFEST,
    MANIFEST_FORMAT,
    REPORT,
    TIMELINE,
    GenerationOutcome,
    PromptLoadResult,
    RunTotals,
    evaluations_section,
    prompt_id_of,
    shard_name,
    ui_key,
)
from eagle3_datagen.config import PipelineConfig, absolute_uri, checked_run_name, parse_config
from eagle3_datagen.errors import ConfigurationError, UserError, one_line
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.lease import Lease, left_by, release
from eagle3_datagen.modes import assign_mode
from eagle3_datagen.redaction import redact
from eagle3_datagen.storage import RunLocation, RunStore
from eagle3_datagen.think_tokens import discover_think_tokens, load_tokenizer, think_token_proof
from tasks.run.plots import PLOT_FILES, drawn_plots, run_plots
from tasks.run.report import mode_rows, render_report, run_shortfall, shard_row, turn_rows, where_outputs_are
from tasks.run.status import ShardStatus, fp8_fidelity, shard_status


class RunFailed(UserError):
    """The run produced less than it should: shards that did not finish, or too few prompts accepted."""


@dataclass(frozen=True)
class RunContext:
    """The run as started: its settled config, and facts fixed at its start that later stages' cache keys depend
    on."""

    config: PipelineConfig
    run: RunLocation  # with the epoch of the lease this run holds
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
    """The config with `output_uri` absolute, resolved once where the run started (refused under a worker), and
    a run name: a deployment run left without one takes its flow run's (one name in the UI, not two)."""
    from prefect.runtime import flow_run

    started_in = _started_in()
    update: dict[str, Any] = {"output_uri": absolute_uri(config.output_uri, started_in, "output_uri"),
                              **local_paths_made_absolute(config, started_in)}
    if not config.run_name:
        try:
            update["run_name"] = checked_run_name(flow_run.name or "")
        except ValueError as error:
            raise ConfigurationError(f"config key run_name: empty, and the flow run's name cannot name its folder: "
                                     f"{error}; set run_name, or name the flow run so") from None
    return config.model_copy(update=update)


def local_paths_made_absolute(config: PipelineConfig, started_in: Path | None) -> dict[str, Any]:
    """The dataset, tokenizer and target given as paths relative to where the run started, made absolute: a
    `rerun-failed` or a deployment run elsewhere then reads what this run read (a hub id is no local path, and
    stays as written)."""
    def absolute(value: str | None) -> str | None:
        if value is None or started_in is None or Path(value).is_absolute() or "://" in value:
            return value
        local = started_in / value
        return str(local.resolve()) if local.exists() else value

    return {"data": config.data.model_copy(update={"source": absolute(config.data.source)}),
            "model": config.model.model_copy(update={"tokenizer": absolute(config.model.tokenizer)}),
            "hidden_states": config.hidden_states.model_copy(update={"model": absolute(config.hidden_states.model)})}


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
        if config is not None and not run:
            return flow_run.name  # the run takes this name (settled_output): it stays
        run = run or posixpath.basename(str(parameters.get("run", "")).rstrip("/")) or "eagle3"
        return f"{run}/{kind}" if kind else run

    return name


def take_run_lease(run: RunLocation) -> RunLocation:
    """The run held by this flow run alone, or refused in one line naming who writes it; the location returned
    fences every write by the lease's epoch."""
    from prefect.runtime import flow_run

    return Lease.take(run.store(), get_run_logger(), flow_run=str(flow_run.id or "")).run


def release_run_lease(flow: Any, flow_run: Any, state: Any) -> None:
    """A flow hook, after the manifest's last word: the next start need not wait for the lease to expire."""
    release(_store_of(flow_run), str(flow_run.id))


def _store_of(flow_run: Any) -> RunStore:
    config = PipelineConfig.model_validate(flow_run.parameters["config"])
    return RunStore(config.output_uri, config.run_name or flow_run.name)


@task(name="start-run", task_run_name="{config.run_name}/start-run", cache_policy=NO_CACHE)
def start_run(config: PipelineConfig, run: RunLocation) -> RunContext:
    """Prove the think tokens before any request, and record config and fingerprints in the manifest."""
    store = run.store()
    create_markdown_artifact(key=ui_key(config.run_name, "output"), markdown=f"Output: {where_outputs_are(store.uri)}",
                             description=f"where {config.run_name} writes its outputs")
    manifest = store.read_json(MANIFEST) if store.exists(MANIFEST) else {"created_at": _now()}
    tokenizer_fingerprint = fingerprint(config.model.tokenizer)
    proof = think_token_proof(config.model.tokenizer, tokenizer_fingerprint, config.profile)
    proven = proof is not None and manifest.get("think_token_proof") == proof
    context = RunContext(
        config=config,
        run=run,
        tokenizer_fingerprint=tokenizer_fingerprint,
        target_fingerprint=fingerprint(config.target_model),
        think_tokens=manifest["think_tokens"] if proven else
        discover_think_tokens(load_tokenizer(config.model.tokenizer), config.profile).as_dict(),
    )
    if manifest.get("status") == "running":
        get_run_logger().warning(
            "the previous run of %s did not end (killed, or still running elsewhere; last update %s): resuming "
            "from what it wrote", store.uri, manifest.get("updated_at"))
        manifest.setdefault("interrupted", []).append(manifest.get("started_at") or manifest.get("updated_at"))
    for stale in ("cause", "ended_at"):
        manifest.pop(stale, None)
    manifest.update(
        format_version=MANIFEST_FORMAT,
        status="running",
        started_at=_now(),
        updated_at=_now(),
        package_version=__version__,
        config=config.model_dump(mode="json"),
        fingerprints={"tokenizer": context.tokenizer_fingerprint, "target_model": context.target_fingerprint},
        think_tokens=context.think_tokens,
        think_token_proof=proof,
    )
    store.write_json(MANIFEST, manifest)
    return context


def recorded_config(run_uri: str, overrides: list[str] | None = None) -> PipelineConfig:
    """The config a run was started with, from its manifest (for re-runs and extraction-only runs)."""
    store = RunStore.at(run_uri)
    if not store.exists(MANIFEST):
        raise ConfigurationError(f"{run_uri} has no {MANIFEST}: pass a run folder such as runs/demo or s3://bucket/x/run")
    manifest = store.read_json(MANIFEST)
    if manifest.get("format_version", 1) > MANIFEST_FORMAT:
        raise ConfigurationError(
            f"{run_uri} was written by a newer eagle3-datagen ({manifest.get('package_version')}, manifest format "
            f"{manifest['format_version']}): upgrade eagle3-datagen to re-run it")
    return parse_config(manifest["config"], overrides)


@task(name="finish-run", task_run_name="{context.config.run_name}/finish-run", cache_policy=NO_CACHE)
def finish_run(context: RunContext, prompts: PromptLoadResult, generation: GenerationOutcome) -> dict[str, Any]:
    """Manifest, report.md, its plots and the UI report; fail the run, naming the shards, if any fell short.

    `generation.error` is why generation ended short, as raised (None: it did not).
    """
    config, prompt_shards = context.config, prompts.shards
    store = context.run.store()
    with_hidden = config.hidden_states.backend != "none"
    end_id = context.think_tokens["end_id"]
    num_shards = len(prompt_shards)
    mix = config.generation.mode_mix(config.profile)
    shards = {shard_name(ref.index): shard_status(store, ref, with_hidden, end_id, config.profile,
                                                  lambda sample: assign_mode(prompt_id_of(sample), mix))
              for ref in prompt_shards}
    last_stage = "hidden_states" if with_hidden else "sequences"
    shard_rows = [shard_row(name, status, last_stage) for name, status in shards.items()]
    by_mode = mode_rows(shards, {entry.mode: entry.weight for entry in mix}, last_stage, prompts.holdout.prompts)
    by_turn = turn_rows(shards)
    timeline = store.read_jsonl(TIMELINE) if store.exists(TIMELINE) else []
    plotted = run_plots(shards, shard_rows, timeline)
    finished = [s for s in shards.values() if s.stage(last_stage).done]
    rejected = prompts.rejected + sum(
        s.stage(stage).get("rejected") for s in shards.values() for stage in ("generations", "sequences"))
    records = sum(s.stage("generations").get("records") for s in shards.values())
    thinking = [counts for s in shards.values() for mode, counts in s.stage("generations").get("modes", {}).items()
                if config.profile.mode(mode).thinks]  # coverage is of the records of modes that think
    covered = sum(c["with_reasoning"] for c in thinking) / max(1, sum(c["records"] for c in thinking))
    totals = RunTotals(
        input_rows=prompts.rows,
        rejected=rejected,
        shards=num_shards,
        shards_finished=len(finished),
        records_generated=records,
        reasoning_coverage=round(covered, 6),
        sequence_tokens=sum(s.stage("sequences").get("tokens") for s in shards.values()),
        hidden_state_bytes=sum(s.stage("hidden_states").get("bytes") for s in shards.values()),
        conversations=sum(s.prompts.get("records") for s in shards.values()) if by_turn else None,
        conversations_answered_in_full=sum(row["answered in full"] for row in by_turn) if by_turn else None,
        samples_with_tool_calls=sum(s.stage("generations").get("samples_with_tool_calls")
                                    for s in shards.values()) or None,
        fp8_fidelity=fp8_fidelity(shards),
        **image_totals(prompts, shards),
    )
    plots = drawn_plots(store, plotted, store.read_json(MANIFEST).get("plots", {}))
    report = render_report(config.run_name, store.uri, shard_rows, totals.labelled(), {},  # plots linked
                           [by_mode, by_turn])
    evaluated = evaluations_section(store.read_text(REPORT)) if store.exists(REPORT) else ""
    store.write_text(REPORT, report + "".join(f"\n![{title}]({file})\n" for title, file in PLOT_FILES.items()
                                              if title in plots) + evaluated)
    create_markdown_artifact(key=ui_key(config.run_name, "report"),
                             markdown=render_report(config.run_name, store.uri, shard_rows, totals.labelled(),
                                                    plots, [by_mode, by_turn]),
                             description=f"eagle3-datagen run {config.run_name}: per shard, totals and plots")
    error = generation.error
    generation_error = one_line(error) if error is not None else None
    cause = run_shortfall(shards, last_stage, num_shards, config.validation.min_accepted_rate, store,
                          generation_error)
    end_run(store, "failed" if cause else "completed", cause,
            shards={name: status.as_manifest() for name, status in shards.items()}, totals=totals.as_manifest(),
            modes=by_mode, holdout=prompts.holdout.model_dump(), **({"turns": by_turn} if by_turn else {}),
            plots={PLOT_FILES[title]: plot.digest for title, plot in plotted.items()})
    if cause and isinstance(error, UserError):
        raise error.restated(cause) from None  # its type and exit status, with what the run knows now
    if cause:
        raise RunFailed(cause)
    return {"run_uri": store.uri, "totals": totals.as_manifest(), "report": report}


def image_totals(prompts: PromptLoadResult, shards: dict[str, ShardStatus]) -> dict[str, Any]:
    """What a run of image prompts made of its images; nothing for a text run."""
    if not prompts.image_prompts:
        return {}
    samples = sum(s.stage("sequences").get("image_samples") for s in shards.values())
    tokens = sum(s.stage("sequences").get("image_tokens") for s in shards.values())
    return {"images": prompts.images, "images_per_image_prompt": round(prompts.images_shown / prompts.image_prompts, 3),
            "image_tokens_per_image_sample": round(tokens / samples, 1) if samples else None}


def end_run(store: RunStore, status: str, cause: str | None, **fields: Any) -> None:
    """The manifest's last word: completed, failed or cancelled, with the cause in one line."""
    manifest = store.read_json(MANIFEST) if store.exists(MANIFEST) else {}
    manifest.update(fields, status=status, updated_at=_now(), ended_at=_now())
    if cause:
        manifest["cause"] = redact(" ".join(cause.split()))
    store.write_json(MANIFEST, manifest)


def record_run_end(status: str) -> Callable[[Any, Any, Any], None]:
    """A Prefect flow hook that ends the manifest when the flow fails, crashes or is cancelled.

    The flow's `config` parameter names the run. Only the run's writer ends it: an attempt refused before it held
    the run's lease (other settings, another writer) leaves the manifest as it was, byte for byte.
    """

    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        run = left_by(_store_of(flow_run), str(flow_run.id))
        if run is None:
            return
        store = run.store()
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


def work_states(stages: dict[Task[..., Any], list[State | PrefectFuture[Any]]]) -> dict[str, dict[str, int]]:
    """Per work stage, how many of its task runs ended in which state, as this process saw them end.

    The server records task runs from events, a moment after they end (it was ~80 runs behind when a cached re-run
    of 100 shards ended on 2 cores): where every one was cached, the command's stage lines need not wait for it.
    """
    counts: dict[str, dict[str, int]] = {}
    for stage, ended in stages.items():
        states = counts.setdefault(stage.name, {})
        for item in ended:
            if isinstance(item, PrefectFuture):
                item.wait()  # ended already: this keeps its final state, so `.state` asks no server
                item = item.state
            states[item.name] = states.get(item.name, 0) + 1
    return counts
