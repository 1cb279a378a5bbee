"""What the Prefect UI shows while generation runs: overall progress and one table row per shard, kept live.

Generation is one task (one in-flight budget serves every shard), so its shards are shown as rows of a table
artifact rather than as task runs. The same thread samples the run's timeline (prompts finished, requests in
flight), which the report turns into request latency over time.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect.artifacts import create_progress_artifact, create_table_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import ArtifactUpdate

from eagle3_datagen.artifacts import TIMELINE, ShardRef, shard_name, ui_key
from eagle3_datagen.storage import RunStore

PUSH_EVERY_S = 5.0
TIMELINE_STEP_S = 1.0  # the thread wakes once per step, and each wake-up costs CPU

ShardCounts = dict[int, dict[str, int]]


def shard_rows(prompt_shards: list[ShardRef], counts: ShardCounts, samples_per_prompt: int,
               ended: bool) -> list[dict[str, Any]]:
    """One row per shard: prompts, answered, refused, remaining and where it stands.

    `counts` holds `answered`/`refused` prompts for an open shard and `records` for a written one (then every
    prompt is answered or refused). A shard still open when generation `ended` did not finish.
    """
    rows = []
    for ref in prompt_shards:
        seen = counts.get(ref.index, {})
        if "records" in seen:
            answered = seen["records"] // samples_per_prompt
            refused, status = ref.num_records - answered, "written"
        else:
            answered, refused = seen.get("answered", 0), seen.get("refused", 0)
            status = "unfinished" if ended else ("generating" if answered or refused else "waiting")
        rows.append({"shard": shard_name(ref.index), "status": status, "prompts": ref.num_records,
                     "answered": answered, "refused": refused,
                     "remaining": ref.num_records - answered - refused})
    return rows


class Timeline:
    """Generation over time, one row per step: prompts finished by then, mean requests in flight during it (exact:
    from the pool's integral of requests in flight and the time it is counted to, nothing sampled in between)."""

    def __init__(self, finished: int, integral: tuple[float, float]) -> None:
        self.started = time.time()
        self.rows: list[dict[str, float]] = [{"t": 0.0, "done": finished, "in_flight": 0.0}]
        self._began = self._last = integral[1]
        self._area = integral[0]

    def close_step(self, finished: int, integral: tuple[float, float]) -> None:
        area, at = integral
        if at > self._last:
            self.rows.append({"t": round(at - self._began, 3), "done": finished,
                              "in_flight": (area - self._area) / (at - self._last)})
            self._area, self._last = area, at


class LiveProgress:
    """The progress and per-shard artifacts, pushed from a thread through one client kept for the whole run: the
    event loop never waits on the Prefect API. Between pushes it adds a step to the timeline each second
    (`finished` prompts and the pool's `in_flight_integral`, both cheap to read), written to the run's storage at the
    end, appended: each attempt of a resumed run adds its own."""

    def __init__(self, store: RunStore, run_name: str, prompt_shards: list[ShardRef], samples_per_prompt: int,
                 shard_counts: Callable[[], ShardCounts], finished: Callable[[], int],
                 in_flight_integral: Callable[[], tuple[float, float]]) -> None:
        self._store = store
        self._shards = prompt_shards
        self._samples_per_prompt = samples_per_prompt
        self._shard_counts = shard_counts
        self._finished = finished
        self._in_flight_integral = in_flight_integral
        self._percent = self._shown = 0.0
        self._rows_shown = ""
        self._timeline = Timeline(finished(), in_flight_integral())
        self._ended = False
        self._progress_id = create_progress_artifact(
            0.0, key=ui_key(run_name, "generation-progress"), description=f"generation of {run_name}")
        self._table_id = create_table_artifact(
            self._rows(), key=ui_key(run_name, "shards"),
            description=f"{run_name}: generation per shard (prompts answered, refused, remaining), updated live")
        self._stop = threading.Event()
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=lambda: context.run(self._push), daemon=True)

    def set(self, percent: float) -> None:
        self._percent = percent

    def _rows(self) -> list[dict[str, Any]]:
        return shard_rows(self._shards, self._shard_counts(), self._samples_per_prompt, self._ended)

    def _push(self) -> None:
        with get_client(sync_client=True) as client:
            pushed = time.monotonic()
            while not self._stop.wait(TIMELINE_STEP_S):
                self._timeline.close_step(self._finished(), self._in_flight_integral())
                if time.monotonic() - pushed >= PUSH_EVERY_S:
                    self._flush(client)
                    pushed = time.monotonic()
            self._flush(client)

    def _flush(self, client: SyncPrefectClient) -> None:
        if self._percent != self._shown:
            self._shown = self._percent
            client.update_artifact(artifact_id=self._progress_id, artifact=ArtifactUpdate(data=self._shown))
        rows = json.dumps(self._rows())
        if rows != self._rows_shown:
            self._rows_shown = rows
            client.update_artifact(artifact_id=self._table_id, artifact=ArtifactUpdate(data=rows))

    def __enter__(self) -> LiveProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self._percent = 100.0
        self._ended = True
        self._stop.set()
        self._thread.join(timeout=PUSH_EVERY_S * 2)
        timeline = self._timeline
        timeline.close_step(self._finished(), self._in_flight_integral())
        if timeline.rows[-1]["done"] > timeline.rows[0]["done"]:
            previous = self._store.read_jsonl(TIMELINE) if self._store.exists(TIMELINE) else []
            self._store.write_jsonl(TIMELINE, [*previous, *({"started_at": timeline.started, **row}
                                                            for row in timeline.rows)])
