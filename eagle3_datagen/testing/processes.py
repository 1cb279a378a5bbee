"""Child processes the tests start behave as they do when a user starts them from a terminal."""

from __future__ import annotations

import signal


def as_from_a_terminal() -> None:
    """`preexec_fn` for test children: Ctrl-C (SIGINT) back to its default.

    A shell starts background jobs (`make test &`, a CI step run in the background) with SIGINT ignored, and
    children inherit that: a CLI would never see Ctrl-C, and a Prefect worker, which turns SIGTERM into SIGINT to
    shut down, would never stop.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
