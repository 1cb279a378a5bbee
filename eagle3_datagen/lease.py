"""One writer per run: a lease in the run folder, taken before the first write and renewed while the run lives.

The `epoch`-th writer creates `lease/epoch-NNNNNNNN.json` exclusively (a hard link locally, a conditional PUT on
S3), naming itself, and renews it every RENEW_EVERY_S. A second start is refused while the newest lease is live; one
not renewed for LEASE_TTL_S, released, or held by a process that no longer exists on this host is taken over by
creating the next epoch's file, which also fences the old holder: its stores check for that file before every
write (`RunStore.check_fence`), so an orphan, a cancelled thread or a lost head's Ray task can never write again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime

from eagle3_datagen.artifacts import LEASE_FOLDER, lease_file
from eagle3_datagen.errors import Log, UserError
from eagle3_datagen.storage import RunLocation, RunStore, WriterFenced

LEASE_TTL_S = 60.0
RENEW_EVERY_S = 15.0
logger = logging.getLogger(__name__)


class RunBusy(UserError):
    """Another process is writing the run."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run's lease, and until when it counts as alive."""

    epoch: int
    holder: str  # this attempt's id
    host: str
    pid: int
    since: float
    renewed_at: float
    released: bool = False
    flow_run: str = ""  # the Prefect flow run that holds it: its hooks may end the run from another process

    def live(self, now: float) -> bool:
        """Still writing: renewed within LEASE_TTL_S, not released, and not a process this host knows is gone."""
        if self.released or now - self.renewed_at > LEASE_TTL_S:
            return False
        return self.host != socket.gethostname() or _process_exists(self.pid)

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds")
        return f"{self.host} pid {self.pid} (since {since}, lease epoch {self.epoch})"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def current_holder(store: RunStore) -> Holder | None:
    """The newest lease of the run (None: never held)."""
    files = store.list(LEASE_FOLDER, ".json")
    return Holder(**store.read_json(files[-1])) if files else None


def refuse_while_written(store: RunStore, what: str) -> None:
    """One line refusing to read a run another process is writing: `what` names the reader and how to proceed."""
    holder = current_holder(store)
    if holder is not None and holder.live(time.time()):
        raise RunBusy(f"run {store.uri} is being written by {holder.describe()}: {what}")


class Lease:
    """A held lease: its location (with the epoch every write is fenced by) and the thread that renews it."""

    def __init__(self, store: RunStore, holder: Holder) -> None:
        self.holder = holder
        self.run = RunLocation(*store.uri.rstrip("/").rsplit("/", 1), epoch=holder.epoch)
        self._store = self.run.store()
        self._stop = threading.Event()
        self._renewing = threading.Thread(target=self._renew_until_stopped, name=f"lease-{holder.epoch}",
                                          daemon=True)
        self._renewing.start()

    @classmethod
    def take(cls, store: RunStore, log: Log = logger, flow_run: str = "") -> Lease:
        """Hold the run, or refuse in one line naming who holds it and how to take over."""
        now = time.time()
        current = current_holder(store)
        if current is not None and current.live(now):
            raise _busy(store, current)
        epoch = (current.epoch if current else 0) + 1
        holder = Holder(epoch, uuid.uuid4().hex, socket.gethostname(), os.getpid(), now, now, flow_run=flow_run)
        if not store.create_exclusive(lease_file(epoch), _encoded(holder)):
            raced = current_holder(store)
            raise _busy(store, raced or holder)
        if current is not None and not current.released:
            log.warning("took over run %s from %s: its lease was last renewed %.0f s ago, or its process is gone",
                        store.uri, current.describe(), now - current.renewed_at)
        _HELD[store.uri] = lease = cls(store, holder)
        for older in store.list(LEASE_FOLDER, ".json")[:-2]:  # the previous holder's stays, for the record
            store.remove(older)
        return lease

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(RENEW_EVERY_S):
            try:
                self._write(replace(self.holder, renewed_at=time.time()))
            except WriterFenced as error:
                logger.error("%s", error)
                return
            except OSError as error:  # the store hiccups: the next renewal tries again, well within the TTL
                logger.warning("could not renew the lease of %s: %s", self._store.uri, error)

    def _write(self, holder: Holder) -> None:
        self._store.write_bytes(lease_file(holder.epoch), _encoded(holder))
        self.holder = holder

    def release(self) -> None:
        """The run ends: stop renewing, and mark the lease released so the next start need not wait."""
        self._stop.set()
        self._renewing.join()
        _HELD.pop(self._store.uri, None)
        with contextlib.suppress(WriterFenced):  # taken over already: nothing of this process may be written
            self._write(replace(self.holder, released=True, renewed_at=time.time()))


_HELD: dict[str, Lease] = {}  # run folder -> the lease this process holds on it


def held_lease(store: RunStore) -> Lease | None:
    """The lease this process holds on the run (None: it is not the run's writer)."""
    return _HELD.get(store.uri)


def left_by(store: RunStore, flow_run: str) -> RunLocation | None:
    """Where the hooks of `flow_run` may write the run's end: under this process's lease, or, from the process
    that runs them after the flow run's own was stopped (a worker, after a cancel from the UI), under the lease the
    flow run left, fenced by its epoch. None where the flow run never held the run (it was refused)."""
    if (lease := held_lease(store)) is not None:
        return lease.run
    holder = current_holder(store)
    if holder is None or holder.released or not flow_run or holder.flow_run != flow_run:
        return None
    return RunLocation(*store.uri.rstrip("/").rsplit("/", 1), epoch=holder.epoch)


def release(store: RunStore, flow_run: str) -> None:
    """The run's lease released by the flow run that held it, from its own process or the one running its hooks."""
    if (lease := held_lease(store)) is not None:
        lease.release()
    elif (run := left_by(store, flow_run)) is not None:
        holder = replace(current_holder(store), released=True, renewed_at=time.time())  # type: ignore[type-var]
        with contextlib.suppress(WriterFenced):
            run.store().write_bytes(lease_file(holder.epoch), _encoded(holder))


def _busy(store: RunStore, holder: Holder) -> RunBusy:
    return RunBusy(f"run {store.uri} is being written by {holder.describe()}: wait for that run to end or stop it; "
                   f"a lease not renewed for {LEASE_TTL_S:.0f} s (a machine lost) is taken over by the next start")


def _encoded(holder: Holder) -> bytes:
    return json.dumps(asdict(holder), indent=2).encode()
