"""Start a real vLLM CPU server as a subprocess, for the demo and the tests.

vLLM lives in its own virtualenv (its pins clash with Prefect's), so this module only starts that
environment's python on `infra/vllm_cpu/launch.py` and talks to the server over HTTP.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_CPU_DIR = REPO_ROOT / "infra" / "vllm_cpu"  # runs in vLLM's environment: the launcher, the CPU connector
LAUNCHER = VLLM_CPU_DIR / "launch.py"
INDUCTOR_CACHE = REPO_ROOT / "build" / "torchinductor"


def vllm_python() -> Path:
    """The vLLM environment's python: $EAGLE3_VLLM_PYTHON, else the repo's .venv-vllm."""
    python = Path(os.environ.get("EAGLE3_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not python.is_file():
        raise FileNotFoundError(f"no vLLM python at {python}: run `make setup` (or set EAGLE3_VLLM_PYTHON)")
    return python


def free_port() -> int:
    """A port the OS just reported free on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalVLLMServer:
    """`vllm serve` on this machine's CPU, in its own process group so that stop() leaves nothing behind."""

    def __init__(
        self,
        model: str | Path,
        served_name: str,
        reasoning_parser: str | None = "qwen3",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        startup_timeout_s: float = 300,
    ) -> None:
        self.model = str(model)
        self.served_name = served_name
        self.reasoning_parser = reasoning_parser
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        # vLLM's temporary files (IPC sockets, a rendezvous file), which it leaves behind: stop() removes them,
        # and the log with them unless it was given a place of its own.
        self._scratch = tempfile.mkdtemp(prefix="eagle3-vllm-")
        self.log_path = log_path or Path(self._scratch) / "server.log"
        self.startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's argv: eager (no compile at start-up), float32 as the tiny model is saved.

        `extra_args` come last, so they also override these (vLLM's parser keeps an option's last value).
        """
        argv = [str(vllm_python()), str(LAUNCHER), "serve", self.model, "--served-model-name", self.served_name]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager"]
        argv += ["--max-model-len", "2048", "--dtype", "float32"]
        if self.reasoning_parser is not None:
            argv += ["--reasoning-parser", self.reasoning_parser]
        return argv + self.extra_args

    def start(self) -> LocalVLLMServer:
        """Start the server and wait for /health; raise with the log's tail if it dies or never answers."""
        # CPU platform without relying on version strings; 1 GiB of KV cache is plenty for a tiny model.
        # Compiled CPU kernels are a cache worth keeping between servers: in the repo's build/, not in /tmp.
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": self._scratch,
               "VLLM_RPC_BASE_PATH": self._scratch, "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE)}
        os.makedirs(self._scratch, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A process group of its own, for stop() to signal, but in the caller's session: under the kernel's
        # autogroup scheduling a client outside the busy-polling engine's group can wait seconds to run
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=env, process_group=0)
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                returncode = self._process.poll()
                if returncode is not None:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"vLLM exited with code {returncode}:\n{tail}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"vLLM not healthy after {self.startup_timeout_s:.0f} s:\n{tail}")

    def stop(self, grace_s: float = 10) -> None:
        """SIGTERM the whole process group (vLLM forks an engine core), SIGKILL whatever outlives the grace."""
        if self._process is not None:
            pgid = self._process.pid
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self._process.poll() is None or _signal_group(pgid, 0):
                if time.monotonic() > deadline:
                    _signal_group(pgid, signal.SIGKILL)
                    break
                time.sleep(0.2)
            self._process.wait()
            self._process = None
        shutil.rmtree(self._scratch, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log, to say why it failed."""
        if not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> LocalVLLMServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False once no process of it is left (signal 0 only asks)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
