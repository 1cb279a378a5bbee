"""Where a run's words go: one line per message on the console, everything (tracebacks too) in the run's log file.

A user error then ends the output with one line naming the fix and the log file, not with a traceback; bugs
keep their tracebacks in the file and in the Prefect logs.
"""

from __future__ import annotations

import logging
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from eagle3_datagen.errors import OneLineFormatter
from eagle3_datagen.execution import TASK_LINES
from eagle3_datagen.storage import RunStore

FILE_FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"


class RunLog:
    """For the length of a run: Prefect's console handlers lose tracebacks, a file gets every record.

    The file lives in the run folder when it is on local disk, else in a temporary folder and is copied into
    the run's storage (`logs/`) at the end.
    """

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
