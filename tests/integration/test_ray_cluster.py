"""The pipeline on a real Ray cluster (two nodes on this machine) through prefect-ray: the same bytes as the local
runner, the target loaded once per worker process, and a cluster that cannot run the job refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cli.demo import DEMO_MODEL_NAME, demo_questions
from cli.runner import run_pipeline
from eagle3_datagen.config import PipelineConfig, parse_config
from eagle3_datagen.execution import ClusterLost, ClusterUnusable
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.testing.vllm_server import free_port
from eagle3_datagen.think_tokens import load_tokenizer
from flows.pipeline import rerun_failed, verify_for
from tasks.verify import verify_run

pytestmark = pytest.mark.usefixtures("prefect_api")

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
OUTPUTS = ("generations/shard-*.jsonl", "validation/shard-*.json", "sequences/shard-*.parquet",
           "hidden_states/*/index.json", "hidden_states/*/*.safetensors", "rejected/*.jsonl")


@contextmanager
def local_cluster(head_cpus: int, workers: int) -> Iterator[Any]:
    """A head and worker nodes, one CPU each. Their files go to a short folder (Unix socket paths are limited to
    107 bytes, too few under a deep checkout) that is removed with everything in it when the cluster stops."""
    import ray
    from ray.cluster_utils import Cluster

    ray_tmp = tempfile.mkdtemp(prefix="e3ray-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", ray_tmp)
        cluster = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": head_cpus,
                                                                "include_dashboard": False})
        try:
            for _ in range(workers):
                cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    with local_cluster(head_cpus=1, workers=1) as cluster:
        yield cluster


@pytest.fixture
def server(tiny_model: Path) -> Iterator[ScriptedServer]:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as running:
        yield running


def config(tiny_model: Path, url: str, output: Path, run_name: str, **execution: Any) -> PipelineConfig:
    return parse_config({
        "run_name": run_name,
        "output_uri": str(output),
        "data": {"source": str(demo_questions()), "shard_size": 6, "limit": 24},
        "model": {"name": DEMO_MODEL_NAME, "profile": "qwen3", "tokenizer": str(tiny_model)},
        "server": {"endpoints": [url], "max_in_flight": 8, "startup_timeout_s": 10},
        "hidden_states": {"model": str(tiny_model), "dtype": "float32", "part_size_bytes": 200_000},
        "execution": execution,
    })


def started_under_way(settings: PipelineConfig, server: ScriptedServer) -> tuple[threading.Thread, list[Any]]:
    """The run in a thread, returned once generation is under way (6 requests sent); `ended` gets None or the
    error it ended with (a run may end Failed: a re-run must finish it)."""
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            run_pipeline(settings)
            ended.append(None)
        except BaseException as error:
            ended.append(error)

    runner = threading.Thread(target=run)
    runner.start()
    while len(server.log.bodies) < 6 and runner.is_alive():
        time.sleep(0.05)
    return runner, ended


def outputs(run: Path) -> dict[str, bytes]:
    return {str(path.relative_to(run)): path.read_bytes() for pattern in OUTPUTS for path in run.glob(pattern)}


def test_a_run_on_a_ray_cluster_writes_the_local_runners_bytes_and_loads_the_target_once_per_worker(
        tiny_model: Path, server: ScriptedServer, ray_cluster: Any, tmp_path: Path) -> None:
    run_pipeline(config(tiny_model, server.url, tmp_path, "local"))
    run_pipeline(config(tiny_model, server.url, tmp_path, "ray", task_runner="ray", ray_address=ray_cluster.address))
    for run in ("local", "ray"):
        assert json.loads((tmp_path / run / "manifest.json").read_text())["status"] == "completed"

    expected, got = outputs(tmp_path / "local"), outputs(tmp_path / "ray")
    assert len(expected) > 4 * 4, "every stage of every shard"
    assert sorted(got) == sorted(expected)
    assert [name for name in expected if got[name] != expected[name]] == [], "byte-identical to the local runner"
    held_out = [name for name in got if name.endswith("index.json") and b'"split": "holdout"' in got[name]]
    assert held_out, "the held-out split is among what both runners wrote alike"

    workers = [json.loads(path.read_text()) for path in sorted((tmp_path / "ray").glob("hidden_states/*/worker.json"))]
    assert len(workers) == 4
    assert {w["pid"] for w in workers}.isdisjoint({os.getpid()}), "every shard extracted on a Ray worker"
    assert all(w["target_loads_in_process"] == 1 for w in workers), f"one target load per worker process: {workers}"

    log = next((tmp_path / "ray" / "logs").glob("run-*.log")).read_text()
    for shard in range(4):  # what the tasks logged on the nodes, in the run's log file
        assert f"Task run 'ray/validate-{shard:05d}' - Finished in state Completed()" in log, log[-3000:]

    parts = sum(path.stat().st_size for path in (tmp_path / "ray").glob("hidden_states/*/part-*.safetensors"))
    deep = verify_for(str(tmp_path / "ray"))(str(tmp_path / "ray"), deep=True)  # its shards as Ray tasks
    structure = verify_run(RunStore(str(tmp_path), "ray"))
    assert deep["deep"] and deep["samples"] == structure.samples > 0 and deep["bytes_read"] > parts > 0, deep

    requests = len(server.log.bodies)
    rerun_failed(str(tmp_path / "ray"))  # a recorded Ray run is re-run on Ray, not refused
    assert json.loads((tmp_path / "ray" / "manifest.json").read_text())["status"] == "completed"
    assert len(server.log.bodies) == requests
    assert outputs(tmp_path / "ray") == got


def test_a_cluster_that_cannot_run_the_job_is_refused_in_one_line_before_any_work(
        tiny_model: Path, server: ScriptedServer, ray_cluster: Any, tmp_path: Path) -> None:
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(ClusterUnusable, match=rf"execution.ray_address: nothing answers at {nobody}: start the"):
        run_pipeline(config(tiny_model, server.url, tmp_path, "unreachable", task_runner="ray", ray_address=nobody))
    with pytest.raises(ClusterUnusable, match=r"execution.extraction_gpus: .* asks for 1 GPU\(s\) but the Ray "
                                              r"cluster has 0: add GPU worker nodes"):
        run_pipeline(config(tiny_model, server.url, tmp_path, "no-gpu", task_runner="ray",
                            ray_address=ray_cluster.address, extraction_gpus=1))
    assert server.log.bodies == [], "refused before a single request"
    assert not (tmp_path / "no-gpu" / "generations").exists()


def test_a_cluster_of_another_ray_version_is_refused_in_one_line_naming_the_fix(
        tiny_model: Path, server: ScriptedServer, ray_cluster: Any, tmp_path: Path) -> None:
    """The cluster's own metadata says another Ray version (what a driver of another version meets): Ray's
    version check refuses the driver, and the run says which versions to install, in one line."""
    from ray._common.usage.usage_constants import CLUSTER_METADATA_KEY
    from ray._private.ray_constants import KV_NAMESPACE_CLUSTER
    from ray._raylet import GcsClient

    gcs = GcsClient(address=ray_cluster.gcs_address)
    original = gcs.internal_kv_get(CLUSTER_METADATA_KEY, namespace=KV_NAMESPACE_CLUSTER)
    older = {**json.loads(original), "ray_version": "2.9.3"}
    gcs.internal_kv_put(CLUSTER_METADATA_KEY, json.dumps(older).encode(), True, namespace=KV_NAMESPACE_CLUSTER)
    try:
        with pytest.raises(ClusterUnusable) as refused:
            run_pipeline(config(tiny_model, server.url, tmp_path, "old-ray", task_runner="ray",
                                ray_address=ray_cluster.address))
    finally:
        gcs.internal_kv_put(CLUSTER_METADATA_KEY, original, True, namespace=KV_NAMESPACE_CLUSTER)
    message = str(refused.value)
    assert "\n" not in message and "runs another Ray or Python version" in message and "2.9.3" in message
    assert "install the cluster's versions here" in message
    assert server.log.bodies == [] and not (tmp_path / "old-ray" / "generations").exists()


def test_a_worker_node_killed_mid_run_loses_and_duplicates_nothing(
        tiny_model: Path, tmp_path: Path) -> None:
    """Generation runs on the only worker node (the head takes no tasks); that node's raylet is killed while
    requests are in flight, a new node joins. Ray runs the task again there (it resumes from the partial logs), or
    the run ends Failed and a re-run finishes it: either way every prompt is answered exactly once."""
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), latency_s=0.4)
    with ScriptedServer(script) as server, \
            local_cluster(head_cpus=0, workers=1) as cluster:
        doomed = next(node for node in cluster.worker_nodes)
        settings = config(tiny_model, server.url, tmp_path, "killed", task_runner="ray", ray_address=cluster.address)
        settings = settings.model_copy(update={"server": settings.server.model_copy(update={"max_in_flight": 2})})
        runner, ended = started_under_way(settings, server)
        cluster.add_node(**NODE)
        cluster.remove_node(doomed, allow_graceful=False)  # SIGKILL: the raylet and its workers
        runner.join(timeout=400)
        assert not runner.is_alive()
        if ended[0] is not None:
            run_pipeline(settings)
        assert len(server.log.bodies) <= 24 + 2, "only the requests in flight on the killed node are asked again"
    verification = verify_run(RunStore(str(tmp_path), "killed"))
    assert verification.complete, verification.verdict()
    answered = [json.loads(line)["id"] for f in sorted((tmp_path / "killed").glob("generations/shard-*.jsonl"))
                for line in f.read_text().splitlines()]
    assert len(answered) == len(set(answered)) == 24, "no prompt lost or answered twice"


def test_losing_the_clusters_head_fails_the_run_in_seconds_with_one_line_and_a_rerun_finishes_it(
        tiny_model: Path, tmp_path: Path) -> None:
    """The head's processes are SIGKILLed while generation runs on the worker node: the run ends Failed within
    seconds with one line naming the head and the fix (Ray alone would wait 60 s, then end the process without a
    word of ours), the manifest says so, and a re-run on a new cluster answers only what was not kept."""
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), latency_s=0.4)
    with ScriptedServer(script) as server:
        with local_cluster(head_cpus=0, workers=1) as cluster:
            settings = config(tiny_model, server.url, tmp_path, "headless", task_runner="ray",
                              ray_address=cluster.address)
            settings = settings.model_copy(update={"server": settings.server.model_copy(update={"max_in_flight": 2})})
            runner, ended = started_under_way(settings, server)
            cluster.head_node.kill_all_processes(check_alive=False, allow_graceful=False)
            lost_at = time.monotonic()
            manifest_path = tmp_path / "headless" / "manifest.json"
            while json.loads(manifest_path.read_text())["status"] == "running" and runner.is_alive():
                time.sleep(0.2)
            failed_after = time.monotonic() - lost_at
            runner.join(timeout=120)
        assert not runner.is_alive()
        assert isinstance(ended[0], ClusterLost), ended
        message = str(ended[0])
        assert "\n" not in message and "head" in message and "run again" in message, message
        # Ray alone would wait 60 s for its head, then end the whole process: the run ends before that, by itself
        assert failed_after < 45, f"the run ended {failed_after:.0f} s after its head was lost"
        manifest = json.loads(manifest_path.read_text())
        assert manifest["status"] == "failed" and "stopped answering" in manifest["cause"], manifest
        asked_before = len(server.log.bodies)
        with local_cluster(head_cpus=1, workers=1) as restarted:
            run_pipeline(settings.model_copy(update={"execution": settings.execution.model_copy(
                update={"ray_address": restarted.address})}))
        verification = verify_run(RunStore(str(tmp_path), "headless"))
        assert verification.complete, verification.verdict()
        answered = [json.loads(line)["id"] for f in sorted((tmp_path / "headless").glob("generations/shard-*.jsonl"))
                    for line in f.read_text().splitlines()]
        assert len(answered) == len(set(answered)) == 24, "no prompt lost or answered twice"
        assert len(server.log.bodies) - asked_before < 24, "the re-run asks only what was not kept"
