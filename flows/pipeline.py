"""The EAGLE-3 data pipeline: prompts → generations → validation → sequences → hidden states (→ trainer files)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from prefect import Flow, flow, unmapped
from prefect.futures import PrefectFuture, as_completed
from prefect.utilities.annotations import allow_failure

from eagle3_datagen.config import HiddenStatesConfig, PipelineConfig
from eagle3_datagen.errors import UserError, user_errors_one_line_in_the_ui
from eagle3_datagen.execution import ClusterTaskRunner, check_task_runner, extraction_placement, task_runner_for
from eagle3_datagen.hidden_state_format import check_compression
from eagle3_datagen.holdout import Split
from eagle3_datagen.run_log import close_run_log, open_run_log
from eagle3_datagen.storage import RunLocation, RunStore
from tasks.evaluate import evaluate_draft_task
from tasks.export import ExportFormat, export_shard_task, finish_export_task, plan_export
from tasks.generation import (
    GenerationJob,
    generate,
    generated_shards,
    refuse_other_settings,
    unfinished_shards,
    unmarked_shards,
)
from tasks.health import ServerCheck, check_servers
from tasks.hidden_states import ExtractionSettings, extract_hidden_states
from tasks.prompts import PromptSettings, check_image_prompts, load_prompts
from tasks.run.lifecycle import (
    finish_run,
    record_run_end,
    recorded_config,
    release_run_lease,
    run_named,
    settled_output,
    settled_run,
    start_run,
    take_run_lease,
    work_states,
)
from tasks.sequences import SequenceSettings, build_sequence_shard
from tasks.validation import ValidationSettings, reopen_quarantined_shards, validate_generations
from tasks.verify import (
    PROGRESS_EVERY_S,
    conclude,
    progress_line,
    recorded_execution,
    rerun_plan,
    start_verification,
    verify_run,
    verify_shard,
)


@flow(name="eagle3-datagen", flow_run_name=run_named(), log_prints=True,
      on_completion=[release_run_lease, close_run_log],
      on_failure=[record_run_end("failed"), release_run_lease, close_run_log],
      on_crashed=[record_run_end("failed"), release_run_lease, close_run_log],
      on_cancellation=[record_run_end("cancelled"), release_run_lease, close_run_log])
def pipeline(config: PipelineConfig) -> dict[str, Any]:
    """Turn a prompt dataset into EAGLE-3 training data; every stage resumes and caches by content.

    Args:
        config: The run, section by section as in the YAML config (data, model, server, generation, validation,
            sequences, hidden states).
    """
    user_errors_one_line_in_the_ui()
    config = settled_output(config)
    check_task_runner(config.execution)
    check_compression(config.hidden_states.compression)  # not hours later, after generation
    run = RunLocation(config.output_uri, config.run_name)
    run.store().check_writable()  # before anything writes there: one line naming output_uri, on every path
    open_run_log(run.store())  # where the command opened none: a worker's run
    job = GenerationJob.from_config(config)
    refuse_other_settings(job.settings, run=run)  # before anything is written: a refused run changes nothing
    run = take_run_lease(run)  # one writer: every later write carries its epoch, refused once another takes over
    context = start_run(config, run=run)
    prompts_loaded = load_prompts(PromptSettings.from_config(config), run=run, return_state=True)
    prompts = prompts_loaded.result()
    check_image_prompts(prompts, profile=config.profile, backend=config.hidden_states.backend)

    # Each stage takes only what changes its output, in one settings object: with its inputs and output version it
    # is the key the stage records beside its output, so anything more would redo it when an unrelated setting
    # changes (eagle3_datagen/caching.py).
    unmarked = unmarked_shards(prompts.shards, run=run)  # unfinished, or found changed by a later stage
    if unfinished_shards(unmarked, run=run):
        check_servers(prompts.shards, check=ServerCheck.from_config(config), run=run)
    generation = generate.submit(prompts.shards, job=job, server=config.server, run=run)
    generated = generated_shards(allow_failure(generation), run=run)  # a failed shard holds none back

    validated = validate_generations.map(
        generated.shards, settings=unmapped(ValidationSettings.from_config(config)), run=unmapped(run))
    sequences = build_sequence_shard.map(
        validated, settings=unmapped(SequenceSettings.from_config(config, context.tokenizer_fingerprint,
                                                                  prompts.holdout)),
        run=unmapped(run))
    hidden: list[PrefectFuture[Any]] = []
    if config.hidden_states.backend != "none":
        with extraction_placement(config.execution):
            hidden = extract_hidden_states.map(
                sequences, extraction=unmapped(ExtractionSettings.from_config(config, context.target_fingerprint)),
                run=unmapped(run))

    every_stage = [allow_failure(f) for f in [generation, *validated, *sequences, *hidden]]  # failed ones too
    summary = finish_run.submit(context, prompts=prompts, generation=generated, wait_for=every_stage).result()
    return {**summary, "work_states": work_states({load_prompts: [prompts_loaded], generate: [generation],
                                                   validate_generations: validated, build_sequence_shard: sequences,
                                                   extract_hidden_states: hidden})}


class RunNotVerified(UserError):
    """The run is not complete and consistent: the verdict says why."""


# The pipeline for deployments whose runs use a Ray cluster (execution.task_runner: ray), named by the worker's
# RAY_ADDRESS.
pipeline_on_ray = pipeline.with_options(name="eagle3-datagen-ray", task_runner=ClusterTaskRunner())


def pipeline_for(config: PipelineConfig) -> Flow[[PipelineConfig], dict[str, Any]]:
    """The pipeline on the task runner a config asks for: a recorded Ray run is re-run on Ray."""
    return pipeline.with_options(task_runner=task_runner_for(config.execution))


@flow(name="eagle3-generation-only", flow_run_name=run_named("generation-only"), log_prints=True)
def generation_only(config: PipelineConfig) -> dict[str, Any]:
    """Everything that needs the generation servers and not the target model: up to the token sequences.

    Args:
        config: The run, as for the pipeline; its hidden-states section is ignored.
    """
    user_errors_one_line_in_the_ui()
    config = settled_output(config)  # named before the pipeline runs as a flow run of its own
    hidden_states = config.hidden_states.model_copy(update={"backend": "none"})
    return pipeline_for(config)(config.model_copy(update={"hidden_states": hidden_states}))


@flow(name="eagle3-rerun-failed", flow_run_name=run_named("rerun-failed"), log_prints=True)
def rerun_failed(run: str, redo_quarantined: bool = False) -> dict[str, Any]:
    """Run a recorded run again: finished shards are cached or found in storage, only the rest does work.

    Args:
        run: The run folder, absolute (`/data/runs/my-run`) or `s3://bucket/prefix/my-run`.
        redo_quarantined: Generate quarantined shards again (their old records are kept aside).
    """
    user_errors_one_line_in_the_ui()
    run = settled_run(run)
    config = recorded_config(run)  # a folder that holds no run is refused before anything else is said of it
    print(rerun_plan(verify_run(RunStore.at(run)), redo_quarantined))
    if redo_quarantined:
        reopen_quarantined_shards(run)
    return pipeline_for(config)(config)


@flow(name="eagle3-extract-only", flow_run_name=run_named("extract-only"), log_prints=True)
def extract_only(run: str, hidden_states: HiddenStatesConfig) -> dict[str, Any]:
    """Hidden states for an existing run's sequences, with new extraction settings; nothing is generated.

    Args:
        run: The run folder, absolute (`/data/runs/my-run`) or `s3://bucket/prefix/my-run`.
        hidden_states: The extraction settings to use instead of the recorded ones.
    """
    user_errors_one_line_in_the_ui()
    run = settled_run(run)
    config = recorded_config(run)
    return pipeline_for(config)(config.model_copy(update={"hidden_states": hidden_states}))


@flow(name="eagle3-export", flow_run_name=run_named("export"), log_prints=True)
def export(run: str, format: ExportFormat, out: str | None = None, split: Split = "train") -> dict[str, Any]:
    """A finished run's hidden states as the files SpecForge or speculators read; exported shards are kept.

    Args:
        run: The run folder, absolute (`/data/runs/my-run`) or `s3://bucket/prefix/my-run`.
        format: `specforge` or `speculators`.
        out: Where to write (any fsspec URI); default RUN/exports/FORMAT (FORMAT-holdout for the held-out split).
        split: `train` (the training samples), or `holdout` (the held-out ones drafts are judged on).
    """
    user_errors_one_line_in_the_ui()
    run = settled_run(run)
    plan = plan_export(run, format, out, split)
    shards = export_shard_task.map(unmapped(plan), plan.shards)
    return finish_export_task.submit(plan, wait_for=shards).result()


@flow(name="eagle3-verify", flow_run_name=run_named("verify"), log_prints=True)
def verify(run: str, deep: bool = False) -> dict[str, Any]:
    """Check a run's invariant from storage: its structure (no data read), or with `deep` every byte, its shards
    on the run's task runner (a Ray cluster's nodes for a run recorded with `execution.task_runner: ray`).

    Args:
        run: The run folder, absolute (`/data/runs/my-run`) or `s3://bucket/prefix/my-run`.
        deep: Read every byte (checksums, ids, every hidden-state part) instead of the structure alone.
    """
    user_errors_one_line_in_the_ui()
    store = RunStore.at(settled_run(run))
    result, layout = start_verification(store, deep)
    if layout is not None:
        location = RunLocation(*store.uri.rstrip("/").rsplit("/", 1))
        futures = verify_shard.map(unmapped(location), layout.shards, layout=unmapped(layout), deep=unmapped(deep))
        findings, started, shown = [], time.monotonic(), time.monotonic()
        for future in as_completed(futures):
            findings.append(future.result())
            if time.monotonic() - shown > PROGRESS_EVERY_S or len(findings) == len(futures):
                shown = time.monotonic()
                print(progress_line(len(findings), len(futures), sum(f.bytes_read for f in findings),
                                    shown - started))
        result = conclude(result, layout, findings, store)
    print(result.verdict())
    if not result.complete:
        raise RunNotVerified(result.verdict())
    return asdict(result)


@flow(name="eagle3-evaluate", flow_run_name=run_named("evaluate"), log_prints=True)
def evaluate(run: str, draft: str, steps: int | None = None) -> dict[str, Any]:
    """Judge a draft before training on it for days: its expected acceptance length on the run's held-out split,
    by mode, turn, source and tool call, as its trainer's validation computes it; a table and a plot in the run's
    report and in this run's artifacts.

    Args:
        run: The run folder, absolute (`/data/runs/my-run`) or `s3://bucket/prefix/my-run`.
        draft: A speculators EAGLE-3 checkpoint folder, on the worker's disk.
        steps: Tokens drafted per step (default: what the draft was trained for).
    """
    user_errors_one_line_in_the_ui()
    summary = evaluate_draft_task(settled_run(run), draft=draft, steps=steps)
    print(f"draft {summary['name']}: expected acceptance length {summary['acceptance_length']:.3f} over "
          f"{summary['samples']} held-out samples ({summary['steps']} drafted tokens per step)")
    return summary


def verify_for(run: str) -> Flow[[str, bool], dict[str, Any]]:
    """The verify flow on the task runner the run was recorded with (Ray's for a run on Ray)."""
    return verify.with_options(task_runner=task_runner_for(recorded_execution(RunStore.at(run))))
