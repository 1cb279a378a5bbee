"""The service path, as a team uses it from the Prefect UI: a real Prefect server and process worker, `prefect
deploy` from this repository's prefect.yaml, deployment runs created through the API as the UI creates them,
against the project's scripted OpenAI-protocol server. Each case of the UI's promises has a test: outputs that
stay, shards you can see (and that fail alone), a report you can read, a schedule that works, a form that
refuses bad input at submit. The browser tests at the end drive the UI itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cli.demo import DEMO_MODEL_NAME, demo_questions
from eagle3_datagen.config import ABSOLUTE_OUTPUT_FIX
from eagle3_datagen.testing.processes import as_from_a_terminal
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.testing.vllm_server import free_port
from eagle3_datagen.think_tokens import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
# Requests take long enough for the report's latency plot to have points (a sub-second generation has none).
LATENCY_S = 0.3
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
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=as_from_a_terminal)
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
            done = subprocess.run([PREFECT, *command], env={**env, "PWD": str(REPO)}, cwd=REPO,  # as from a shell
                                  capture_output=True, text=True, timeout=300)
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
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=as_from_a_terminal)
        yield path
        process.terminate()
        process.wait(timeout=60)


# Statuses Prefect's own client retries: the server answers 503 while its SQLite database is busy.
BUSY_STATUSES = {429, 502, 503}


def _api(env: dict[str, str], method: str, path: str, **kwargs: Any) -> Any:
    """One API call, retried as Prefect's client retries it, so a busy server is not a failed test."""
    for attempt in range(8):
        response = httpx.request(method, env["PREFECT_API_URL"] + path, timeout=30, **kwargs)
        if response.status_code not in BUSY_STATUSES:
            break
        time.sleep(min(2 ** attempt, 10))
    response.raise_for_status()
    return response.json() if response.content else None


def _deployment(env: dict[str, str], name: str) -> dict[str, Any]:
    return next(d for d in _api(env, "POST", "/deployments/filter", json={}) if d["name"] == name)


def _start(env: dict[str, str], deployment: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A flow run of a deployment, created as the UI's Run button creates it."""
    return _api(env, "POST", f"/deployments/{_deployment(env, deployment)['id']}/create_flow_run",
                json={"parameters": parameters})


def _task_run_names(env: dict[str, str], flow_run_id: str) -> set[str]:
    runs = _api(env, "POST", "/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {run["name"] for run in runs}


def _artifact(env: dict[str, str], key: str) -> dict[str, Any]:
    return _api(env, "GET", f"/artifacts/{key}/latest")


def _service_config(tiny_model: Path, url: str, output: Path, run_name: str, **sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run_name": run_name, "output_uri": str(output),
        "data": {"source": str(demo_questions()), "shard_size": 10, "limit": 20},
        "model": {"name": DEMO_MODEL_NAME, "profile": "qwen3", "tokenizer": str(tiny_model)},
        "server": {"endpoints": [url], "max_retries": 1, "retry_backoff_s": 0.05},
        "generation": {"max_tokens": 64},
        "hidden_states": {"model": str(tiny_model), "dtype": "float32"},
    }
    return {**config, **sections}


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
    assert set(deployments) == {"pipeline", "nightly", "pipeline-ray", "generation-only", "extract-only",
                                "rerun-failed", "export", "evaluate"}
    schedule = deployments["nightly"]["schedules"][0]
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["active"] is False
    schema = deployments["pipeline"]["parameter_openapi_schema"]
    assert "config" in schema["properties"], "the UI form is the pydantic config"
    assert "PipelineConfig" in str(schema)


def _shard_of(run: Path, text: str) -> str:
    """The shard (`shard-NNNNN`) whose prompts mention `text`."""
    return next(f.stem for f in sorted((run / "prompts").glob("shard-*.jsonl")) if text in f.read_text())


def test_a_failed_shard_goes_on_alone_is_named_and_retried_alone(prefect_env: dict[str, str], worker: Path,
                                                                  tiny_model: Path, tmp_path: Path) -> None:
    """Shards you can see: runs named after the run and shard, the live per-shard table, a failed shard holding
    no other back from validation, sequences and hidden states, the run Failed naming it, Retry redoing only it;
    then the report of the completed run: a row per shard, the output link, its plots inline."""
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), unavailable_for="France",
                    latency_s=LATENCY_S)
    with ScriptedServer(script) as server:
        run = _start(prefect_env, "pipeline", {"config": _service_config(tiny_model, server.url, tmp_path, "service")})
        assert _final_state(prefect_env, run["id"]) == "FAILED", worker.read_text()[-3000:]
        flow_run = _api(prefect_env, "GET", f"/flow_runs/{run['id']}")
        run_dir = tmp_path / "service"
        manifest = json.loads((run_dir / "manifest.json").read_text())
        failed = _shard_of(run_dir, "France")
        went_on = ({"shard-00000", "shard-00001"} - {failed}).pop()
        assert flow_run["name"] == "service", "the flow run is named after the run, not a random name"
        assert manifest["status"] == "failed" and "could not be generated" in manifest["cause"]
        assert f"did not finish ({failed}; the others went on to hidden_states)" in manifest["cause"]
        assert manifest["cause"] in flow_run["state"]["message"], "the UI shows the manifest's one-line cause"
        assert (run_dir / "hidden_states" / went_on / "index.json").exists(), "the good shard reached the end"
        assert not (run_dir / "generations" / f"{failed}.jsonl").exists()
        names = _task_run_names(prefect_env, run["id"])
        number = went_on.removeprefix("shard-")
        assert {"service/generate", f"service/validate-{number}", f"service/build-sequences-{number}",
                f"service/extract-hidden-states-{number}"} <= names, names
        table = {row["shard"]: row for row in json.loads(_artifact(prefect_env, "service-shards")["data"])}
        assert table[went_on]["status"] == "written" and table[went_on]["remaining"] == 0
        assert table[failed]["status"] == "unfinished" and table[failed]["remaining"] > 0
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
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["config"]["output_uri"] == str(tmp_path)

    report = _artifact(prefect_env, "service-report")["data"]
    rows = [line for line in report.splitlines() if line.startswith("| shard-")]
    assert [row.split(" | ")[0] for row in rows] == ["| shard-00000", "| shard-00001"]
    assert all("hidden_states: done" in row for row in rows), "each row says the stage its shard reached"
    assert f"Output: `{run_dir}` (list it: `ls {run_dir}`; check it: `eagle3-datagen verify {run_dir}`)" in report
    assert report.count("](data:image/png;base64,") == 3, "lengths, shard outcomes and latency plots inline"
    output = _artifact(prefect_env, "service-output")["data"]
    assert f"`{run_dir}`" in output and "file://" not in output, "a path to copy: no browser opens file:// from http"


def test_the_rerun_failed_deployment_finishes_only_the_failed_shards(prefect_env: dict[str, str], worker: Path,
                                                                    tiny_model: Path, tmp_path: Path) -> None:
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), unavailable_for="France")
    with ScriptedServer(script) as server:
        config = _service_config(tiny_model, server.url, tmp_path, "rerun", hidden_states={"backend": "none"})
        first = _start(prefect_env, "pipeline", {"config": config})
        assert _final_state(prefect_env, first["id"]) == "FAILED", worker.read_text()[-3000:]
        asked_first = len(server.log.bodies)
        script.unavailable_for = None
        rerun = _start(prefect_env, "rerun-failed", {"run": str(tmp_path / "rerun")})
        assert _final_state(prefect_env, rerun["id"]) == "COMPLETED", worker.read_text()[-3000:]
        asked_again = [b["messages"][-1]["content"] for b in server.log.bodies[asked_first:]]
    assert asked_again and all("France" in q for q in asked_again), "only the failed shard's prompts were asked"
    assert _api(prefect_env, "GET", f"/flow_runs/{rerun['id']}")["name"] == "rerun/rerun-failed"
    assert json.loads((tmp_path / "rerun" / "manifest.json").read_text())["status"] == "completed"


def test_outputs_stay_a_relative_output_is_refused_at_submit_and_by_the_run(
        prefect_env: dict[str, str], worker: Path, tiny_model: Path, tmp_path: Path) -> None:
    """A worker runs a flow in a temporary folder that is deleted afterwards: a relative output_uri would vanish."""
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as server:
        config = _service_config(tiny_model, server.url, Path("runs"), "relative")
        deployment = _deployment(prefect_env, "pipeline")
        refused = httpx.post(f"{prefect_env['PREFECT_API_URL']}/deployments/{deployment['id']}/create_flow_run",
                             json={"parameters": {"config": config}}, timeout=30)
        detail = refused.json()["detail"]
        assert refused.status_code == 409 and "output_uri" in detail, detail
        assert ABSOLUTE_OUTPUT_FIX in detail and "^(" not in detail, "the refusal says what to write, not a regex"
        # an API client may turn the form's check off: the run itself refuses, before anything is written or asked
        run = _api(prefect_env, "POST", f"/deployments/{deployment['id']}/create_flow_run",
                   json={"parameters": {"config": config}, "enforce_parameter_schema": False})
        assert _final_state(prefect_env, run["id"]) == "FAILED", worker.read_text()[-3000:]
        message = _api(prefect_env, "GET", f"/flow_runs/{run['id']}")["state"]["message"]
        assert "config key output_uri: 'runs' is relative" in message
        assert "set output_uri to an absolute path or s3://bucket/prefix" in message
        assert server.log.requests == 0


def _log_lines(env: dict[str, str], flow_run_id: str, awaited: str, timeout_s: float = 60) -> list[str]:
    """The flow run's log lines as the UI's Logs tab reads them, once the awaited text is there.

    Prefect ships log lines in batches after the run's state is set, so a run can read Failed before its lines
    arrive; a line still missing at the deadline is a failure.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        logs = _api(env, "POST", "/logs/filter",
                    json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})
        lines = [line for log in logs for line in log["message"].splitlines()]
        if any(awaited in line for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(1)


def test_a_dead_server_fails_the_run_in_seconds_with_one_line_in_the_ui_and_no_traceback(
        prefect_env: dict[str, str], worker: Path, tiny_model: Path, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there; the default startup_timeout_s is minutes
    run = _start(prefect_env, "pipeline", {"config": _service_config(tiny_model, dead, tmp_path, "dead-server")})
    assert _final_state(prefect_env, run["id"]) == "FAILED", worker.read_text()[-3000:]
    ended = _api(prefect_env, "GET", f"/flow_runs/{run['id']}")
    assert f"nothing listens at {dead} (connection refused for" in ended["state"]["message"]
    took = datetime.fromisoformat(ended["end_time"]) - datetime.fromisoformat(ended["start_time"])
    assert took.total_seconds() < 120, "refused is not starting: no wait for server.startup_timeout_s"
    lines = _log_lines(prefect_env, run["id"], awaited=f"nothing listens at {dead}")
    assert any(f"waiting for {dead} to start: the port refuses connections" in line for line in lines), lines
    assert any(f"nothing listens at {dead}" in line for line in lines), lines
    assert not [line for line in lines if "Traceback" in line], lines


def test_a_known_error_reaches_the_ui_logs_as_one_line_without_a_traceback(
        prefect_env: dict[str, str], worker: Path, tiny_model: Path, tmp_path: Path) -> None:
    config = _service_config(tiny_model, "http://127.0.0.1:9", tmp_path, "bad-path",
                             data={"source": str(tmp_path / "absent.jsonl")})
    run = _start(prefect_env, "pipeline", {"config": config})
    assert _final_state(prefect_env, run["id"]) == "FAILED", worker.read_text()[-3000:]
    message = _api(prefect_env, "GET", f"/flow_runs/{run['id']}")["state"]["message"]
    assert "absent.jsonl" in message
    lines = _log_lines(prefect_env, run["id"], awaited="absent.jsonl")
    assert any("absent.jsonl" in line for line in lines), lines
    assert not [line for line in lines if "Traceback" in line or line.startswith("  File ")], lines
    log = next((tmp_path / "bad-path" / "logs").glob("run-*.log")).read_text()
    assert "absent.jsonl" in log and "Traceback" in log, "the run's log file in storage keeps the traceback"
    # the same in a flow that fails before it reaches the pipeline: a run folder that does not exist
    rerun = _start(prefect_env, "rerun-failed", {"run": str(tmp_path / "never-ran")})
    assert _final_state(prefect_env, rerun["id"]) == "FAILED", worker.read_text()[-3000:]
    lines = _log_lines(prefect_env, rerun["id"], awaited="never-ran")
    assert any("never-ran" in line for line in lines), lines
    assert not [line for line in lines if "Traceback" in line or line.startswith("  File ")], lines


def test_the_form_refuses_bad_input_at_submit_naming_the_field(prefect_env: dict[str, str]) -> None:
    deployment = _deployment(prefect_env, "pipeline")
    good = deployment["parameters"]["config"]
    url = f"{prefect_env['PREFECT_API_URL']}/deployments/{deployment['id']}/create_flow_run"
    for bad, field in ((_merge(good, server={"endpoints": []}), "server.endpoints"),
                       (_merge(good, model={**good["model"], "profile": "kimi-k9"}), "model.profile"),
                       ({key: value for key, value in good.items() if key != "server"}, "server")):
        response = httpx.post(url, json={"parameters": {"config": bad}}, timeout=30)
        assert response.status_code == 409, response.text
        assert f"config.{field}" in response.json()["detail"] or f"'{field.rsplit('.', 1)[-1]}'" in \
            response.json()["detail"], response.text
    assert not _api(prefect_env, "POST", "/flow_runs/filter", json={"deployments": {"id": {"any_": [
        deployment["id"]]}}, "flow_runs": {"state": {"type": {"any_": ["SCHEDULED", "PENDING"]}}}})


def _merge(config: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {**config, **sections}


def test_turning_the_schedule_on_runs_the_documented_default_config(prefect_env: dict[str, str]) -> None:
    deployment = _deployment(prefect_env, "nightly")
    example = yaml.safe_load((REPO / "examples" / "nightly.yaml").read_text())
    assert deployment["parameters"] == {"config": example}, "the schedule's runs get the documented example"
    form = _deployment(prefect_env, "pipeline")["parameters"]["config"]
    assert form["output_uri"] == str(REPO / "runs"), "the pipeline form opens with this machine's values"
    schedule = deployment["schedules"][0]
    _api(prefect_env, "PATCH", f"/deployments/{deployment['id']}/schedules/{schedule['id']}", json={"active": True})
    try:
        _api(prefect_env, "POST", f"/deployments/{deployment['id']}/schedule", json={"max_runs": 1})
        scheduled = _api(prefect_env, "POST", "/flow_runs/filter", json={
            "deployments": {"id": {"any_": [deployment["id"]]}},
            "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}})
        assert scheduled and all(run["parameters"] == {"config": example} for run in scheduled)
    finally:  # turning it off removes the runs it scheduled (at 02:00, long after this test)
        _api(prefect_env, "PATCH", f"/deployments/{deployment['id']}/schedules/{schedule['id']}",
             json={"active": False})
    assert not _api(prefect_env, "POST", "/flow_runs/filter", json={
        "deployments": {"id": {"any_": [deployment["id"]]}}, "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}})


def test_the_forms_defaults_run_once_pointed_at_a_server_as_the_readme_says(
        prefect_env: dict[str, str], worker: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Quick run with the form's defaults, changed only where the README says: the server and its model (and,
    here, an output folder the test removes)."""
    defaults = _deployment(prefect_env, "pipeline")["parameters"]["config"]
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as server:
        config = {**defaults, "output_uri": str(tmp_path), "server": {**defaults["server"], "endpoints": [server.url]},
                  "model": {**defaults["model"], "tokenizer": str(tiny_model)}}
        run = _start(prefect_env, "pipeline", {"config": config})
        assert _final_state(prefect_env, run["id"]) == "COMPLETED", worker.read_text()[-3000:]
    # one name: the form sets none in the config, so the run takes the flow run's name, which stays as it was
    assert "run_name" not in defaults
    assert _api(prefect_env, "GET", f"/flow_runs/{run['id']}")["name"] == run["name"]
    manifest = json.loads((tmp_path / run["name"] / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["config"]["server"]["max_in_flight"] == 16
    assert manifest["config"]["run_name"] == run["name"]
    assert len(list((tmp_path / run["name"] / "logs").glob("run-*.log"))) == 1, "the run's log file"


def test_a_nightly_pass_over_a_grown_dataset_asks_only_the_new_prompts(prefect_env: dict[str, str], worker: Path,
                                                                      tiny_model: Path, tmp_path: Path) -> None:
    rows = demo_questions().read_text().splitlines()
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(rows[:12]) + "\n")
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as server:
        config = _service_config(tiny_model, server.url, tmp_path / "runs", "nightly",
                                 data={"source": str(dataset), "shard_size": 10}, hidden_states={"backend": "none"})
        first = _start(prefect_env, "pipeline", {"config": config})
        assert _final_state(prefect_env, first["id"]) == "COMPLETED", worker.read_text()[-3000:]
        asked_first = len(server.log.bodies)
        dataset.write_text("\n".join(rows[:18]) + "\n")  # the dataset grew by 6 rows since last night
        second = _start(prefect_env, "pipeline", {"config": config})
        assert _final_state(prefect_env, second["id"]) == "COMPLETED", worker.read_text()[-3000:]
        asked_second = [b["messages"][-1]["content"] for b in server.log.bodies[asked_first:]]
    new = [[turn["value"] for turn in json.loads(row)["conversations"] if turn["from"] == "human"][-1]
           for row in rows[12:18]]
    assert asked_first == 12 and sorted(asked_second) == sorted(new)


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


# The browser tests: Debian's chromium (`make test-browser`) driven by Playwright, on the Prefect UI itself.
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (`make test-browser` installs it with apt-get)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the `browser` extra)")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _form_property(page: Any, *labels: str) -> Any:
    """The schema form's property at `labels` (one label per nesting level, "(Optional)" aside)."""
    xpath = ""
    for label in labels:
        xpath += ("//div[contains(@class, 'schema-form-property ') or @class='p-label schema-form-property']"
                  f"[./div[@class='p-label__header']//span[@class='schema-form-property__label' and "
                  f"(normalize-space()='{label}' or normalize-space()='{label} (Optional)')]]")
    return page.locator(f"xpath={xpath}").first


def _flow_runs_of(env: dict[str, str], deployment_id: str, run_name: str) -> list[str]:
    """Ids of the deployment's flow runs whose config names `run_name`."""
    runs = _api(env, "POST", "/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment_id]}}})
    return [run["id"] for run in runs if run["parameters"].get("config", {}).get("run_name") == run_name]


def _open_artifact(page: Any, ui: str, key: str) -> None:
    """The artifact's latest version, reached as a user does: its key's timeline, then the version's link."""
    page.goto(f"{ui}/artifacts/key/{key}")
    page.locator("a[href*='/artifacts/artifact/']").first.click()
    page.wait_for_url("**/artifacts/artifact/**")


def test_a_run_submitted_from_the_ui_form_shows_its_state_shards_output_and_report(
        prefect_env: dict[str, str], worker: Path, browser: Any, tiny_model: Path, tmp_path: Path) -> None:
    """The deployment's form filled and submitted in the browser as a user does; then, in the UI: the run's final
    state, the per-shard table, the output link and the report's plots rendered."""
    ui = prefect_env["PREFECT_API_URL"].removesuffix("/api")
    deployment = _deployment(prefect_env, "pipeline")
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), latency_s=LATENCY_S)
    with ScriptedServer(script) as server:
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        page.goto(f"{ui}/deployments/deployment/{deployment['id']}/run")
        for labels, value in ((("Run name",), "browser"), (("Output",), str(tmp_path)),
                              (("Data", "Source"), str(demo_questions())), (("Data", "Shard size"), "10"),
                              (("Model", "Name"), DEMO_MODEL_NAME), (("Model", "Tokenizer"), str(tiny_model)),
                              (("Server", "Endpoints"), server.url), (("Generation", "Max tokens"), "64")):
            _form_property(page, *labels).locator("textarea, input").first.fill(value)
        _form_property(page, "Model", "Profile").locator("button.p-select-button__control").focus()
        page.keyboard.press("ArrowDown")  # the list opens from the keyboard (a click toggles it shut again)
        page.get_by_role("option", name="qwen3", exact=True).click()
        page.get_by_role("button", name="Submit").click()
        page.wait_for_url(f"**/deployments/deployment/{deployment['id']}*", timeout=30_000)
        flow_run_id = next(iter(_flow_runs_of(prefect_env, deployment["id"], "browser")))
        assert _final_state(prefect_env, flow_run_id) == "COMPLETED", worker.read_text()[-3000:]
    submitted = _api(prefect_env, "GET", f"/flow_runs/{flow_run_id}")["parameters"]["config"]
    assert submitted["server"]["endpoints"] == [server.url] and submitted["model"]["profile"] == "qwen3"

    page.goto(f"{ui}/runs/flow-run/{flow_run_id}")
    page.locator(".state-badge.state--completed", has_text="Completed").first.wait_for(timeout=30_000)
    _open_artifact(page, ui, "browser-shards")
    for shard in ("shard-00000", "shard-00001"):
        row = page.locator("tr.p-table-row", has_text=shard)
        row.first.wait_for(timeout=30_000)
        assert "written" in row.first.inner_text(), row.first.inner_text()
    _open_artifact(page, ui, "browser-output")
    run_dir = tmp_path / "browser"
    page.locator("code", has_text=str(run_dir)).first.wait_for(timeout=30_000)
    _open_artifact(page, ui, "browser-report")
    plots = page.locator("img[src^='data:image/png;base64,']")
    report = _artifact(prefect_env, "browser-report")["data"]
    assert report.count("](data:image/png;base64,") == 3, report[:3000]
    plots.nth(2).wait_for(timeout=30_000)
    assert plots.count() == 3
    assert all(plots.nth(i).evaluate("img => img.complete && img.naturalWidth > 0") for i in range(3)), \
        "every plot decodes and renders"
    page.close()


def _pipeline_form(env: dict[str, str], browser: Any) -> tuple[Any, int]:
    """The pipeline deployment's run form, open in a page, and how many flow runs there were before."""
    ui = env["PREFECT_API_URL"].removesuffix("/api")
    before = len(_api(env, "POST", "/flow_runs/filter", json={}))
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    page.goto(f"{ui}/deployments/deployment/{_deployment(env, 'pipeline')['id']}/run")
    return page, before


def test_the_ui_form_refuses_a_run_without_endpoints_naming_the_field(prefect_env: dict[str, str],
                                                                      browser: Any) -> None:
    page, before = _pipeline_form(prefect_env, browser)
    endpoints = _form_property(page, "Server", "Endpoints")
    endpoints.locator("textarea").first.wait_for()
    endpoints.locator("button.p-button--outline").first.click()  # the item's delete button: the list is now empty
    endpoints.locator("textarea").first.wait_for(state="detached")
    page.get_by_role("button", name="Submit").click()
    page.get_by_text("'endpoints' is a required property").first.wait_for(timeout=30_000)
    assert page.url.endswith("/run"), "the form stays open with what was filled in"
    assert len(_api(prefect_env, "POST", "/flow_runs/filter", json={})) == before, "no run was created"
    page.close()


def test_the_ui_form_refuses_a_relative_output_saying_what_to_write(prefect_env: dict[str, str],
                                                                    browser: Any) -> None:
    page, before = _pipeline_form(prefect_env, browser)
    _form_property(page, "Output").locator("textarea, input").first.fill("runs/relative")
    page.get_by_role("button", name="Submit").click()
    page.get_by_text(ABSOLUTE_OUTPUT_FIX).first.wait_for(timeout=30_000)
    assert not page.get_by_text("does not match").count(), "no regex is quoted to the user"
    assert len(_api(prefect_env, "POST", "/flow_runs/filter", json={})) == before, "no run was created"
    page.close()


def test_the_ui_shows_a_dead_server_and_a_bad_path_as_their_lines_without_a_traceback(
        prefect_env: dict[str, str], worker: Path, browser: Any, tiny_model: Path, tmp_path: Path) -> None:
    """The flow run's page, as a team member opens it: its Logs tab holds the one line that names the fix, and no
    traceback; a dead server's run says so within seconds of its start."""
    ui = prefect_env["PREFECT_API_URL"].removesuffix("/api")
    dead = f"http://127.0.0.1:{free_port()}"
    runs = {
        f"nothing listens at {dead}": _start(prefect_env, "pipeline", {
            "config": _service_config(tiny_model, dead, tmp_path, "ui-dead-server")}),
        "absent.jsonl": _start(prefect_env, "pipeline", {"config": _service_config(
            tiny_model, "http://127.0.0.1:9", tmp_path, "ui-bad-path",
            data={"source": str(tmp_path / "absent.jsonl")})}),
    }
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    for line, run in runs.items():
        assert _final_state(prefect_env, run["id"]) == "FAILED", worker.read_text()[-3000:]
        _log_lines(prefect_env, run["id"], awaited=line)  # Prefect ships log lines after the state
        page.goto(f"{ui}/runs/flow-run/{run['id']}")
        page.get_by_text(line).first.wait_for(timeout=30_000)
        logs = page.locator("body").inner_text()
        assert "Traceback" not in logs and 'File "' not in logs, logs[-3000:]
    page.close()
