"""The trainers' own loaders over a run's exports, for the end-to-end tests that produce one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TRAINERS = Path(__file__).resolve().parents[1] / "build" / "trainers"


def assert_the_trainers_read_every_sample(run: Path, samples: int) -> None:
    """speculators' ArrowDataset and SpecForge's offline dataset hold `samples` items over the run's exports (made
    with `export_run`); skips where the trainers are not installed (`make setup` installs them)."""
    if not TRAINERS.is_dir():
        pytest.skip(f"the trainers are not installed in {TRAINERS} (`make setup` installs them)")
    sys.path.insert(0, str(TRAINERS))
    try:
        speculators = pytest.importorskip("speculators.train.data").ArrowDataset(
            max_len=4096, datapath=str(run / "exports" / "speculators"), on_missing="raise")
        assert len(speculators) == samples and all(isinstance(speculators[i], dict) for i in range(samples))
        specforge = pytest.importorskip("specforge.data.preprocessing").build_offline_eagle3_dataset(
            str(run / "exports" / "specforge"), max_len=4096)
        assert len(specforge) == samples and specforge[samples - 1]["input_ids"].shape[-1] > 0
    finally:
        sys.path.remove(str(TRAINERS))
