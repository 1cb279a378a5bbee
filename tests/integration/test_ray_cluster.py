"""The pipeline on a real Ray cluster (two nodes on this machine) through prefect-ray: the same bytes as the local
runner, the target loaded once per worker process, and a cluster that cannot run the job refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.demo import DEMO_MODEL_NAME, demo_questions
from cli.runner import run_pipeline
from eagle3_datagen.config import PipelineConfig, parse_config
from eagle3_datagen.execution import ClusterUnusable
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.testing.vllm_server import free_port
from eagle3_datagen.think_tokens import load_tokenizer

pytestmark = pytest.mark.usefixtures("prefect_api")

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
OUTPUTS = ("generations/shard-*.jsonl", "validation/shard-*.json", "sequences/shard-*.parquet",
           "hidden_states/*/index.json", "hidden_states/*/*.safetensors", "rejected/*.jsonl")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A head and one worker node, one CPU each, their files under the test folder (Ray's default is /tmp)."""
    import ray
    from ray.cluster_utils import Cluster

    ray_tmp = tmp_path_factory.getbasetemp() / "ray"
    ray_tmp.mkdir()
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(ray_tmp)
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_TMPDIR") if saved is None else os.environ.update(RAY_TMPDIR=saved)
        shutil.rmtree(ray_tmp, ignore_errors=True)


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

    workers = [json.loads(path.read_text()) for path in sorted((tmp_path / "ray").glob("hidden_states/*/worker.json"))]
    assert len(workers) == 4
    assert {w["pid"] for w in workers}.isdisjoint({os.getpid()}), "every shard extracted on a Ray worker"
    assert all(w["target_loads_in_process"] == 1 for w in workers), f"one target load per worker process: {workers}"


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
