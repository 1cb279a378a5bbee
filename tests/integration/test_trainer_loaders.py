"""The exports read by the trainers' own, unmodified code: SpecForge's offline EAGLE-3 dataset, speculators'
ArrowDataset, draft-vocabulary mapping and one EAGLE-3 training step of each trainer's draft; and TrainingReader's
samples of the same run equal to what their loaders make of the export, batch and loss included (installed without
their GPU-only dependencies by `make setup`; their fused GPU losses swapped for their eager ones)."""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from test_export import make_run, model_dir  # noqa: F401  (model_dir: the fixture make_run's target needs)

from eagle3_datagen.storage import RunStore
from eagle3_datagen.training_reader import TrainingReader
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
    out, dataset = _speculators_export(model_dir, tmp_path)
    batch = _speculators_batch([dataset[i] for i in range(3)])
    assert batch["hidden_states"].shape == (1, 128, 3 * 64)
    assert batch["verifier_last_hidden_states"].shape == (1, 128, 64)
    draft = _speculators_draft(model_dir, out)
    loss = _speculators_step(draft, batch)
    assert torch.isfinite(loss) and loss > 0
    assert draft.fc.weight.grad is not None and torch.isfinite(draft.fc.weight.grad).all()


def test_speculators_batch_and_step_are_the_same_from_the_run_as_from_its_export(
        model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """TrainingReader's samples equal speculators' ArrowDataset items over the export, key by key; so do their
    batches through speculators' collate, and one training step's loss."""
    out, dataset = _speculators_export(model_dir, tmp_path)
    theirs = {_tokens(item): item for item in (dataset[i] for i in range(len(dataset)))}
    ours = list(TrainingReader(str(tmp_path / "run"), "speculators", seed=7))
    assert len(ours) == len(theirs) == 9
    for sample in ours:
        _assert_same(sample, theirs[_tokens(sample)])
    batches = [_speculators_batch(samples) for samples in (ours[:3], [theirs[_tokens(s)] for s in ours[:3]])]
    _assert_same(*batches)
    draft = _speculators_draft(model_dir, out)
    losses = [_speculators_step(draft, batch) for batch in batches]
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])


def test_specforge_batch_and_step_are_the_same_from_the_run_as_from_its_export(
        model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """TrainingReader's samples equal SpecForge's own normalizer over the exported feature files (cut to max_len,
    after the final norm, bf16), key by key; so do their batches through its collator, and the loss of one step of
    its EAGLE-3 draft through its own training strategy and frozen target head."""
    eagle3 = _SpecForgeEagle3()
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    # a float32 run (the export and the reader both make bf16 of it), two samples longer than max_len
    make_run(str(tmp_path), load_target_model(model_dir, "float32", "cpu"), {0: [5, 40, 9], 1: [33, 7, 12]},
             dtype="float32")
    export_run(str(tmp_path / "run"), "specforge")
    normalize = build_offline_normalizer(16)
    files = list_feature_files(str(tmp_path / "run" / "exports" / "specforge"))
    theirs = {_tokens(item): item for item in (normalize(load_feature_file(file)) for file in files)}
    ours = list(TrainingReader(str(tmp_path / "run"), "specforge", max_len=16, seed=7))
    assert len(ours) == len(theirs) == 6 and max(s["input_ids"].shape[1] for s in ours) == 16
    for sample in ours:
        _assert_same(sample, theirs[_tokens(sample)])
    collate = build_offline_collator()
    batches = [collate(samples) for samples in (ours[:3], [theirs[_tokens(s)] for s in ours[:3]])]
    _assert_same(*batches)
    losses = [eagle3.step(model_dir, batch) for batch in batches]
    assert torch.isfinite(losses[0]) and losses[0] > 0 and torch.equal(losses[0], losses[1])


def _tokens(sample: dict[str, Any]) -> tuple[int, ...]:
    """A sample by its tokens (random, so distinct): the reader's order is shuffled, the export's is not."""
    return tuple(sample["input_ids"].flatten().tolist())


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The same keys in the same order; tensors equal in shape, dtype and every element; anything else equal."""
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == ours[name].dtype and torch.equal(value, ours[name]), name
        else:
            assert ours[name] == value, name


def _speculators_batch(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """speculators' own collate (packing into one row of 128 tokens, its shift for EAGLE-3)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    return CollateFn(max_len=128, hidden_size=64, dtype=torch.float32, preprocess=shift_batch)(samples)


def _speculators_draft(target_dir: str, export: Path) -> Any:
    """speculators' EAGLE-3 draft with a tiny config, its vocabulary from the export, the rest from the target."""
    eagle3 = pytest.importorskip("speculators.models.eagle3.core", reason="speculators does not import here")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoModelForCausalLM, LlamaConfig

    frequencies = torch.load(export / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(frequencies, 32, 512)
    layer = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)
    layer._attn_implementation = "eager"  # flex attention needs a GPU
    proposal = GreedyTokenProposalConfig(speculative_tokens=2)
    config = Eagle3SpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=32, speculators_config=(
        SpeculatorsConfig(algorithm="eagle3", proposal_methods=[proposal], default_proposal_method="greedy",
                          verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]))))
    draft = eagle3.Eagle3DraftModel(config)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    with torch.no_grad():  # what speculators takes from the verifier's checkpoint
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(d2t)
        kept = torch.arange(32) + d2t
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.verifier_lm_head.weight.copy_(target.lm_head.weight[kept])
        draft.lm_head.weight.copy_(target.lm_head.weight[kept])
        draft.verifier_norm.weight.copy_(target.model.norm.weight)
    return draft.train()


def _speculators_step(draft: Any, batch: dict[str, Any]) -> torch.Tensor:
    """One EAGLE-3 training step's loss (its eager CPU loss), back-propagated."""
    from speculators.losses.utils import resolve_loss_config

    draft.zero_grad()
    tensors = {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}
    _, loss, _ = draft(**tensors, ttt_steps=2, loss_config=resolve_loss_config("kl_div", "eager"))
    loss.backward()
    return loss.detach()


class _SpecForgeEagle3:
    """SpecForge's EAGLE-3 training on CPU: its draft, its `OnlineEagle3Model` under its `Eagle3TrainStrategy`,
    its frozen `TargetHead` in bf16 (as `TargetHead.from_pretrained` leaves it), with its reference loss.

    Its fused loss is a Triton kernel (GPU only) in a module that imports triton first thing; that module is
    imported with a stand-in triton and an identity torch.compile (nothing of either runs), then its reference
    `_compute_loss` replaces the fused `LogSoftmaxLoss` in the model. The step runs with dynamo off: the same
    functions, eagerly.
    """

    def __init__(self) -> None:
        import importlib

        pytest.importorskip("specforge.core", reason="SpecForge does not import here")
        triton, language = types.ModuleType("triton"), types.ModuleType("triton.language")
        triton.jit, language.constexpr, triton.language = (lambda kernel: kernel), object, language  # type: ignore[attr-defined]
        with mock.patch.dict(sys.modules, {"triton": triton, "triton.language": language}), \
                mock.patch.object(torch, "compile", lambda **_: lambda function: function):
            loss = importlib.import_module("specforge.core.loss")
        sys.modules["specforge.core.loss"] = loss  # patch.dict forgot it with the stand-in
        self.model = importlib.import_module("specforge.algorithms.eagle3.model")
        self.reference_loss = loss._compute_loss

    def step(self, target_dir: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One training step's loss on `batch` (a fresh draft, seeded, each time), back-propagated."""
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.modeling.target.target_head import TargetHead
        from specforge.runtime.contracts import TrainBatch
        from specforge.training.strategies.base import Eagle3TrainStrategy
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=512, draft_vocab_size=512,
                             max_position_embeddings=256)
        torch.manual_seed(0)
        draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa").to(torch.bfloat16)
        head = TargetHead(target_dir)
        with torch.no_grad():
            head.fc.weight.copy_(AutoModelForCausalLM.from_pretrained(target_dir).lm_head.weight)
        head.freeze_weights()
        strategy = Eagle3TrainStrategy(self.model.OnlineEagle3Model(draft, length=2, attention_backend="sdpa"),
                                       target_head=head.eval().to(torch.bfloat16))
        # eager: its torch.compile'd norms and rotary embedding would build C++ kernels (and headers in /tmp)
        with mock.patch.object(self.model, "LogSoftmaxLoss", mock.Mock(apply=self.reference_loss)), \
                mock.patch.object(torch._dynamo.config, "disable", True):
            output = strategy.forward_loss(TrainBatch(sample_ids=[], strategy="eagle3", tensors=batch,
                                                      metadata={"target_repr": "hidden_state"}))
        output.loss.backward()
        assert draft.fc.weight.grad is not None and torch.isfinite(draft.fc.weight.grad).all()
        return output.loss.detach()
