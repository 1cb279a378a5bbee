"""Where a run's shard tasks execute: threads of this process, or a Ray cluster through prefect-ray.

Stages never see the difference: they read and write the run's storage, so a shard computed on any node is the
same bytes. What the cluster must provide (the address, GPUs, the same Ray version) is checked when the run
starts and refused in one line naming the fix, before any work.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prefect.context import FlowRunContext
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options
from prefect_ray.task_runners import PrefectRayFuture

from eagle3_datagen.config import ExecutionConfig
from eagle3_datagen.errors import ConfigurationError, UserError

RAY_PORT = 6379
CONNECT_TIMEOUT_S = 5.0
HEAD_CHECK_EVERY_S = 1.0
HEAD_LOST_AFTER_S = 5.0  # Ray's own driver waits 60 s for its head, then ends the process without a word of ours
TASK_LINES = logging.getLogger("eagle3_datagen.cluster_tasks")  # what tasks print on the nodes: run log file only
TASK_LINES.propagate = False  # Ray prints them on the console itself
TASK_LINES.setLevel(logging.INFO)


class ClusterUnusable(ConfigurationError):
    """The Ray cluster cannot run this run: nothing answers, another Ray version, or too few GPUs."""


def task_runner_for(execution: ExecutionConfig) -> TaskRunner[Any]:
    """The Prefect task runner the config asks for.

    Local threads are capped at the cores: every shard at once would hold every shard's records in memory.
    """
    if execution.task_runner == "ray":
        return ClusterTaskRunner(execution.ray_address or os.environ.get("RAY_ADDRESS"))
    return ThreadPoolTaskRunner(max_workers=execution.workers or os.cpu_count() or 1)


class ClusterLost(UserError):
    """The Ray cluster's head stopped answering mid-run: the tasks on it cannot finish, what was written is kept."""


class ClusterTaskRunner(RayTaskRunner):
    """prefect-ray's runner, its cluster checked first (a wrong address or a Ray version mismatch would otherwise
    hang or fail deep in a task), its head watched while it runs, and what its tasks print kept in the run's log.

    A lost head leaves the flow waiting on futures that never end, or ends them as crashed tasks the flow would
    go on from, and a new task sent would wait for the head until Ray ends the process (60 s, without a word of
    ours). So the head is checked in the background, before each task is sent and after each wait that ends in a
    crash; once it is lost, the runner disconnects from the cluster (which ends the waits) and every wait and
    send raises `ClusterLost`: the run fails with it.
    """

    def __init__(self, address: str | None = None, init_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(address=address, init_kwargs={"logging_level": "WARNING", **(init_kwargs or {})})
        self.lost: ClusterLost | None = None
        self._head: HeadWatch | None = None
        self._losing = threading.Lock()
        self._disconnect: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Without the watch and its lock: the flow, and its runner with it, travels to the cluster's tasks."""
        return {**self.__dict__, "_head": None, "_losing": None, "_disconnect": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _losing=threading.Lock())

    def __enter__(self) -> ClusterTaskRunner:
        if self.address and self.address != "auto" and not self.address.startswith("ray://"):
            _check_reachable(self.address)
        try:
            super().__enter__()
        except (ConnectionError, RuntimeError) as error:
            raise ClusterUnusable(_cluster_fix(self.address, error)) from None
        import ray

        self._head = HeadWatch(ray.get_runtime_context().gcs_address, on_lost=self.head_lost)
        _forward_task_lines()
        return self

    def head_lost(self) -> ClusterLost:
        """Mark the cluster lost (once) and disconnect from it, which ends the flow's waits on its futures."""
        import ray

        with self._losing:
            if self.lost is None:
                assert self._head is not None
                self.lost = ClusterLost(
                    f"execution.ray_address: the Ray cluster's head at {self._head.address} stopped answering "
                    "mid-run: restart the cluster and run again; finished shards are kept and only the missing "
                    "ones run"
                )
                # Disconnecting takes seconds with the head gone: the run fails meanwhile, and __exit__ waits.
                self._disconnect = threading.Thread(target=ray.shutdown, name="ray-disconnect", daemon=True)
                self._disconnect.start()
        return self.lost

    def check_head(self) -> None:
        """Raise `ClusterLost` if the head is lost, or stays unreachable now (blocks while it is unsure)."""
        if self.lost is None and self._head is not None and self._head.unreachable():
            self.head_lost()
        if self.lost is not None:
            raise self.lost

    def submit(self, *args: Any, **kwargs: Any) -> PrefectRayFuture[Any]:
        self.check_head()
        future = super().submit(*args, **kwargs)
        return WatchedRayFuture(self, future.task_run_id, future.wrapped_future)

    def __exit__(self, *exc_info: Any) -> None:
        if self._head is not None:
            self._head.stop()
            _stop_forwarding_task_lines()
        if self._disconnect is not None:
            self._disconnect.join()  # before the process ends or joins another cluster
            TaskRunner.__exit__(self, *exc_info)  # disconnected: nothing of Ray's is left to shut down
            return
        super().__exit__(*exc_info)


class WatchedRayFuture(PrefectRayFuture[Any]):
    """A Ray future whose waits end in `ClusterLost` once its runner lost the cluster's head."""

    def __init__(self, runner: ClusterTaskRunner, task_run_id: Any, wrapped_future: Any) -> None:
        super().__init__(task_run_id=task_run_id, wrapped_future=wrapped_future)
        self._runner = runner

    def wait(self, timeout: float | None = None) -> None:
        self._unless_lost(super().wait, timeout)

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        return self._unless_lost(super().result, timeout, raise_on_failure)

    def _unless_lost(self, call: Callable[..., Any], *args: Any) -> Any:
        self._runner.check_head()
        try:
            outcome = call(*args)
        except BaseException:
            self._runner.check_head()
            raise
        if self._final_state is not None and self._final_state.is_crashed():
            self._runner.check_head()
        return outcome


class HeadWatch:
    """Calls `on_lost` once when the cluster's head (its GCS port) has refused connections for HEAD_LOST_AFTER_S:
    a head that misses one connection is not lost."""

    def __init__(self, gcs_address: str, on_lost: Callable[[], Any]) -> None:
        self.address = gcs_address
        host, _, port = gcs_address.rpartition(":")
        self._where = (host, int(port))
        self._on_lost = on_lost
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ray-head-watch", daemon=True)
        self._thread.start()

    def answers(self) -> bool:
        try:
            socket.create_connection(self._where, timeout=CONNECT_TIMEOUT_S).close()
            return True
        except OSError:
            return False

    def unreachable(self) -> bool:
        """Whether the head refuses every connection for HEAD_LOST_AFTER_S from now (False at its first answer)."""
        since = time.monotonic()
        while not self.answers():
            if time.monotonic() - since >= HEAD_LOST_AFTER_S:
                return True
            time.sleep(HEAD_CHECK_EVERY_S)
        return False

    def _watch(self) -> None:
        while not self._stopped.wait(HEAD_CHECK_EVERY_S):
            if self.unreachable():
                self._on_lost()
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _forward_task_lines() -> None:
    """What the cluster's tasks print (their log lines and tracebacks, forwarded to this driver by Ray) also goes
    to TASK_LINES, so the run's log file holds every task's lines wherever it ran."""
    from ray._private.worker import global_worker_stdstream_dispatcher

    def keep(batch: dict[str, Any]) -> None:
        where = f"{batch.get('task_name') or 'worker'} pid={batch.get('pid')} ip={batch.get('ip')}"
        for line in batch.get("lines", ()):
            TASK_LINES.info("(%s) %s", where, line)

    _stop_forwarding_task_lines()
    global_worker_stdstream_dispatcher.add_handler(TASK_LINES.name, keep)


def _stop_forwarding_task_lines() -> None:
    from ray._private.worker import global_worker_stdstream_dispatcher

    global_worker_stdstream_dispatcher.remove_handler(TASK_LINES.name)


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":") if ":" in address else (address, "", str(RAY_PORT))
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError):
        raise ClusterUnusable(
            f"execution.ray_address: nothing answers at {address}: start the cluster (`ray start --head`) or set "
            "execution.ray_address (or RAY_ADDRESS) to its head's host:port"
        ) from None


def _cluster_fix(address: str | None, error: BaseException) -> str:
    message = " ".join(str(error).split())
    if "version mismatch" in message.lower():
        import ray

        return (f"execution.ray_address: the Ray cluster at {address} runs another Ray or Python version than this "
                f"process (Ray {ray.__version__}): install the cluster's versions here, or run from its head node "
                f"({message[:200]})")
    return f"execution.ray_address: cannot join the Ray cluster at {address or 'this machine'}: {message[:300]}"


def check_task_runner(execution: ExecutionConfig) -> None:
    """A run that asks for Ray runs on Ray (a deployment's flow has its task runner built in), on a cluster with
    the GPUs extraction asks for: Ray would keep such a task pending forever."""
    context = FlowRunContext.get()
    if context is None or execution.task_runner == "local":
        return
    if not isinstance(context.task_runner, RayTaskRunner):
        raise ConfigurationError(
            "config key execution.task_runner: ray, but this flow runs its tasks locally: run it with the "
            "command line, or from the `pipeline-ray` deployment (prefect.yaml)"
        )
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus < execution.extraction_gpus:
        raise ClusterUnusable(
            f"execution.extraction_gpus: each extraction task asks for {execution.extraction_gpus:g} GPU(s) but the "
            f"Ray cluster has {gpus:g}: add GPU worker nodes or lower it (0 extracts on CPU)"
        )


@contextmanager
def extraction_placement(execution: ExecutionConfig) -> Iterator[None]:
    """Ray resources of the extraction tasks, whose worker processes are kept after each task.

    Ray ends a GPU task's worker process after one task by default (`max_calls=1`): the next shard would load the
    target again. `max_calls=0` keeps the worker, and the target it loaded once, for the rest of the run.
    """
    with remote_options(num_gpus=execution.extraction_gpus, max_calls=0):
        yield
