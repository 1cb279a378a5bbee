"""Training straight from a run: what `TrainingReader` costs beside reading the parts, and what `export` costs instead.

On a run written by the extraction stage's own part writer (random bf16 states, log-normal sample lengths), it
prints, measured in one run so the machine's noise cancels out:
  - the floor: every part read whole and checked (`read_part`), in MiB/s;
  - TrainingReader for speculators and for SpecForge (its final norm and bf16 copies), in the main process and in
    2 DataLoader workers: samples/s, tokens/s, MiB/s of parts, and the ratio to the floor;
  - `export` of the same run (SpecForge files): seconds and bytes written, which training from the run skips.

Usage:

    .venv/bin/python benchmarks/training_reader_throughput.py [--tokens 32000] [--hidden 1024] [--part-mib 32]
"""

from __future__ import annotations

import argparse
import io
import random
import tempfile
import time
from collections.abc import Generator, Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

from eagle3_datagen.artifacts import MANIFEST, artifact_path
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.hidden_state_format import Sample, read_part
from eagle3_datagen.storage import RunStore
from eagle3_datagen.training_reader import TrainingReader
from tasks.export import export_run
from tasks.hidden_states.parts import TokenSequence, write_shard
from tasks.hidden_states.targets import TargetInfo

MIB = 1 << 20


def write_run(root: str, tokens: int, hidden: int, part_mib: int, shards: int = 4) -> RunStore:
    """A completed run of `shards` shards, about `tokens` tokens in all, packed by the extraction stage's writer."""
    rng = random.Random(0)
    store = RunStore(root, "run")
    store.write_json(MANIFEST, {"config": {"hidden_states": {"backend": "transformers"}}, "status": "running"})
    target = TargetInfo("random", 8, hidden, 32000, "random", torch.ones(hidden), 1e-6)
    states = torch.Generator().manual_seed(0)
    for shard in range(shards):
        lengths: list[int] = []
        while sum(lengths) < tokens // shards:
            lengths.append(max(32, min(2048, int(rng.lognormvariate(5.7, 0.6)))))
        table = pa.table({
            "id": [f"{shard}-{k}" for k in range(len(lengths))],
            "input_ids": pa.array([[rng.randrange(32000) for _ in range(n)] for n in lengths], pa.list_(pa.int32())),
            "loss_mask": pa.array([[1] * n for n in lengths], pa.list_(pa.int8())),
        })
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        ref = store.write_shard_bytes("sequences", shard, buffer.getvalue(), len(lengths))

        def samples(sequences: list[TokenSequence], aux_layers: list[int]) -> Generator[Sample, None, None]:
            for seq in sequences:
                n = len(seq.input_ids)
                aux = torch.randn(n, 3 * hidden, generator=states, dtype=torch.bfloat16)
                final = torch.randn(n, hidden, generator=states, dtype=torch.bfloat16)
                yield Sample(seq.id, seq.input_ids, seq.loss_mask, aux, final)

        write_shard(store, ref, target, HiddenStatesConfig(part_size_bytes=part_mib * MIB), samples)
    store.write_json(MANIFEST, {"config": {"hidden_states": {"backend": "transformers"}}, "status": "completed",
                                "shards": {f"shard-{n:05d}": {} for n in range(shards)}})
    return store


def timed(samples: Iterable[dict[str, torch.Tensor]]) -> tuple[float, float, int, int]:
    """Seconds to the first sample (workers starting, the first part read), then seconds, samples and tokens
    after it: the steady rate an epoch of hours sees."""
    start = time.perf_counter()
    stream = iter(samples)
    next(stream)
    first = time.perf_counter()
    count, tokens = 0, 0
    for sample in stream:
        count += 1
        tokens += sample["input_ids"].numel()
    return first - start, time.perf_counter() - first, count, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--part-mib", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="eagle3-reader-bench-") as root:
        store = write_run(root, args.tokens, args.hidden, args.part_mib)
        indexes = [artifact_path("hidden_states", n) for n in range(4)]
        parts = [(rel, part) for rel in indexes for part in store.read_json(rel)["parts"]]
        part_bytes = sum(part["bytes"] for _, part in parts)
        start = time.perf_counter()
        for rel, part in parts:
            read_part(store, rel, part)
        floor = part_bytes / MIB / (time.perf_counter() - start)
        bytes_per_token = part_bytes / sum(part["num_tokens"] for _, part in parts)
        print(f"run: {len(parts)} parts, {part_bytes / MIB:.0f} MiB, hidden {args.hidden}, bf16")
        print(f"read_part (read, sha256, decode): {floor:.0f} MiB/s")
        for trainer in ("speculators", "specforge"):
            for workers in (0, 2):
                reader = TrainingReader(store.uri, trainer, max_len=4096)
                loader = DataLoader(reader, batch_size=None, num_workers=workers, in_order=False)
                first, seconds, samples, tokens = timed(loader)
                rate = tokens * bytes_per_token / MIB / seconds
                print(f"TrainingReader {trainer:11s} workers={workers}: first sample {first:4.2f} s, then "
                      f"{samples / seconds:6.1f} samples/s {tokens / seconds:7.0f} tokens/s {rate:5.0f} MiB/s of "
                      f"parts ({rate / floor:.2f} x read_part)")
        start = time.perf_counter()
        export_run(store.uri, "specforge")
        seconds = time.perf_counter() - start
        written = sum(f.stat().st_size for f in Path(store.uri, "exports").rglob("*") if f.is_file())
        print(f"export specforge: {seconds:.1f} s, {written / MIB:.0f} MiB written (skipped by training from the run)")


if __name__ == "__main__":
    main()
