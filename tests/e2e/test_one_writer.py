"""One writer per run, through the command as a user runs it: a second start while a run is written is refused in
one line and asks nothing, and an attempt refused for other settings leaves the run's manifest as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_pipeline import config, manifest_of, start_cli_until, write_config

from cli.demo import DEMO_MODEL_NAME
from cli.main import main
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.think_tokens import load_tokenizer

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_a_second_start_while_a_run_is_written_is_refused_and_the_first_answers_every_prompt_alone(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)),
                               latency_s=0.2)) as server:
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none", server__max_in_flight=2)
        config_path = write_config(tmp_path / "c.yaml", cfg)
        first = start_cli_until(config_path, server, 4)
        capsys.readouterr()
        assert main(["run", "--config", config_path]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: run {tmp_path / 'flow'} is being written by ")
        assert f"pid {first.pid}" in err[-1] and "wait for that run to end or stop it" in err[-1]
        _, first_err = first.communicate(timeout=120)
        assert first.returncode == 0, first_err[-2000:]
        asked = [body["messages"][-1]["content"] for body in server.log.bodies]
    assert len(asked) == len(set(asked)) == 24, "every prompt asked once, by the one writer"
    assert manifest_of(tmp_path / "flow")["status"] == "completed"


def test_an_attempt_refused_for_other_settings_leaves_the_manifest_byte_for_byte(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as server:
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none")
        config_path = write_config(tmp_path / "c.yaml", cfg)
        assert main(["run", "--config", config_path]) == 0
        manifest = (tmp_path / "flow" / "manifest.json").read_bytes()
        requests = server.log.requests
        capsys.readouterr()
        assert main(["run", "--config", config_path, "--set", "generation.temperature=0.3"]) == 1
        assert "was generated with other settings" in capsys.readouterr().err.strip().splitlines()[-1]
        assert server.log.requests == requests
    assert (tmp_path / "flow" / "manifest.json").read_bytes() == manifest
    assert json.loads(manifest)["status"] == "completed"
    assert main(["verify", str(tmp_path / "flow")]) == 0
