"""The generation stage's Prefect tasks: one `generate` for every shard (one in-flight budget per endpoint), and
the shards it wrote handed on even when it ends short."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.caching import STAGE_CACHE
from eagle3_datagen.config import ServerConfig, ValidationConfig
from eagle3_datagen.errors import UserError, retry_unless_user_error
from eagle3_datagen.storage import RunStore
from tasks.generation.progress import LiveProgress
from tasks.generation.records import GenerationSettings
from tasks.generation.scheduler import GenerationScheduler

FINISHED_SHARDS = "finished_shards"  # set on generation's error: the shards it wrote, which go on regardless


@task(name="generate", task_run_name="{run_name}/generate", retries=1, retry_condition_fn=retry_unless_user_error,
      persist_result=True, cache_policy=STAGE_CACHE - "server")
def generate(
    prompt_shards: list[ShardRef],
    settings: GenerationSettings,
    server: ServerConfig,
    validation: ValidationConfig,
    sequence_source: str,
    output_uri: str,
    run_name: str,
) -> list[ShardRef]:
    """Generate all shards with one shared in-flight budget; resumes from partial logs.

    The UI shows each shard's progress live (a table artifact). A run that ends short still hands the shards it
    wrote to the next stages: its error carries them (see `generated_shards`).
    """
    store = RunStore(output_uri, run_name)
    scheduler = GenerationScheduler(store, settings, server, validation, get_run_logger(),
                                    sequence_source=sequence_source)

    def in_flight_integral() -> tuple[float, float]:
        pool = getattr(scheduler, "pool", None)  # built once the run starts
        return pool.in_flight_integral() if pool else (0.0, time.monotonic())

    def finished() -> int:
        return scheduler.counts.accepted + scheduler.counts.rejected + scheduler.counts.failed

    with LiveProgress(store, run_name, prompt_shards, settings.generation.n, scheduler.shard_counts, finished,
                      in_flight_integral) as progress:
        scheduler.on_progress = progress.set
        try:
            return scheduler.run(prompt_shards)
        except UserError as error:
            setattr(error, FINISHED_SHARDS, [scheduler.finished[i] for i in sorted(scheduler.finished)])
            raise


@task(name="generated-shards", task_run_name="{run_name}/generated-shards", cache_policy=NO_CACHE)
def generated_shards(generation: list[ShardRef] | BaseException, run_name: str) -> list[ShardRef]:
    """The shards generation wrote, also when it failed for others: one failed shard never holds the rest back."""
    if isinstance(generation, BaseException):
        return list(getattr(generation, FINISHED_SHARDS, []))
    return generation
