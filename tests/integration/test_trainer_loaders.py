"""The exports read by the trainers' own, unmodified code: SpecForge's offline EAGLE-3 dataset, speculators'
ArrowDataset, draft-vocabulary mapping and one EAGLE-3 training step of its draft (installed without their
GPU-only dependencies by `make setup`; their fused GPU losses swapped for their eager ones)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_export import make_run, model_dir  # noqa: F401  (model_dir: the fixture make_run's target needs)

from eagle3_datagen.storage import RunStore
from tasks.export import export_run
from tasks.hidden_states.transformers_backend import load_target_model

TRAINERS = Path(os.environ.get("EAGLE3_TRAINERS", Path(__file__).resolve().parents[2] / "build" / "trainers"))


@pytest.fixture(scope="module", autouse=True)
def trainers_importable() -> Iterator[None]:
    if not TRAINERS.is_dir():
        pytest.skip(f"the trainers are not installed in {TRAINERS} (`make setup` installs them)")
    sys.path.insert(0, str(TRAINERS))
    try:
        yield
    finally:
        sys.path.remove(str(TRAINERS))


def test_specforge_reads_the_export_in_sample_order_as_bf16_features(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    preprocessing = pytest.importorskip("specforge.data.preprocessing", reason="SpecForge does not import here")
    # 12 samples of lengths 5, 6, ..., 16: past data_9 a plain number sorts data_10 before data_2
    shards = {0: list(range(5, 11)), 1: list(range(11, 17))}
    make_run(str(tmp_path), load_target_model(model_dir, "float32", "cpu"), shards, dtype="float32")
    export_run(str(tmp_path / "run"), "specforge")
    out = tmp_path / "run" / "exports" / "specforge"
    ids = RunStore.at(str(out)).read_json("export.json")["samples"]
    dataset = preprocessing.build_offline_eagle3_dataset(str(out), max_len=64)
    assert len(dataset) == len(ids) == 12
    for i, sample_id in enumerate(ids):
        item = dataset[i]  # SpecForge's own listing, load and process_data
        shard, k = map(int, sample_id.split("-"))
        assert item["input_ids"].shape == (1, shards[shard][k]), f"SpecForge's sample {i} is export.json's {i}"
        assert item["hidden_state"].dtype == item["target"].dtype == torch.bfloat16
        assert item["hidden_state"].shape[-1] == 3 * item["target"].shape[-1]


def _speculators_export(target_dir: str, tmp_path: Path) -> tuple[Path, Any]:
    """A run's speculators export and speculators' own ArrowDataset over it."""
    data = pytest.importorskip("speculators.train.data", reason="speculators does not import here")
    make_run(str(tmp_path), load_target_model(target_dir, "bfloat16", "cpu"))
    out = tmp_path / "speculators"
    export_run(str(tmp_path / "run"), "speculators", str(out))
    return out, data.ArrowDataset(max_len=128, datapath=str(out), on_missing="raise")


def test_speculators_pairs_every_row_and_builds_its_draft_vocabulary(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    vocab = pytest.importorskip("speculators.train.vocab_mapping", reason="speculators does not import here")
    out, dataset = _speculators_export(model_dir, tmp_path)
    assert len(dataset) == 9
    for i in range(len(dataset)):
        item = dataset[i]  # a SampleUnavailable here would be a row whose token ids do not pair with its file
        assert isinstance(item, dict), item
        tokens = item["input_ids"].shape[0]
        assert item["hidden_states"].shape == (tokens, 3 * item["verifier_last_hidden_states"].shape[-1])
    frequencies = torch.load(out / "token_freq.pt", weights_only=True)
    draft_to_target, target_to_draft = vocab.build_vocab_mappings_from_distribution(frequencies, 16, 512)
    most_frequent = sorted(frequencies, key=lambda t: (-frequencies[t], t))[:16]
    assert draft_to_target.shape == (16,) and int(target_to_draft.sum()) == 16
    assert all(target_to_draft[t] for t in most_frequent), "the draft vocabulary is the most frequent targets"


def test_one_speculators_eagle3_training_step_on_the_export(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """speculators' own collate, draft model and (eager, CPU) loss on a batch of the export: a finite loss whose
    gradient reaches the draft's layers."""
    data = pytest.importorskip("speculators.train.data", reason="speculators does not import here")
    eagle3_data = pytest.importorskip("speculators.models.eagle3.data", reason="speculators does not import here")
    eagle3 = pytest.importorskip("speculators.models.eagle3.core", reason="speculators does not import here")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoModelForCausalLM, LlamaConfig

    out, dataset = _speculators_export(model_dir, tmp_path)
    collate = data.CollateFn(max_len=128, hidden_size=64, dtype=torch.float32, preprocess=eagle3_data.shift_batch)
    batch = {k: v for k, v in collate([dataset[i] for i in range(3)]).items() if isinstance(v, torch.Tensor)}
    assert batch["hidden_states"].shape == (1, 128, 3 * 64)
    assert batch["verifier_last_hidden_states"].shape == (1, 128, 64)

    d2t, t2d = build_vocab_mappings_from_distribution(torch.load(out / "token_freq.pt", weights_only=True), 32, 512)
    layer = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)
    layer._attn_implementation = "eager"  # flex attention needs a GPU
    proposal = GreedyTokenProposalConfig(speculative_tokens=2)
    config = Eagle3SpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=32, speculators_config=(
        SpeculatorsConfig(algorithm="eagle3", proposal_methods=[proposal], default_proposal_method="greedy",
                          verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]))))
    draft = eagle3.Eagle3DraftModel(config)
    target = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # what speculators takes from the verifier's checkpoint
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(d2t)
        kept = torch.arange(32) + d2t
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.verifier_lm_head.weight.copy_(target.lm_head.weight[kept])
        draft.lm_head.weight.copy_(target.lm_head.weight[kept])
        draft.verifier_norm.weight.copy_(target.model.norm.weight)
    draft.train()
    _, loss, _ = draft(**batch, ttt_steps=2, loss_config=resolve_loss_config("kl_div", "eager"))
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert draft.fc.weight.grad is not None and torch.isfinite(draft.fc.weight.grad).all()
