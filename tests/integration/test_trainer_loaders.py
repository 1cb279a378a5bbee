"""The exports read by the trainers' own, unmodified loaders: SpecForge's offline EAGLE-3 dataset and speculators'
ArrowDataset and draft-vocabulary mapping (installed without their GPU-only dependencies by `make setup`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

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


def test_speculators_pairs_every_row_and_builds_its_draft_vocabulary(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    data = pytest.importorskip("speculators.train.data", reason="speculators does not import here")
    vocab = pytest.importorskip("speculators.train.vocab_mapping", reason="speculators does not import here")
    make_run(str(tmp_path), load_target_model(model_dir, "bfloat16", "cpu"))
    out = tmp_path / "speculators"
    export_run(str(tmp_path / "run"), "speculators", str(out))
    dataset = data.ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")
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
