"""Cancel means stop: SIGTERM to the `eagle3-datagen run` command (what Prefect's runner sends a deployment's flow
run when it is cancelled from the UI) stops generation within seconds, keeps what was logged, ends the manifest
`cancelled`, and a re-run answers every prompt exactly once without asking a logged one again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.demo import DEMO_MODEL_NAME
from cli.main import main
from eagle3_datagen.config import parse_config
from eagle3_datagen.testing.processes import as_from_a_terminal
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.think_tokens import load_tokenizer

pytestmark = pytest.mark.usefixtures("prefect_api")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 60
IN_FLIGHT = 4


def write_run(tmp_path: Path, tiny_model: Path, url: str) -> str:
    """A run of PROMPTS questions in shards of 16, generation only, as the YAML file a user passes to the command."""
    source = tmp_path / "questions.jsonl"
    source.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"What is {i} plus {i}?"}]})
                              + "\n" for i in range(PROMPTS)))
    cfg = parse_config({
        "run_name": "cancelled",
        "output_uri": str(tmp_path),
        "data": {"source": str(source), "shard_size": 16},
        "model": {"name": DEMO_MODEL_NAME, "profile": "qwen3", "tokenizer": str(tiny_model)},
        "server": {"endpoints": [url], "max_in_flight": IN_FLIGHT, "startup_timeout_s": 10},
        "hidden_states": {"backend": "none"},
    })
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return str(path)


def logged(run: Path) -> set[str]:
    """The questions the run's partial logs and finished shards hold an answer to (a discard voids one)."""
    kept: dict[str, str | None] = {}
    for log in sorted((run / "generations").glob("*.partial.jsonl")):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if "id" in entry:
                kept[entry["id"]] = entry["records"][0]["messages"][-1]["content"] if "records" in entry else None
    for record in generated(run):
        kept[record["id"]] = record["messages"][-1]["content"]
    return {question for question in kept.values() if question is not None}


def generated(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for shard in sorted((run / "generations").glob("shard-?????.jsonl"))
            for line in shard.read_text().splitlines()]


def questions(bodies: list[dict[str, Any]]) -> list[str]:
    return [body["messages"][-1]["content"] for body in bodies]


def test_sigterm_stops_generation_within_seconds_and_a_rerun_asks_only_what_was_not_logged(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from prefect.settings import PREFECT_API_URL

    run = tmp_path / "cancelled"
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), latency_s=0.5)
    with ScriptedServer(script) as server:
        config_path = write_run(tmp_path, tiny_model, server.url)
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or ""}
        child = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--config", config_path], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                 cwd=REPO, preexec_fn=as_from_a_terminal)
        try:
            deadline = time.monotonic() + 180
            while server.log.requests < 12:
                assert child.poll() is None and time.monotonic() < deadline, child.communicate()
                time.sleep(0.02)
            signalled_at = time.monotonic()
            child.send_signal(signal.SIGTERM)
            _, err = child.communicate(timeout=15)
            exited_after_s = time.monotonic() - signalled_at
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.communicate()
        asked_before = questions(server.log.bodies)
        Path("/work/debug-cancel.txt").open("a").write(repr((server.log.last_request_at - signalled_at, len(asked_before), exited_after_s,
              [round(t - signalled_at, 2) for t, _ in server.log.in_flight_samples if t > signalled_at - 1])) + "\n")
        assert exited_after_s < 15, err[-3000:]
        assert server.log.last_request_at is not None and server.log.last_request_at < signalled_at + 1.0, \
            f"{len(asked_before)} requests in all: requests went on after the signal"
        assert len(asked_before) < PROMPTS
        assert "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1] == "cancelled: stopped by SIGTERM; run again to resume (finished work is " \
            "kept)", err[-3000:]
        assert child.returncode == 128 + signal.SIGTERM
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["status"] == "cancelled", manifest
        kept_before = logged(run)
        assert len(kept_before) < PROMPTS
        sent_before = server.log.requests
        capsys.readouterr()
        assert main(["run", "--config", config_path]) == 0, capsys.readouterr().err[-3000:]
        asked_again = questions(server.log.bodies[sent_before:])
    assert not kept_before & set(asked_again), "a logged answer was asked again"
    assert len(asked_again) == len(set(asked_again)) == PROMPTS - len(kept_before)
    answered = [record["messages"][-1]["content"] for record in generated(run)]
    assert sorted(answered) == sorted(f"What is {i} plus {i}?" for i in range(PROMPTS)), "each answered once"
    assert json.loads((run / "manifest.json").read_text())["status"] == "completed"
