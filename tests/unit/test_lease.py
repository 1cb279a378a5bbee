"""One writer per run: a second start is refused, a dead or silent holder is taken over, and an orphan is fenced."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_datagen import lease as leases
from eagle3_datagen.artifacts import lease_file
from eagle3_datagen.lease import LEASE_TTL_S, Lease, RunBusy, current_holder, left_by, refuse_while_written, release
from eagle3_datagen.storage import RunStore, WriterFenced


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    return int(ended.stdout)


def _rewrite(store: RunStore, **changes: object) -> None:
    """The newest lease as another holder would have left it."""
    holder = dataclasses.replace(current_holder(store), **changes)  # type: ignore[type-var]
    store.write_text(lease_file(holder.epoch), json.dumps(dataclasses.asdict(holder)))


def test_a_second_start_is_refused_in_one_line_naming_the_holder(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    lease = Lease.take(store)
    try:
        with pytest.raises(RunBusy) as refused:
            Lease.take(store)
        message = str(refused.value)
        assert "\n" not in message and f"pid {lease.holder.pid}" in message and lease.holder.host in message
        assert "wait for that run to end or stop it" in message
        with pytest.raises(RunBusy):
            refuse_while_written(store, "export it once it ends")
    finally:
        lease.release()
    refuse_while_written(store, "export it once it ends")  # released: readers may read
    assert Lease.take(store).holder.epoch == 2, "a released lease is taken at once"


@pytest.mark.parametrize("gone", ["its process ended", "its lease expired"])
def test_a_holder_that_is_gone_is_taken_over_and_fenced(tmp_path: Path, gone: str) -> None:
    store = RunStore(str(tmp_path), "run")
    first = Lease.take(store)
    first.release()
    orphan = Lease.take(store)
    orphan._stop.set()  # the orphan's process is frozen: no renewal any more
    orphan_store = orphan.run.store()
    orphan_store.write_text("generations/a.txt", "written while it held the run")
    if gone == "its process ended":
        _rewrite(store, pid=_dead_pid())
    else:
        _rewrite(store, renewed_at=time.time() - LEASE_TTL_S - 1)
    successor = Lease.take(store)
    try:
        assert successor.holder.epoch == orphan.holder.epoch + 1
        with pytest.raises(WriterFenced):
            orphan_store.write_text("generations/a.txt", "an orphan's late write")
        with pytest.raises(WriterFenced):
            orphan_store.remove("generations/a.txt")
        assert store.read_text("generations/a.txt") == "written while it held the run"
        successor.run.store().write_text("generations/a.txt", "the new holder writes")
    finally:
        successor.release()


def test_two_starts_at_once_leave_one_holder(tmp_path: Path) -> None:
    """The epoch's file is created exclusively: of two starts that both found the run free, one is refused."""
    store = RunStore(str(tmp_path), "run")
    assert store.create_exclusive(lease_file(1), b"{}")
    assert not store.create_exclusive(lease_file(1), b"{}")
    assert not list(Path(store.root, "lease").glob("*.tmp-*")), "no temporary file is left beside it"


def test_a_flow_run_stopped_elsewhere_is_ended_by_its_hooks_and_nobody_elses(tmp_path: Path) -> None:
    """A cancel from the UI: the worker runs the flow run's hooks after the runner stopped its process. They may end
    the run under the lease that flow run left, fenced by its epoch; a refused flow run's hooks may not."""
    store = RunStore(str(tmp_path), "run")
    lease = Lease.take(store, flow_run="flow-run-1")
    lease._stop.set()
    leases._HELD.clear()  # as in the worker's process, which never held it
    assert left_by(store, "flow-run-2") is None, "another flow run's hooks write nothing"
    run = left_by(store, "flow-run-1")
    assert run is not None and run.epoch == lease.holder.epoch
    run.store().write_text("manifest.json", '{"status": "cancelled"}')
    release(store, "flow-run-1")
    assert current_holder(store).released  # type: ignore[union-attr]
    assert left_by(store, "flow-run-1") is None, "released: nothing more is written for it"
