"""The generation stage's Prefect tasks: one `generate` for every shard (one in-flight budget per endpoint), and
the shards it wrote handed on even when it ends short."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext

from eagle3_datagen.artifacts import GenerationOutcome, ShardRef
from eagle3_datagen.caching import handed_on
from eagle3_datagen.config import PipelineConfig, ServerConfig, ValidationConfig
from eagle3_datagen.errors import UserError, retry_unless_user_error
from eagle3_datagen.storage import RunLocation
from tasks.generation.progress import LiveProgress
from tasks.generation.records import GENERATIONS, GenerationSettings, marked_finished, retire_generations_beyond
from tasks.generation.scheduler import GenerationScheduler


class GenerationStopped(UserError):
    """`generate` ended short: its verdict (`cause`, as raised) and the shards it finished first, which go on to
    the next stages regardless. It reads as its cause: the same line and exit status."""

    def __init__(self, cause: UserError, finished: list[ShardRef]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.finished = finished
        self.exit_status = cause.exit_status

    def __reduce__(self) -> tuple[type[GenerationStopped], tuple[UserError, list[ShardRef]]]:
        """Persisted with the task's failed state: rebuilt from its fields, not from its message."""
        return type(self), (self.cause, self.finished)


@dataclass(frozen=True)
class GenerationJob:
    """Everything besides the prompts that changes what generation keeps, and so its cache key: the settings its
    records are pinned to, the thresholds its first answers are judged by, and whether servers without token ids
    are refused. The servers are not in it: another address for the same model changes no record."""

    settings: GenerationSettings
    validation: ValidationConfig
    sequence_source: str

    @classmethod
    def from_config(cls, config: PipelineConfig) -> GenerationJob:
        settings = GenerationSettings(config.model.name, config.profile, config.generation, config.data.source)
        return cls(settings, config.validation, config.sequences.source)


def cancel_event() -> threading.Event | None:
    """The event the flow run's task runner sets for this task run when the flow run stops: on SIGTERM (what
    Prefect's runner sends a deployment's flow run cancelled from the UI, or `kill`), Ctrl-C, or any other exit of
    the flow while the task runs. Prefect's thread-pool runner sets it, then waits for its threads: generation
    must see it, or every prompt left would be asked first. None where the runner keeps no such event (a Ray run).
    """
    flow_run, task_run = FlowRunContext.get(), TaskRunContext.get()
    events = getattr(getattr(flow_run, "task_runner", None), "_cancel_events", None)
    if task_run is None or not isinstance(events, dict):
        return None
    event = events.get(task_run.task_run.id)
    return event if isinstance(event, threading.Event) else None


@task(name="generate", task_run_name="{run.run_name}/generate", retries=1, retry_condition_fn=retry_unless_user_error,
      persist_result=True, cache_policy=NO_CACHE)
def generate(prompt_shards: list[ShardRef], job: GenerationJob, server: ServerConfig,
             run: RunLocation) -> list[ShardRef]:
    """Generate all shards with one shared in-flight budget; resumes from partial logs.

    The UI shows each shard's progress live (a table artifact). A run that ends short raises `GenerationStopped`,
    which still hands the shards it wrote to the next stages (see `generated_shards`). Where a marker vouches for
    every shard, nothing is read: they are handed on.
    """
    store = run.store()
    marked = [marked_finished(store, ref) for ref in prompt_shards]
    if all(ref is not None for ref in marked):
        retire_generations_beyond(store, len(prompt_shards), run_id=None)  # answers of prompts the dataset lost
        return handed_on([ref for ref in marked if ref is not None],
                         GENERATIONS.key(prompt_shards=prompt_shards, job=job))
    settings = job.settings
    scheduler = GenerationScheduler(store, settings, server, job.validation, get_run_logger(),
                                    sequence_source=job.sequence_source, stop=cancel_event())

    def in_flight_integral() -> tuple[float, float]:
        pool = scheduler.pool
        return pool.in_flight_integral() if pool is not None else (0.0, time.monotonic())

    def finished() -> int:
        return scheduler.counts.accepted + scheduler.counts.rejected + scheduler.counts.failed

    with LiveProgress(store, run.run_name, prompt_shards, settings.generation.n, scheduler.shard_counts, finished,
                      in_flight_integral) as progress:
        scheduler.on_progress = progress.set
        try:
            return scheduler.run(prompt_shards)
        except UserError as error:
            raise GenerationStopped(error, [scheduler.finished[i] for i in sorted(scheduler.finished)]) from error


@task(name="generated-shards", task_run_name="{run.run_name}/generated-shards", cache_policy=NO_CACHE)
def generated_shards(generation: list[ShardRef] | BaseException, run: RunLocation) -> GenerationOutcome:
    """The shards generation wrote, also when it failed for others (one failed shard never holds the rest back),
    and the error it failed with, as raised."""
    if isinstance(generation, GenerationStopped):
        return GenerationOutcome(generation.finished, generation.cause)
    if isinstance(generation, BaseException):
        return GenerationOutcome([], generation)
    return GenerationOutcome(generation)
