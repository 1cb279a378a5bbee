"""Hidden-state extraction (transformers backend): what capture, copy and write cost beside the forward pass.

For each model it prints, measured in one run so the machine's noise cancels out:
  - tokens/s of the whole stage (`extract_shard`: read the sequences, forward with hooks, check, copy, pack and
    write parts with checksums, write the index) and of the bare forward pass on the same batches (same plan,
    same padding, no hooks, nothing kept), and their ratio (target >= 0.85);
  - bytes per token written against the 4 x H x (dtype size) lower bound (4 x H x 2 in bf16);
  - peak RSS of a fresh process extracting shards of growing size with a fixed part size, beside its RSS once the
    model and the sequences are loaded and the peak of the bare forward pass over the same shard (the batch's own
    activations): the stage's peak must stay near the forward's plus one part, whatever the shard size.

Models: the repo's tiny model ($EAGLE3_TINY_MODEL, built by `make setup`) and a random Qwen3 with hidden 1024
and 8 layers, saved to a temporary folder. Usage:

    .venv/bin/python benchmarks/hidden_states_throughput.py [--tokens 16000] [--repeats 3] [--dtype float32]
        [--rss-shards 32,128,384] [--rss-part-mib 16]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3_datagen.artifacts import ShardRef, artifact_path
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.storage import RunStore
from tasks.hidden_states.batching import plan_batches
from tasks.hidden_states.parts import read_sequences
from tasks.hidden_states.transformers_backend import TargetModel, extract_shard, load_target_model


def sequence_lengths(total_tokens: int | None = None, samples: int | None = None, seed: int = 0) -> list[int]:
    """Reasoning traces: log-normal lengths around 300 tokens, 32 to 2048; until a token total or a sample count."""
    rng, lengths, tokens = random.Random(seed), [], 0
    while (total_tokens is not None and tokens < total_tokens) or (samples is not None and len(lengths) < samples):
        lengths.append(max(32, min(2048, int(rng.lognormvariate(5.7, 0.6)))))
        tokens += lengths[-1]
    return lengths


def write_sequences(store: RunStore, lengths: list[int], vocab_size: int, seed: int = 0) -> ShardRef:
    """A sequences shard with the stage's schema, and the reference the extraction stage reads it by."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab_size, (n,), generator=gen, dtype=torch.int32).tolist() for n in lengths]
    table = pa.table({
        "id": pa.array([f"s{i}" for i in range(len(lengths))]),
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "loss_mask": pa.array([[0] * (n // 3) + [1] * (n - n // 3) for n in lengths], pa.list_(pa.int8())),
    })
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return store.write_shard_bytes("sequences", 0, buffer.getvalue(), len(lengths))


def bare_forward(target: TargetModel, store: RunStore, shard: ShardRef, settings: HiddenStatesConfig) -> None:
    """The stage's batches through the model and nothing else: the floor the stage is measured against."""
    sequences = read_sequences(store, shard, target.vocab_size)
    for batch in plan_batches([len(s.input_ids) for s in sequences], settings.max_tokens_per_batch):
        longest = max(len(sequences[i].input_ids) for i in batch)
        input_ids = torch.zeros((len(batch), longest), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, i in enumerate(batch):
            input_ids[row, : len(sequences[i].input_ids)] = sequences[i].input_ids
            attention_mask[row, : len(sequences[i].input_ids)] = 1
        with torch.inference_mode():
            target.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


def timed(work) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def random_model(folder: Path, hidden: int, layers: int) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512), head_dim=128, intermediate_size=hidden * 3, vocab_size=32000,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def throughput(model: str, tokens: int, repeats: int, settings: HiddenStatesConfig) -> dict[str, float]:
    target = load_target_model(model, settings.dtype, settings.device_map)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp:
        store = RunStore(tmp, "run")
        lengths = sequence_lengths(tokens)
        shard = write_sequences(store, lengths, target.vocab_size)
        bare_forward(target, store, shard, settings)  # warm-up: allocator, kernels, page cache
        stage_s, bare_s = [], []
        for _ in range(repeats):  # interleaved, so a slow phase of the machine hits both
            bare_s.append(timed(lambda: bare_forward(target, store, shard, settings)))
            stage_s.append(timed(lambda: extract_shard(store, shard, target, settings)))
        index = store.read_json(artifact_path("hidden_states", 0))
    total = sum(lengths)
    written = sum(part["bytes"] for part in index["parts"])
    stage, bare = statistics.median(stage_s), statistics.median(bare_s)
    return {
        "hidden": target.hidden_size,
        "layers": target.num_layers,
        "samples": len(lengths),
        "tokens": total,
        "stage tok/s": total / stage,
        "bare forward tok/s": total / bare,
        "ratio": bare / stage,
        "bytes/token": written / total,
        "states lower bound": 4 * target.hidden_size * target.dtype.itemsize,
    }


def memory_mib() -> dict[str, float]:
    """This process's resident set now and its high-water mark, from /proc (Linux)."""
    status = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) / 1024 for key in ("VmRSS", "VmHWM")}


def child_peak_rss(model: str, samples: int, settings: HiddenStatesConfig, stage: bool) -> None:
    """Run in a fresh process: RSS once the model and sequences are loaded, then the peak over one shard, through
    the whole stage or (stage=False) the bare forward pass, whose peak is the batch's own activations."""
    target = load_target_model(model, settings.dtype, settings.device_map)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp:
        store = RunStore(tmp, "run")
        shard = write_sequences(store, sequence_lengths(samples=samples, seed=1), target.vocab_size)
        loaded = memory_mib()["VmRSS"]
        Path("/proc/self/clear_refs").write_text("5")  # restart the high-water mark from here
        if not stage:
            bare_forward(target, store, shard, settings)
            print(json.dumps({"peak_mib": memory_mib()["VmHWM"]}))
            return
        index = extract_shard(store, shard, target, settings)
        peak = memory_mib()["VmHWM"]
    print(json.dumps({"loaded_mib": loaded, "peak_mib": peak, "tokens": index["num_tokens"],
                      "bytes": sum(part["bytes"] for part in index["parts"]), "parts": len(index["parts"])}))


def peak_rss(model: str, samples: int, settings: HiddenStatesConfig, stage: bool) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, __file__, "--child", model, str(samples), settings.model_dump_json(), str(int(stage))],
        check=True, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_peak_rss(sys.argv[2], int(sys.argv[3]), HiddenStatesConfig.model_validate_json(sys.argv[4]),
                       sys.argv[5] == "1")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-model", default=os.environ.get("EAGLE3_TINY_MODEL", "build/tiny-model"))
    parser.add_argument("--tokens", type=int, default=16_000, help="tokens per throughput run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens-per-batch", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="float32 by default: this CPU has no bf16 matrix units (bf16 runs ~7x slower)")
    parser.add_argument("--rss-shards", default="32,128,384", help="shard sizes (samples) for the RSS runs")
    parser.add_argument("--rss-part-mib", type=int, default=16, help="part size during the RSS runs")
    parser.add_argument("--phases", default="throughput,rss", help="a subset of throughput,rss")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    settings = HiddenStatesConfig(dtype=args.dtype, max_tokens_per_batch=args.max_tokens_per_batch)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-model-") as tmp:
        models = {"tiny": args.tiny_model, "hidden 1024 x 8 layers": random_model(Path(tmp), 1024, 8)}
        if "throughput" in args.phases:
            print(f"{'model':<24} {'tokens':>7} {'stage tok/s':>12} {'forward tok/s':>14} {'ratio':>6} "
                  f"{'bytes/token':>12} {'4 x H x dtype':>14}")
        for name, model in models.items() if "throughput" in args.phases else ():
            row = throughput(model, args.tokens, args.repeats, settings)
            print(f"{name:<24} {row['tokens']:>7} {row['stage tok/s']:>12,.0f} {row['bare forward tok/s']:>14,.0f} "
                  f"{row['ratio']:>6.3f} {row['bytes/token']:>12.1f} {row['states lower bound']:>14}")

        rss_settings = settings.model_copy(update={"part_size_bytes": args.rss_part_mib << 20})
        if "rss" in args.phases:
            print(f"\npeak RSS, part size {args.rss_part_mib} MiB, {args.dtype} (fresh process per shard)")
            print(f"{'model':<24} {'samples':>8} {'tokens':>8} {'written MiB':>12} {'parts':>6} {'loaded MiB':>11} "
                  f"{'forward-only peak':>18} {'stage peak MiB':>15}")
        for name, model in models.items() if "rss" in args.phases else ():
            for samples in (int(n) for n in args.rss_shards.split(",")):
                row = peak_rss(model, samples, rss_settings, stage=True)
                forward = peak_rss(model, samples, rss_settings, stage=False)["peak_mib"]
                print(f"{name:<24} {samples:>8} {row['tokens']:>8} {row['bytes'] / 2**20:>12.1f} {row['parts']:>6} "
                      f"{row['loaded_mib']:>11.0f} {forward:>18.0f} {row['peak_mib']:>15.0f}")


if __name__ == "__main__":
    main()
