"""Stage 3: chat completions for every prompt, reasoning and answer, with one in-flight budget per endpoint.

`scheduler` sends the requests, `pool` shares the budget and backs off failing endpoints, `budget` moves it with
the server's load (`server.max_in_flight: auto`), `probation` judges the first answers before the run may spend
more, and `records` keeps what was answered (partial logs, finished shards, the settings a run is pinned to).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import ArtifactUpdate

from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.caching import STAGE_CACHE
from eagle3_datagen.config import ServerConfig, ValidationConfig
from eagle3_datagen.errors import retry_unless_user_error
from eagle3_datagen.storage import RunStore
from tasks.generation.records import (
    GenerationError,
    GenerationSettings,
    partial_log_path,
    read_partial_log,
    unfinished_shards,
)
from tasks.generation.scheduler import generate_async

__all__ = ["GenerationError", "GenerationSettings", "generate", "generate_async", "partial_log_path",
           "read_partial_log", "unfinished_shards"]

PROGRESS_PUSH_EVERY_S = 5.0


class _ProgressArtifact:
    """The Prefect progress artifact, pushed from a thread through one client kept for the whole run: the event
    loop never waits on the Prefect API, and no update builds a client of its own."""

    def __init__(self, description: str) -> None:
        self._id = create_progress_artifact(0.0, key="generation-progress", description=description)
        self._percent = self._shown = 0.0
        self._stop = threading.Event()
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=lambda: context.run(self._push), daemon=True)

    def set(self, percent: float) -> None:
        self._percent = percent

    def _push(self) -> None:
        with get_client(sync_client=True) as client:
            while not self._stop.wait(PROGRESS_PUSH_EVERY_S):
                self._flush(client)
            self._flush(client)

    def _flush(self, client: SyncPrefectClient) -> None:
        if self._percent != self._shown:
            self._shown = self._percent
            client.update_artifact(artifact_id=self._id, artifact=ArtifactUpdate(data=self._shown))

    def __enter__(self) -> _ProgressArtifact:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self._percent = 100.0
        self._stop.set()
        self._thread.join(timeout=PROGRESS_PUSH_EVERY_S * 2)


@task(name="generate", retries=1, retry_condition_fn=retry_unless_user_error, persist_result=True,
      cache_policy=STAGE_CACHE - "server")
def generate(
    prompt_shards: list[ShardRef],
    settings: GenerationSettings,
    server: ServerConfig,
    validation: ValidationConfig,
    output_uri: str,
    run_name: str,
) -> list[ShardRef]:
    """Generate all shards with one shared in-flight budget; resumes from partial logs."""
    store = RunStore(output_uri, run_name)
    with _ProgressArtifact(f"generation of {run_name}") as progress:
        return asyncio.run(generate_async(store, prompt_shards, settings, server, validation, get_run_logger(),
                                          on_progress=progress.set))
