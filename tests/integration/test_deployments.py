"""The service path: a real Prefect server and process worker, `prefect deploy` from this repository's
prefect.yaml, a deployment run with parameters, one shard failing, Retry through the API, and only that
shard running again.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.demo import DEMO_MODEL_NAME, demo_questions
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.testing.vllm_server import free_port
from eagle3_datagen.think_tokens import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "prefect")


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`prefect server start` (SQLite) on loopback, then a process work pool and the repo's deployments."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = (home / "server.log").open("w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-2000:]
            time.sleep(0.5)
        for command in (["work-pool", "create", "eagle3", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
            done = subprocess.run([PREFECT, *command], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        yield env
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def worker(prefect_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A process worker started in the repository root; yields its log file."""
    path = tmp_path_factory.mktemp("worker") / "worker.log"
    with path.open("w") as log:
        process = subprocess.Popen([PREFECT, "worker", "start", "--pool", "eagle3"], env=prefect_env, cwd=REPO,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        yield path
        process.terminate()
        process.wait(timeout=60)


def _api(env: dict[str, str], method: str, path: str, **kwargs: Any) -> Any:
    response = httpx.request(method, env["PREFECT_API_URL"] + path, timeout=30, **kwargs)
    response.raise_for_status()
    return response.json() if response.content else None


def _final_state(env: dict[str, str], flow_run_id: str, timeout_s: float = 420) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _api(env, "GET", f"/flow_runs/{flow_run_id}")["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state["type"]
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} did not finish in {timeout_s}s")


def test_deployments_and_schedule_are_registered(prefect_env: dict[str, str]) -> None:
    deployments = {d["name"]: d for d in _api(prefect_env, "POST", "/deployments/filter", json={})}
    assert set(deployments) == {"pipeline", "generation-only", "extract-only", "rerun-failed", "export"}
    schedule = deployments["pipeline"]["schedules"][0]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["active"] is False
    schema = deployments["pipeline"]["parameter_openapi_schema"]
    assert "config" in schema["properties"], "the UI form is the pydantic config"
    assert "PipelineConfig" in str(schema)


def test_a_failed_shard_is_retried_alone_through_the_api(prefect_env: dict[str, str], worker: Path,
                                                         tiny_model: Path, tmp_path: Path) -> None:
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), unavailable_for="France")
    with ScriptedServer(script) as server:
        config = {
            "run_name": "service", "output_uri": str(tmp_path),
            "data": {"source": str(demo_questions()), "shard_size": 10, "limit": 20},
            "model": {"name": DEMO_MODEL_NAME, "profile": "qwen3", "tokenizer": str(tiny_model)},
            "server": {"endpoints": [server.url], "max_retries": 1, "retry_backoff_s": 0.05},
        }
        deployment = next(d for d in _api(prefect_env, "POST", "/deployments/filter", json={})
                          if d["name"] == "generation-only")
        run = _api(prefect_env, "POST", f"/deployments/{deployment['id']}/create_flow_run",
                   json={"parameters": {"config": config}})
        assert _final_state(prefect_env, run["id"]) == "FAILED", worker.read_text()[-3000:]
        message = _api(prefect_env, "GET", f"/flow_runs/{run['id']}")["state"]["message"]
        manifest = json.loads((tmp_path / "service" / "manifest.json").read_text())
        assert manifest["status"] == "failed" and "could not be generated" in manifest["cause"]
        assert manifest["cause"] in message, "the UI shows the same one-line cause as the manifest"
        asked_first = [b["messages"][-1]["content"] for b in server.log.bodies]
        failing = {q for q in asked_first if "France" in q}
        assert failing, "the demo questions mention France once"

        script.unavailable_for = None  # the server recovers; press Retry
        done = subprocess.run([PREFECT, "flow-run", "retry", run["id"]], env=prefect_env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert _final_state(prefect_env, run["id"]) == "COMPLETED", worker.read_text()[-3000:]
        asked_after = [b["messages"][-1]["content"] for b in server.log.bodies[len(asked_first):]]
    assert sorted(asked_after) == sorted(failing), "only the failed shard's unfinished records were asked again"
    manifest = (tmp_path / "service" / "manifest.json").read_text()
    assert '"status": "completed"' in manifest


def test_a_run_cancelled_from_the_ui_ends_its_manifest_cancelled(prefect_env: dict[str, str], worker: Path,
                                                                 tiny_model: Path, tmp_path: Path) -> None:
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), latency_s=0.5)
    with ScriptedServer(script) as server:
        config = {
            "run_name": "cancelled", "output_uri": str(tmp_path),
            "data": {"source": str(demo_questions()), "shard_size": 10},
            "model": {"name": DEMO_MODEL_NAME, "profile": "qwen3", "tokenizer": str(tiny_model)},
            "server": {"endpoints": [server.url], "max_in_flight": 1},
            "hidden_states": {"backend": "none"},
        }
        deployment = next(d for d in _api(prefect_env, "POST", "/deployments/filter", json={})
                          if d["name"] == "pipeline")
        run = _api(prefect_env, "POST", f"/deployments/{deployment['id']}/create_flow_run",
                   json={"parameters": {"config": config}})
        deadline = time.monotonic() + 300
        while server.log.requests < 6:  # the probe, then generation under way
            assert time.monotonic() < deadline, worker.read_text()[-3000:]
            time.sleep(0.2)
        _api(prefect_env, "POST", f"/flow_runs/{run['id']}/set_state",
             json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True})
        assert _final_state(prefect_env, run["id"]) == "CANCELLED", worker.read_text()[-3000:]
    deadline = time.monotonic() + 60
    manifest_path = tmp_path / "cancelled" / "manifest.json"
    while json.loads(manifest_path.read_text())["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.5)  # the worker runs the flow's on_cancellation hook after killing the run
    manifest = json.loads(manifest_path.read_text())
    assert manifest["status"] == "cancelled" and "run again to resume" in manifest["cause"]
