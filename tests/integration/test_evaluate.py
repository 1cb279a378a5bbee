"""evaluate: a draft judged on a run's held-out split with speculators' own model code, equal to its trainer's own
validation figures, a trained draft above an untrained one, and a draft of another target refused in one line."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hidden_state_targets import write_sequences
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli.demo import demo_questions
from cli.main import main
from eagle3_datagen.artifacts import MANIFEST
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.storage import RunStore
from eagle3_datagen.trainers import speculators_call_kwargs
from tasks.evaluate.draft import DraftRefused, RunTarget, load_draft
from tasks.evaluate.evaluation import NothingToEvaluate, evaluate_draft
from tasks.export import export_run
from tasks.hidden_states.transformers_backend import extract_shard, load_target_model

TRAINERS = Path(os.environ.get("EAGLE3_TRAINERS", Path(__file__).resolve().parents[2] / "build" / "trainers"))
AUX = [2, 4, 5]
SAMPLES = 24
HELD_OUT = {f"s{i}" for i in range(0, SAMPLES, 4)}


def tiny_run(folder: Path, target: str, held_out: set[str]) -> RunStore:
    """A run of the tiny reasoning model's own sampled answers to the demo questions, extracted by the pipeline's
    extraction stage, with `held_out` as its held-out split."""
    tokenizer, model = AutoTokenizer.from_pretrained(target), AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(0)
    rows = []
    questions = [json.loads(line)["conversations"][-1]["value"] for line in demo_questions().open()]
    for i, question in enumerate(questions[:SAMPLES]):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
        ids = model.generate(prompt, max_new_tokens=40, do_sample=True, temperature=1.0, top_p=1.0)[0].tolist()
        rows.append((f"s{i}", ids, [0] * prompt.shape[1] + [1] * (len(ids) - prompt.shape[1])))
    store = RunStore(str(folder), "run")
    store.write_json(MANIFEST, {"config": {"hidden_states": {"backend": "transformers"}},
                                "shards": {"shard-00000": {}}, "status": "completed"})
    sequences = write_sequences(store, 0, rows, held_out)
    extract_shard(store, sequences, load_target_model(target, "float32", "cpu"), HiddenStatesConfig(dtype="float32"))
    return store


@pytest.fixture(scope="module")
def drafts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run of the tiny target with a held-out split, an untrained draft and one trained for 40 steps on its
    training split with speculators' own Trainer."""
    if not TRAINERS.is_dir():
        pytest.skip(f"the trainers are not installed in {TRAINERS} (`make setup` installs them)")
    os.environ.setdefault("EAGLE3_TRAINERS", str(TRAINERS))
    drafts_module = pytest.importorskip("eagle3_datagen.testing.drafts")
    folder = tmp_path_factory.mktemp("evaluate")
    store = tiny_run(folder, str(tiny_model), HELD_OUT)
    export_run(store.uri, "speculators")
    untrained = drafts_module.save_draft(drafts_module.new_draft(str(tiny_model), AUX), folder / "untrained")
    trained = drafts_module.train_draft(drafts_module.new_draft(str(tiny_model), AUX),
                                        folder / "run/exports/speculators", folder / "trained", max_steps=40)
    return {"run": store.uri, "untrained": str(untrained), "trained": str(trained), "folder": folder,
            "target": str(tiny_model)}


def test_a_trained_draft_scores_above_an_untrained_one_on_the_held_out_split(drafts: dict[str, Any]) -> None:
    before = evaluate_draft(drafts["run"], drafts["untrained"])
    after = evaluate_draft(drafts["run"], drafts["trained"])
    assert before["samples"] == after["samples"] == len(HELD_OUT)
    assert after["acceptance_length"] > before["acceptance_length"] + 0.2, (before["full_acc"], after["full_acc"])
    assert after["full_acc"][0] > before["full_acc"][0]
    rows = after["rows"]
    assert rows[0]["interval"][0] <= rows[0]["acceptance_length"] <= rows[0]["interval"][1]
    assert [r["value"] for r in rows if r["group"] == "source"] == ["-"]  # the synthetic run's sequences say none
    run = Path(drafts["run"])
    evaluation = json.loads((run / "evaluations" / after["name"] / "evaluation.json").read_text())
    assert evaluation["acceptance_length"] == after["acceptance_length"]
    report = (run / "report.md").read_text()
    assert report.count("### Draft ") == 2 and "## Draft evaluations" in report, "every evaluation in the report"


def test_the_figures_equal_speculators_own_validation_on_the_same_batches(drafts: dict[str, Any]) -> None:
    """speculators' Trainer.val_epoch over the held-out export, one sample a batch, gives evaluate's figures."""
    summary = evaluate_draft(drafts["run"], drafts["trained"])
    export_run(drafts["run"], "speculators", split="holdout")
    data = importlib.import_module("speculators.train.data")
    trainer_module = importlib.import_module("speculators.train.trainer")
    from eagle3_datagen.testing.drafts import on_this_cpu
    from tasks.evaluate.draft import batch_of

    held = data.ArrowDataset(datapath=f"{drafts['run']}/exports/speculators-holdout", max_len=4096,
                             on_missing="raise", split="train", train_ratio=1.0, hidden_states_dtype=torch.float32)
    batches = torch.utils.data.DataLoader(held, batch_size=1, collate_fn=lambda items: batch_of(items[0], 64))
    assert all(batch["document_ids"].max() == 0 for batch in batches), "one sample a batch, as evaluate runs"
    target = RunTarget(drafts["target"], 64, 2000, AUX)
    model = load_draft(drafts["trained"], target, "cpu")
    config = trainer_module.TrainerConfig(lr=1e-3, num_epochs=1, save_path=str(drafts["folder"] / "val"),
                                          train_call_kwargs=speculators_call_kwargs(3),
                                          val_call_kwargs=speculators_call_kwargs(3),
                                          hidden_states_dtype=torch.float32)
    with on_this_cpu(trainer_module):
        trainer = trainer_module.Trainer(model, config, batches, batches)
        trainer.device_type = "cpu"
        validation = trainer.val_epoch(0)
    assert len(batches) == summary["samples"] == len(HELD_OUT)
    for k in range(3):
        assert validation[f"full_acc_{k}_epoch"] == pytest.approx(summary["full_acc"][k], abs=1e-4)
        assert validation[f"cond_acc_{k}_epoch"] == pytest.approx(summary["rows"][0]["cond_acc"][k], abs=1e-4)


@pytest.mark.parametrize(("setting", "value", "named"), [
    (("transformer_layer_config", "hidden_size"), 128, "hidden size 128, where"),
    (("transformer_layer_config", "vocab_size"), 1000, "vocabulary 1000, where"),
    (("eagle_aux_hidden_state_layer_ids",), [1, 3, 6], "aux layers [1, 3, 6], where"),
])
def test_a_draft_of_another_target_is_refused_in_one_line_naming_the_mismatch(
        drafts: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: tuple[str, ...],
        value: Any, named: str) -> None:
    other = tmp_path / "other"
    shutil.copytree(drafts["untrained"], other)
    config = json.loads((other / "config.json").read_text())
    *parents, key = setting
    node = config
    for parent in parents:
        node = node[parent]
    node[key] = value
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftRefused, match="built for another target"):
        evaluate_draft(drafts["run"], str(other))
    assert main(["evaluate", drafts["run"], "--draft", str(other)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and named in error and "this run's target" in error


def test_a_run_without_a_held_out_split_says_how_to_get_one(drafts: dict[str, Any], tmp_path: Path) -> None:
    store = tiny_run(tmp_path, drafts["target"], held_out=set())
    with pytest.raises(NothingToEvaluate, match=r"has no held-out samples.*data.holdout above 0"):
        evaluate_draft(store.uri, drafts["trained"])


@pytest.mark.usefixtures("prefect_api")
def test_the_evaluate_flow_leaves_its_table_and_plot_in_the_ui(drafts: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from eagle3_datagen.artifacts import ui_key
    from flows.pipeline import evaluate

    summary = evaluate(drafts["run"], drafts["trained"])
    key = ui_key("run", f"evaluation-{summary['name']}")

    async def artifacts() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    import asyncio

    [artifact] = asyncio.run(artifacts())
    assert "| group | value | samples | tokens | acc@1 | acc@2 | acc@3 | τ |" in artifact.data
    assert "data:image/png;base64," in artifact.data
    assert f"{summary['acceptance_length']:.3f}" in artifact.data
