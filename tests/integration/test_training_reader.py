"""Training straight from a run: shards packed by the real part writer, read by `TrainingReader` alone, in real
DataLoader workers, and while a writer thread is still adding shards (the trainers' own steps on its samples are in
test_trainer_loaders.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from pathlib import Path

import pytest
import torch
from hidden_state_targets import HIDDEN, LAYERS, random_rows, write_sequences
from torch.utils.data import DataLoader

from eagle3_datagen.artifacts import MANIFEST
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.hidden_state_format import HiddenStatesError, Sample
from eagle3_datagen.storage import RunStore
from eagle3_datagen.training_reader import PartialRunWarning, RunEndedShort, RunNotReadable, TrainingReader
from tasks.hidden_states.parts import TokenSequence, write_shard
from tasks.hidden_states.targets import TargetInfo

torch.set_num_threads(1)

# 3 shards of 2 to 4 parts each (a part closes past 4 KiB: about 6 tokens of bf16 states)
SHARDS = {0: [7, 3, 12, 5, 9], 1: [4, 8, 6], 2: [10, 2, 6, 11]}
TARGET = TargetInfo(path="random", num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=512, fingerprint="random",
                    norm_weight=torch.linspace(0.5, 1.5, HIDDEN), norm_eps=1e-6)
Key = tuple[int, ...]


def write_hidden_shard(store: RunStore, shard: int, lengths: list[int], compression: str = "none") -> None:
    """One shard's sequences and hidden states (seeded random states), packed by the extraction stage's writer."""
    rows = [(f"{shard}-{k}", *row[1:]) for k, row in enumerate(random_rows(lengths, seed=shard))]
    sequences_ref = write_sequences(store, shard, rows)
    states = torch.Generator().manual_seed(shard)

    def samples(sequences: list[TokenSequence], aux_layers: list[int]) -> Generator[Sample, None, None]:
        for seq in sequences:
            tokens = len(seq.input_ids)
            aux = torch.randn(tokens, 3 * HIDDEN, generator=states).to(torch.bfloat16)
            final = torch.randn(tokens, HIDDEN, generator=states).to(torch.bfloat16)
            yield Sample(seq.id, seq.input_ids, seq.loss_mask, aux, final)

    settings = HiddenStatesConfig(part_size_bytes=4096, compression=compression)
    write_shard(store, sequences_ref, TARGET, settings, samples)


def write_manifest(store: RunStore, status: str, cause: str | None = None) -> None:
    store.write_json(MANIFEST, {"config": {"hidden_states": {"backend": "transformers"}}, "status": status,
                                **({"cause": cause} if cause else {})})


def make_run(root: Path, shards: dict[int, list[int]] = SHARDS, status: str = "completed",
             compression: str = "none") -> str:
    store = RunStore(str(root), "run")
    write_manifest(store, "running")
    for shard, lengths in shards.items():
        write_hidden_shard(store, shard, lengths, compression)
    write_manifest(store, status)
    return store.uri


def key(sample: dict[str, torch.Tensor]) -> Key:
    """A sample by its tokens (random, so distinct)."""
    return tuple(sample["input_ids"].flatten().tolist())


def all_keys(shards: dict[int, list[int]] = SHARDS) -> list[Key]:
    return sorted(tuple(row[1]) for shard, lengths in shards.items() for row in random_rows(lengths, seed=shard))


def test_every_sample_once_shuffled_across_parts_by_seed_and_epoch(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    assert len(RunStore.at(run).read_json("hidden_states/shard-00000/index.json")["parts"]) >= 2

    def order(seed: int, epoch: int = 0) -> list[Key]:
        reader = TrainingReader(run, "speculators", seed=seed)
        reader.set_epoch(epoch)
        return [key(sample) for sample in reader]

    first = order(seed=1)
    assert sorted(first) == all_keys()
    assert order(seed=1) == first, "the same seed and epoch give the same order"
    assert order(seed=2) != first and order(seed=1, epoch=1) != first
    shard_of = {key: shard for shard in SHARDS for key in all_keys({shard: SHARDS[shard]})}
    assert [shard_of[k] for k in first] != sorted(shard_of[k] for k in first), "shards are interleaved"


@pytest.mark.parametrize("trainer", ["specforge", "speculators"])
def test_a_compressed_run_reads_as_the_same_samples(tmp_path: Path, trainer: str) -> None:
    """zstd is lossless: the trainer sees the uncompressed run's samples, bit for bit, in the same order."""
    plain = list(TrainingReader(make_run(tmp_path / "none"), trainer, seed=3))  # type: ignore[arg-type]
    zstd_run = make_run(tmp_path / "zstd", compression="zstd")
    assert RunStore.at(zstd_run).read_json("hidden_states/shard-00000/index.json")["compression"] == "zstd"
    packed = list(TrainingReader(zstd_run, trainer, seed=3))  # type: ignore[arg-type]
    assert len(packed) == len(plain) == len(all_keys())
    for ours, theirs in zip(packed, plain, strict=True):
        assert ours.keys() == theirs.keys()
        assert all(ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]) for name in ours)


def test_dataloader_workers_and_ranks_share_out_every_sample_exactly_once(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    seen: list[Key] = []
    for rank in range(2):
        reader = TrainingReader(run, "speculators", seed=5, rank=rank, world_size=2)
        loader = DataLoader(reader, batch_size=None, num_workers=2)
        mine = [key(sample) for sample in loader]
        assert mine, f"rank {rank} got parts"
        seen += mine
    assert sorted(seen) == all_keys(), "no sample twice, none missing"

    def rank_zero(epoch: int) -> list[Key]:
        reader = TrainingReader(run, "speculators", seed=5, rank=0, world_size=2)
        reader.set_epoch(epoch)
        return sorted(key(sample) for sample in reader)

    assert len({tuple(rank_zero(epoch)) for epoch in range(4)}) > 1, "the split moves between epochs"


@pytest.fixture(params=["local", "s3"])
def output_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path)
    request.getfixturevalue("s3_endpoint")
    return f"s3://eagle3-test/{tmp_path.name}"


def test_follow_picks_up_shards_as_they_finish_and_ends_with_the_run(output_uri: str) -> None:
    """The workers read while this process writes: on S3 each has its own client, whose listing cache must not
    hide the shards written since it last looked."""
    store = RunStore(output_uri, "run")
    write_manifest(store, "running")
    write_hidden_shard(store, 0, SHARDS[0])
    reader = TrainingReader(store.uri, "speculators", follow=True, poll_interval_s=0.05)
    # in_order=False: a worker waiting for shards must not hold back samples another worker has
    loader = iter(DataLoader(reader, batch_size=None, num_workers=2, in_order=False, timeout=60))
    got = [key(next(loader)) for _ in SHARDS[0]]
    assert sorted(got) == all_keys({0: SHARDS[0]})

    def write_the_rest() -> None:
        time.sleep(0.5)  # the workers poll an unfinished run meanwhile
        for shard in (1, 2):
            write_hidden_shard(store, shard, SHARDS[shard])
        write_manifest(store, "completed")

    writer = threading.Thread(target=write_the_rest)
    writer.start()
    got += [key(sample) for sample in loader]  # ends once the manifest says completed
    writer.join()
    assert sorted(got) == all_keys()


def test_a_run_that_ends_failed_stops_the_reader_saying_why(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    write_manifest(store, "running")
    write_hidden_shard(store, 0, SHARDS[0])
    reader = TrainingReader(store.uri, "speculators", follow=True, poll_interval_s=0.05)
    samples = iter(reader)
    assert len([next(samples) for _ in SHARDS[0]]) == len(SHARDS[0])
    write_manifest(store, "failed", "1 of 2 shards did not finish (shard-00001)")
    with pytest.raises(RunEndedShort, match=r"ended failed \(1 of 2 shards did not finish .*allow_partial=True"):
        next(samples)

    with pytest.raises(RunEndedShort):  # without follow it says so before the first sample
        next(iter(TrainingReader(store.uri, "speculators")))
    with pytest.warns(PartialRunWarning, match="ended failed"):
        assert len(list(TrainingReader(store.uri, "speculators", allow_partial=True))) == len(SHARDS[0])


def test_a_running_run_is_read_only_when_asked_how(tmp_path: Path) -> None:
    run = make_run(tmp_path, {0: SHARDS[0]}, status="running")
    with pytest.raises(RunNotReadable, match="still running: pass follow=True"):
        list(TrainingReader(run, "specforge"))
    with pytest.warns(PartialRunWarning, match="finished now only"):
        assert len(list(TrainingReader(run, "specforge", allow_partial=True))) == len(SHARDS[0])
    with pytest.raises(RunNotReadable, match=r"has no manifest\.json"):
        list(TrainingReader(str(tmp_path / "elsewhere"), "specforge"))


def test_a_changed_part_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, {0: SHARDS[0]})
    part = Path(run) / "hidden_states" / "shard-00000" / "part-00001.safetensors"
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(HiddenStatesError, match=r"part-00001\.safetensors does not match its checksum"):
        list(TrainingReader(run, "speculators"))


def test_specforge_samples_are_cut_to_max_len_after_the_final_norm(tmp_path: Path) -> None:
    run = make_run(tmp_path, {0: SHARDS[0]})
    samples = list(TrainingReader(run, "specforge", max_len=8))
    assert sorted(s["input_ids"].shape[1] for s in samples) == sorted(min(n, 8) for n in SHARDS[0])
    for sample in samples:
        tokens = sample["input_ids"].shape[1]
        assert sample["hidden_state"].shape == (1, tokens, 3 * HIDDEN) and sample["target"].shape == (1, tokens, HIDDEN)
        assert sample["hidden_state"].dtype == sample["target"].dtype == torch.bfloat16
        assert sample["loss_mask"][0, -1] == 0 and sample["attention_mask"].all()
        rms = sample["target"][0].float().div(TARGET.norm_weight).pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones(tokens), atol=0.02), "the state after the final norm"
