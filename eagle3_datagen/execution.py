"""Where a run's shard tasks execute: threads of this process, or a Ray cluster through prefect-ray.

Stages never see the difference: they read and write the run's storage, so a shard computed on any node is the
same bytes. What the cluster must provide (the address, GPUs, the same Ray version) is checked when the run
starts and refused in one line naming the fix, before any work.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect.context import FlowRunContext
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from eagle3_datagen.config import ExecutionConfig
from eagle3_datagen.errors import ConfigurationError

RAY_PORT = 6379
CONNECT_TIMEOUT_S = 5.0


class ClusterUnusable(ConfigurationError):
    """The Ray cluster cannot run this run: nothing answers, another Ray version, or too few GPUs."""


def task_runner_for(execution: ExecutionConfig) -> TaskRunner[Any]:
    """The Prefect task runner the config asks for.

    Local threads are capped at the cores: every shard at once would hold every shard's records in memory.
    """
    if execution.task_runner == "ray":
        return ClusterTaskRunner(execution.ray_address or os.environ.get("RAY_ADDRESS"))
    return ThreadPoolTaskRunner(max_workers=execution.workers or os.cpu_count() or 1)


class ClusterTaskRunner(RayTaskRunner):
    """prefect-ray's runner, its cluster checked first: a wrong address or a Ray version mismatch would otherwise
    hang or fail deep in a task."""

    def __init__(self, address: str | None = None, init_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(address=address, init_kwargs={"logging_level": "WARNING", **(init_kwargs or {})})

    def __enter__(self) -> ClusterTaskRunner:
        if self.address and self.address != "auto" and not self.address.startswith("ray://"):
            _check_reachable(self.address)
        try:
            super().__enter__()
        except (ConnectionError, RuntimeError) as error:
            raise ClusterUnusable(_cluster_fix(self.address, error)) from None
        return self


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
