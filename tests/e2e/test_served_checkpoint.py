"""What is served is pinned: a run whose answers came from one checkpoint is not finished by a server restarted on
another under the same name."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pipeline import config, manifest_of, write_config

from cli.demo import DEMO_MODEL_NAME
from cli.main import main
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.think_tokens import load_tokenizer

pytestmark = pytest.mark.usefixtures("prefect_api")


def test_a_server_restarted_on_another_checkpoint_is_refused_before_any_request(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = load_tokenizer(str(tiny_model))

    def served(checkpoint: str, **script: object) -> ScriptedServer:
        return ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=tokenizer, checkpoint=checkpoint, **script))

    with served("/models/a", unavailable_for="12 times 3") as first:  # one prompt unanswered: the run resumes
        cfg = config(tiny_model, first.url, tmp_path, hidden_states__backend="none", server__max_retries=0)
        assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
    assert (tmp_path / "flow" / "generations" / "served.json").exists()
    with served("/models/b") as other:
        capsys.readouterr()
        cfg = config(tiny_model, other.url, tmp_path, hidden_states__backend="none")
        assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"{other.url} serves /models/b (vLLM 0.32.0), but the run's answers come from /models/a" in line
        assert other.log.requests == 0
    with served("/models/a") as again:
        cfg = config(tiny_model, again.url, tmp_path, hidden_states__backend="none")
        assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 0
        assert 0 < again.log.requests < 24, "only the unanswered prompts are asked"
    assert manifest_of(tmp_path / "flow")["status"] == "completed"
