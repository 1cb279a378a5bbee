"""Runs the pipeline flow in-process (Prefect's local mode, or the API named by PREFECT_API_URL)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

from eagle3_datagen.config import PipelineConfig
from eagle3_datagen.errors import ConfigurationError, UserError
from eagle3_datagen.run_log import RunLog
from eagle3_datagen.storage import RunStore


def result_storage_for(config: PipelineConfig) -> Any:
    """Prefect task results (the cache) live beside the run's artifacts, on local disk or in object storage.

    Deleting a run folder then deletes its cache too, so a cache hit never points at missing artifacts. For
    object storage the block is saved with no credentials in its settings: s3fs reads them from the
    environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL_S3).
    """
    store = RunStore(config.output_uri, config.run_name)
    local = store.local_path(".prefect-results")
    if local:
        return Path(local)
    from prefect.filesystems import RemoteFileSystem

    block = RemoteFileSystem(basepath=f"{store.uri}/.prefect-results")
    name = "eagle3-results-" + hashlib.sha256(store.uri.encode()).hexdigest()[:16]
    block.save(name, overwrite=True)
    return RemoteFileSystem.load(name)


BOOKKEEPING_TASKS = ("start-run", "finish-run", "generated-shards")
PAGE = 200  # task runs per request: the Prefect server answers at most its PREFECT_API_DEFAULT_LIMIT (200)
SETTLE_S = 10.0  # how long the stage lines wait for the server to record the run's last task runs


def stage_of(task_run_name: str) -> str:
    """`my-run/validate-00003` → `validate`; a task run never started keeps Prefect's name (`validate-4f2`)."""
    _, renamed, name = task_run_name.rpartition("/")
    return re.sub(r"-\d{5}$", "", name) if renamed else name.rsplit("-", 1)[0]


async def _stage_lines(flow_run_id: UUID) -> list[str]:
    """One line per stage: how many task runs ended in which state, and their summed run time."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    async def task_runs() -> list[Any]:  # in pages: the server answers at most PAGE runs at a time
        runs: list[Any] = []
        while page := await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), offset=len(runs), limit=PAGE,
                sort=TaskRunSort.ID_DESC):
            runs += page
            if len(page) < PAGE:
                break
        return runs

    # The server records task runs from the events the tasks sent, a moment after they ended: read until two reads
    # agree and every run has ended (a cached re-run of 200 shards was read as 56 of them, one still running)
    async with get_client() as client:
        runs, deadline = await task_runs(), time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            again = await task_runs()
            settled = len(again) == len(runs) and all(run.state is not None and run.state.is_final() for run in again)
            runs = again
            if settled:
                break
    by_stage: dict[str, list[Any]] = defaultdict(list)
    for run in sorted(runs, key=lambda r: r.start_time or r.expected_start_time):
        by_stage[stage_of(run.name)].append(run)
    lines = []
    for stage, stage_runs in by_stage.items():
        states: dict[str, int] = defaultdict(int)
        for run in stage_runs:
            states[run.state_name or "?"] += 1
        seconds = sum(run.total_run_time.total_seconds() for run in stage_runs)
        summary = ", ".join(f"{n} {name}" for name, n in sorted(states.items()))
        lines.append(f"stage {stage:<22} {summary:<26} {seconds:8.1f}s")
    work = [r for r in runs if stage_of(r.name) not in BOOKKEEPING_TASKS]
    if work and all(r.state_name == "Cached" for r in work):
        lines.append(_all_cached(len(work)))
    return lines


def cached_stage_lines(work_states: dict[str, dict[str, int]]) -> list[str]:
    """The stage lines of a run whose every work task was cached, from the states the flow saw; none otherwise
    (the server's record, with run times, is read then)."""
    if not work_states or any(set(states) - {"Cached"} for states in work_states.values()):
        return []
    lines = [f"stage {stage:<22} {states['Cached']} Cached" for stage, states in work_states.items() if states]
    return [*lines, _all_cached(sum(states["Cached"] for states in work_states.values() if states))]


def _all_cached(tasks: int) -> str:
    return f"all {tasks} work tasks cached: nothing recomputed, no request sent to any server"


@contextmanager
def _terminating() -> Iterator[None]:
    """SIGTERM stops the command as Ctrl-C does: while the flow runs, Prefect's own handler raises `TerminationSignal`
    in it (every task is stopped, generation included, and the manifest ends cancelled), then hands the signal on to
    the handler it found, this one, which raises it again here; outside the flow, this one raises it at once."""
    from prefect.exceptions import TerminationSignal

    def terminated(signum: int, frame: Any) -> None:
        raise TerminationSignal(signal=signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _cancelled(signum: int) -> SystemExit:
    """The command's last line and exit status (128 + the signal's number, as a shell reports it) for a run stopped
    by a signal."""
    from eagle3_datagen.run_log import silence_prefect_console

    silence_prefect_console()
    print(f"cancelled: stopped by {signal.Signals(signum).name}; run again to resume (finished work is kept)",
          file=sys.stderr, flush=True)
    return SystemExit(128 + signum)


def run_pipeline(config: PipelineConfig) -> dict[str, Any]:
    """Run the flow; returns the run summary plus one line per stage (task states and time)."""
    from cli.local_api import wait_for_local_api
    from flows.pipeline import pipeline_for

    if not config.run_name:
        raise ConfigurationError("config key run_name: name the run (its folder under output_uri; the same name "
                                 "resumes it), e.g. run_name: first-pass")
    store = RunStore(config.output_uri, config.run_name)
    store.check_writable()
    wait_for_local_api()
    from prefect.exceptions import TerminationSignal

    try:
        with RunLog(store) as log, _terminating():
            flow = pipeline_for(config).with_options(result_storage=result_storage_for(config))
            state = flow(config, return_state=True)
            try:
                summary = state.result()
            except UserError as error:
                error.details = log.where
                raise
            flow_run_id = state.state_details.flow_run_id
            stages = cached_stage_lines(summary.pop("work_states", {}))
            if not stages and flow_run_id:
                stages = asyncio.run(_stage_lines(flow_run_id))
    except TerminationSignal as stop:
        raise _cancelled(stop.signal) from None
    if config.hidden_states.backend != "none":
        stages.append(f"trainer files: eagle3-datagen export {summary['run_uri']} --format specforge (or speculators)")
    return {**summary, "stages": stages}
