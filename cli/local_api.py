"""Prefect's local mode, started first: the command's temporary Prefect API boots while the command imports.

Without `PREFECT_API_URL`, Prefect starts a temporary API the first time a flow needs it, after every import, and
waits for it, so the first request waits for the API's whole start. This starts the same server (Prefect's own app,
the way Prefect runs it) as the command's first act, in its own process, so it boots on the other core while this
process imports the pipeline; the flow then finds it ready. Like Prefect's own, it is stopped at interpreter exit,
after Prefect has flushed its logs and events to it (stopped any earlier, the flush waits on a server that is
gone), and it dies with the command if that is killed.

Both processes import with the garbage collector paused (`import_uncollected`).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eagle3_datagen.errors import UserError

READY_TIMEOUT_S = 120.0
_started: LocalPrefectAPI | None = None


def import_uncollected(*modules: str) -> None:
    """Import with the cyclic garbage collector paused, then freeze what the imports built.

    Prefect, transformers and torch build millions of objects that live as long as the process; the collector
    walking them over and over during the imports is a large share of their time. Frozen, they are skipped by
    every later full collection too.
    """
    gc.disable()
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        gc.freeze()
        gc.enable()


def serve(port: int) -> None:
    """The temporary API's own process: Prefect's app under uvicorn, as `prefect server start` runs it."""
    import_uncollected("prefect.server.api.server", "uvicorn")
    import uvicorn
    from prefect.server.api.server import create_app

    uvicorn.run(create_app, factory=True, host="127.0.0.1", port=port, log_level="error", lifespan="on")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prefect_api_configured() -> bool:
    """A Prefect API to run against: PREFECT_API_URL, or (where Prefect is already imported in this process, as
    in a test harness or a notebook) Prefect's own settings."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    if "prefect.settings" in sys.modules:
        from prefect.settings import PREFECT_API_URL

        return bool(PREFECT_API_URL.value())
    return False


def start_local_api() -> None:
    """Start the temporary API unless one is configured; it stops at exit."""
    global _started
    if prefect_api_configured():
        return
    _started = LocalPrefectAPI()
    _started.start()
    atexit.register(_started.stop)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the command dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def wait_for_local_api() -> None:
    """Before the first flow run: the temporary API this command started (if any) must answer."""
    if _started is not None:
        _started.wait_ready()


class LocalPrefectAPI:
    """The temporary API of one command; `start` returns at once, `wait_ready` before the first flow run."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
        home.mkdir(parents=True, exist_ok=True)
        self.log_path = home / "temporary-api.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(  # -P: the installed packages, never a same-named folder in the cwd
                [sys.executable, "-P", "-m", "cli.local_api", str(self.port)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        os.environ["PREFECT_API_URL"] = self.url
        os.environ["PREFECT_UI_URL"] = ""  # it serves no UI: no "View at" link to a page that is not there

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            assert self._process is not None
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise UserError(
                    f"Prefect's temporary API did not start (see {self.log_path}): set PREFECT_API_URL to a "
                    "running Prefect server (`prefect server start`)"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        global _started
        _started = None
        if os.environ.get("PREFECT_API_URL") == self.url:
            del os.environ["PREFECT_API_URL"], os.environ["PREFECT_UI_URL"]
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None


if __name__ == "__main__":
    serve(int(sys.argv[1]))
