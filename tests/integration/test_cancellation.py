"""Cancel means stop: SIGTERM to the `eagle3-datagen run` command (what Prefect's runner sends a deployment's flow
run when it is cancelled from the UI) stops generation within seconds, keeps what was logged, ends the manifest
`cancelled`, and a re-run answers every prompt exactly once without asking a logged one again. Underneath, the
generation's stop event (which Prefect's task runner sets when the flow run stops) ends it at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_generation_faults import assert_exactly_once, run_generation, settings, write_prompt_shards

from cli.demo import DEMO_MODEL_NAME
from cli.main import main
from eagle3_datagen.config import ServerConfig, ValidationConfig, parse_config
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.processes import as_from_a_terminal
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, questions
from eagle3_datagen.think_tokens import load_tokenizer
from tasks.generation import generate_shards
from tasks.generation.scheduler import GenerationCancelled

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


def test_the_stop_event_ends_generation_at_once_and_keeps_every_answer_logged_for_the_next_run(
        tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 3, 20)
    stop, stopped_at = threading.Event(), []

    def stop_after(requests: int) -> None:
        while server.log.requests < requests:
            time.sleep(0.005)
        stopped_at.append(time.monotonic())
        stop.set()

    with ScriptedServer(Script(latency_s=1.0)) as server:
        threading.Thread(target=stop_after, args=(12,), daemon=True).start()
        config = ServerConfig(endpoints=[server.url], max_in_flight=IN_FLIGHT, retry_backoff_s=0.01)
        with pytest.raises(GenerationCancelled, match="run again to resume"):
            generate_shards(store, refs, settings(), config, ValidationConfig(early_abort_after=IN_FLIGHT),
                            logging.getLogger("test"), progress_every_s=0.2, stop=stop)
        ended_after_s = time.monotonic() - stopped_at[0]
        assert server.log.in_flight > 0, "the requests in flight are abandoned, not waited for"
        assert ended_after_s < 1.0
        assert server.log.last_request_at is not None and server.log.last_request_at < stopped_at[0] + 0.5, \
            "no request is sent once the stop is seen"
        assert server.log.requests < 60
    logs = sorted((tmp_path / "run" / "generations").glob("*.partial.jsonl"))
    answered = {entry["id"] for log in logs for line in log.read_text().splitlines()
                if "records" in (entry := json.loads(line))}  # every line whole: the logs were flushed and closed
    assert answered, "the answers of the passed window are kept"
    with ScriptedServer(Script()) as server:
        run_generation(store, refs, [server.url], budget=IN_FLIGHT)
        asked_again = questions(server.log.bodies)
    assert not {f"question {identifier.removeprefix('p')}" for identifier in answered} & set(asked_again)
    assert len(asked_again) == 60 - len(answered)
    assert assert_exactly_once(store, refs) == (60, 0)


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize(("signum", "last_line"), [
    (signal.SIGTERM, "cancelled: stopped by SIGTERM; run again to resume (finished work is kept)"),
    (signal.SIGINT, "cancelled: stopped by Ctrl-C; run again to resume (finished work is kept)"),
], ids=["sigterm", "ctrl-c"])
def test_a_signal_stops_the_command_within_seconds_and_a_rerun_asks_only_what_was_not_logged(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], signum: signal.Signals,
        last_line: str) -> None:
    from prefect.settings import PREFECT_API_URL

    run = tmp_path / "cancelled"
    # requests slow enough that each slot ends at most one while Prefect hands the signal on to generation
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), latency_s=2.0)
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
            sent_before_signal, in_flight = server.log.requests, server.log.in_flight
            child.send_signal(signum)
            _, err = child.communicate(timeout=15)
        finally:
            if child.poll() is None:  # still running 15 s after the signal
                os.killpg(child.pid, signal.SIGKILL)
                child.communicate()
        assert server.log.requests - sent_before_signal <= in_flight, "requests went on after the signal"
        assert "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1] == last_line, err[-3000:]
        assert child.returncode == 128 + signum
        assert json.loads((run / "manifest.json").read_text())["status"] == "cancelled"
        kept_before = logged(run)  # every line of the partial logs whole: they were flushed and closed
        assert len(kept_before) < PROMPTS
        sent_before = server.log.requests
        server.script.latency_s = 0.0
        capsys.readouterr()
        assert main(["run", "--config", config_path]) == 0, capsys.readouterr().err[-3000:]
        asked_again = questions(server.log.bodies[sent_before:])
    assert not kept_before & set(asked_again), "a logged answer was asked again"
    assert len(asked_again) == len(set(asked_again)) == PROMPTS - len(kept_before)
    answered = [record["messages"][-1]["content"] for record in generated(run)]
    assert sorted(answered) == sorted(f"What is {i} plus {i}?" for i in range(PROMPTS)), "each answered once"
    assert json.loads((run / "manifest.json").read_text())["status"] == "completed"
