"""Where a run's words go: one line per message on the console, everything (tracebacks too) in the run's log file.

A user error then ends the output with one line naming the fix and the log file, not with a traceback; bugs
keep their tracebacks in the file and in the Prefect logs. The command opens the log around its run; a run a
Prefect worker starts opens it in the flow (`open_run_log`) and closes it in the flow's end hooks.
"""

from __future__ import annotations

import logging
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from eagle3_datagen.errors import OneLineFormatter
from eagle3_datagen.execution import TASK_LINES
from eagle3_datagen.storage import RunStore

FILE_FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"


class RunLog:
    """For the length of a run: Prefect's console handlers lose tracebacks, a file gets every record.

    The file lives in the run folder when it is on local disk, else in a temporary folder and is copied into
    the run's storage (`logs/`) at the end.
    """

    open_for: ClassVar[set[str]] = set()  # the runs whose log is open in this process

    def __init__(self, store: RunStore) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        self._store = store
        self._rel = f"logs/run-{stamp}.log"
        local = store.local_path(self._rel)
        self._copy = local is None
        self.path = Path(local) if local else Path(tempfile.mkdtemp(prefix="eagle3-log-")) / Path(self._rel).name
        self.where = local or f"{store.uri}/{self._rel}"
        self._file: logging.FileHandler | None = None
        self._console: list[tuple[logging.Handler, logging.Formatter | None]] = []

    def __enter__(self) -> RunLog:
        RunLog.open_for.add(self._store.uri)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = logging.FileHandler(self.path, encoding="utf-8")
        self._file.setFormatter(logging.Formatter(FILE_FORMAT))
        for logger in (logging.getLogger(), TASK_LINES):
            logger.addHandler(self._file)
        for handler in _prefect_console_handlers():
            self._console.append((handler, handler.formatter))
            handler.setFormatter(OneLineFormatter(handler.formatter))
        return self

    def __exit__(self, *exc: object) -> None:
        RunLog.open_for.discard(self._store.uri)
        for handler, formatter in self._console:
            handler.setFormatter(formatter)  # type: ignore[arg-type]
        if self._file is not None:
            for logger in (logging.getLogger(), TASK_LINES):
                logger.removeHandler(self._file)
            self._file.close()
        if self._copy:
            self._store.write_bytes(self._rel, self.path.read_bytes())
            self.path.unlink()
            self.path.parent.rmdir()


_OPENED_BY_FLOW_RUN: dict[str, RunLog] = {}


def open_run_log(store: RunStore) -> None:
    """The run's log file for a flow run nothing opened it for (one a worker started): closed by `close_run_log`."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None and store.uri not in RunLog.open_for:
        _OPENED_BY_FLOW_RUN[str(context.flow_run.id)] = RunLog(store).__enter__()


def close_run_log(flow: Any, flow_run: Any, state: Any) -> None:
    """A flow hook, after the others (the run's end and its error are in the file): the log `open_run_log` opened."""
    log = _OPENED_BY_FLOW_RUN.pop(str(flow_run.id), None)
    if log is not None:
        log.__exit__(None, None, None)


def _prefect_console_handlers() -> list[logging.Handler]:
    """The console handlers Prefect's logging config attached (importing prefect applies that config)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = (logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("fastapi"))
    return [handler for logger in loggers for handler in logger.handlers if isinstance(handler, PrefectConsoleHandler)]


def silence_prefect_console() -> None:
    """Nothing more from Prefect on the console for the rest of the process (its temporary API shuts down at
    exit), so the line the command prints last stays last; the run's log file still gets everything."""
    for handler in _prefect_console_handlers():
        handler.setLevel(logging.CRITICAL + 1)
