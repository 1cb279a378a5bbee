"""The one exception root. A `UserError` is something the user can fix: its message is one line naming the fix.

Everything else is a bug and keeps its traceback. Stages derive their errors from these; nobody keeps a list.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from eagle3_datagen.redaction import redact

# Where a stage's core writes its lines: Prefect's run logger inside a run, a module's logger outside one
Log = logging.Logger | logging.LoggerAdapter[Any]


class Eagle3Error(Exception):
    """Root of the project's own exceptions."""


class UserError(Eagle3Error):
    """A problem the user fixes (config, data, servers, storage); the run's outputs so far are kept.

    `exit_status` is what the command line exits with: 2 for a bad config, 1 for a run that could not finish.
    """

    exit_status = 1
    details: str | None = None  # where the full story is (the run's log file), once a runner knows it

    def restated(self, message: str) -> UserError:
        """The same error, type and exit status kept, saying `message`: a later step adds what it has learnt."""
        restated = copy.copy(self)
        restated.args = (message,)
        return restated

    def one_line(self) -> str:
        """The message on one line, secrets redacted: what the CLI, the manifest and the Prefect UI show."""
        where = f" (details: {self.details})" if self.details else ""
        return redact(" ".join(str(self).split()) + where)


class ConfigurationError(UserError, ValueError):
    """The config (or a file it names) is wrong before anything runs: one line naming the key to fix."""

    exit_status = 2


def one_line(error: BaseException) -> str:
    """Any exception as one redacted line (`Type: message` for bugs, the message alone for user errors)."""
    if isinstance(error, UserError):
        return error.one_line()
    return redact(" ".join(f"{type(error).__name__}: {error}".split()))


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry what may pass next time (a crash, a hiccup), never a stage's own verdict.

    A stage raises a UserError when it has judged the run: retrying would repeat the work it judged hopeless.
    """
    try:
        state.result()
    except UserError:
        return False
    except Exception:
        return True
    return False


class OneLineFormatter(logging.Formatter):
    """Formats a copy of each record without its traceback (of every error, or of user errors only, whose message
    says it all); the record itself, and so the run's log file, keeps it."""

    def __init__(self, inner: logging.Formatter | None, user_errors_only: bool = False) -> None:
        super().__init__()
        self._inner = inner or logging.Formatter()
        self._user_errors_only = user_errors_only

    def format(self, record: logging.LogRecord) -> str:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or (self._user_errors_only and not isinstance(error, UserError)):
            return self._inner.format(record)
        bare = copy.copy(record)
        bare.msg, bare.args = f"{record.getMessage().splitlines()[0]} ({type(error).__name__})", None
        bare.exc_info = bare.exc_text = bare.stack_info = None
        return self._inner.format(bare)


def user_errors_one_line_in_the_ui() -> None:
    """Prefect's log stream to its API (the UI's Logs tab) gets a user error as one line, as the console does: the
    state message already says the fix, and Prefect's own frames bury it. Bugs keep their traceback."""
    from prefect.logging.handlers import APILogHandler

    for name in ("prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, APILogHandler) and not isinstance(handler.formatter, OneLineFormatter):
                handler.setFormatter(OneLineFormatter(handler.formatter, user_errors_only=True))
