"""Hidden-state extraction (transformers backend): what capture, copy and write cost beside the forward pass.

For each model it prints, measured in one run so the machine's noise cancels out:
  - tokens/s of the whole stage (`extract_shard`: read the sequences, forward with hooks, check, copy, pack and
    write parts with checksums, write the index) and of the bare forward pass on the same batches (same plan,
    same padding, no hooks, nothing kept), and their ratio (target >= 0.85);
  - bytes per token written against the 4 x H x (dtype size) lower bound (4 x H x 2 in bf16);
  - peak RSS of a fresh process extracting shards of growing size with a fixed part size, beside its RSS once the
    model and the sequences are loaded and the peak of the bare forward pass over the same shard (the batch's own
    activations): the stage's peak must stay near the forward's plus two parts (one written while the next fills),
    whatever the shard size;
  - per hidden_states.compression (none, zstd, fp8), on bf16 states: bytes per token against the 4 x H x 2 bound,
    the cost of writing a shard (the stage's own writer: pack, encode, checksum, write, index; states already in
    memory) and of reading it back (`read_hidden_state_shard`, which decodes), and fp8's cosine per row (token x
    layer) to the bf16 row, as the shard index records it.

Models: the repo's tiny model ($EAGLE3_TINY_MODEL, built by `make setup`) and random Qwen3 models (hidden 1024
and 8 layers unless --random-models says otherwise), saved to a temporary folder. The compression phase uses the
tiny model's states (transformers backend, bf16) and synthetic states with the scales of a real LLM's residual
stream, which no random model has: see `synthetic_states`. With --device-map cuda the throughput phase runs the
stage on a GPU (use --dtype bfloat16 there). Usage:

    .venv/bin/python benchmarks/hidden_states_throughput.py [--tokens 16000] [--repeats 3] [--dtype float32]
        [--rss-shards 32,128,384] [--rss-part-mib 16] [--synthetic-tokens 8000] [--massive 2000]
        [--phases throughput,rss,compression] [--device-map cuda] [--random-models 1024x8,4096x16]
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
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3_datagen.artifacts import ShardRef, artifact_path
from eagle3_datagen.config import Compression, HiddenStatesConfig
from eagle3_datagen.hidden_state_format import PART_TENSORS, Sample, cosine_summary, read_hidden_state_shard
from eagle3_datagen.storage import RunStore
from tasks.hidden_states.batching import plan_batches
from tasks.hidden_states.parts import TokenSequence, read_sequences, write_shard
from tasks.hidden_states.targets import TargetInfo
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
    device = target.base.get_input_embeddings().weight.device
    for batch in plan_batches([len(s.input_ids) for s in sequences], settings.max_tokens_per_batch):
        longest = max(len(sequences[i].input_ids) for i in batch)
        input_ids = torch.zeros((len(batch), longest), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, i in enumerate(batch):
            input_ids[row, : len(sequences[i].input_ids)] = sequences[i].input_ids
            attention_mask[row, : len(sequences[i].input_ids)] = 1
        with torch.inference_mode():
            target.base(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the stage waits for its states anyway (it copies them to the host)


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


COMPRESSIONS: tuple[Compression, ...] = ("none", "zstd", "fp8")
MASSIVE_CHANNELS = (17, 1401)  # where synthetic_states puts its massive activations


def tiny_model_states(model: str, tokens: int) -> tuple[TargetInfo, list[int], list[Sample]]:
    """The tiny model's bf16 states for a shard of reasoning-length sequences, through the transformers backend."""
    target = load_target_model(model, "bfloat16", "cpu")
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp:
        store = RunStore(tmp, "run")
        lengths = sequence_lengths(tokens)
        extract_shard(store, write_sequences(store, lengths, target.vocab_size), target,
                      HiddenStatesConfig(dtype="bfloat16"))
        samples = [Sample(s.id, *(getattr(s, name).clone() for name in PART_TENSORS))
                   for s in read_hidden_state_shard(store, artifact_path("hidden_states", 0))]
    return target, lengths, samples


def synthetic_states(tokens: int, hidden: int, massive: float, seed: int = 0) -> tuple[TargetInfo, list[int],
                                                                                       list[Sample]]:
    """bf16 states shaped like a real LLM's residual stream, which a random model's are not.

    Per channel a log-normal scale (sigma 0.5); 6 outlier channels at 20-60x (the systematic outlier features of
    LLM.int8); the stream growing with depth (x1, x2, x4, x8 from the low aux layer to the final state); and
    massive activations: 2 fixed channels at `massive` x the row's median magnitude on every sample's first token
    and on 2% of the others (delimiters), as Sun et al. (2024) report for LLaMA-2 and Mixtral (thousands to about
    10,000x the median). Synthetic: the point is the scale structure fp8 must survive, not any one model's values.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = sequence_lengths(tokens, seed=seed)
    channel_scale = torch.exp(torch.randn(hidden, generator=gen) * 0.5)
    outliers = torch.randperm(hidden, generator=gen)[:6]
    channel_scale[outliers] *= 20 + 40 * torch.rand(6, generator=gen)
    depth = torch.tensor([1.0, 2.0, 4.0, 8.0])[:, None]
    samples = []
    for i, length in enumerate(lengths):
        rows = torch.randn(length, 4, hidden, generator=gen) * channel_scale * depth
        spikes = torch.rand(length, generator=gen) < 0.02
        spikes[0] = True
        median = rows[spikes].abs().median(-1, keepdim=True).values
        signs = torch.where(torch.rand(2, generator=gen) < 0.5, -1.0, 1.0)
        rows[spikes, :, MASSIVE_CHANNELS[0]: MASSIVE_CHANNELS[0] + 1] = massive * median * signs[0]
        rows[spikes, :, MASSIVE_CHANNELS[1]: MASSIVE_CHANNELS[1] + 1] = massive * median * signs[1]
        states = rows.to(torch.bfloat16)
        ids = torch.randint(0, 32000, (length,), generator=gen, dtype=torch.int32)
        mask = (torch.arange(length) >= length // 3).to(torch.uint8)
        # contiguous, as both backends hand states to the writer
        samples.append(Sample(f"s{i}", ids, mask, states[:, :3].reshape(length, 3 * hidden).contiguous(),
                              states[:, 3].contiguous()))
    target = TargetInfo("synthetic", 32, hidden, 32000, "synthetic", torch.ones(hidden), 1e-6)
    return target, lengths, samples


def median_seconds(work: Callable[[], object], repeats: int, at_least_s: float = 3.0) -> float:
    """Median time of `work`, run `repeats` times and until `at_least_s` went by: a shard of the tiny model takes
    milliseconds, which one stall of a shared machine would otherwise decide."""
    times: list[float] = []
    while len(times) < repeats or sum(times) < at_least_s:
        times.append(timed(work))
    return statistics.median(times)


def compression_run(target: TargetInfo, lengths: list[int], samples: list[Sample], compression: Compression,
                    repeats: int) -> tuple[dict[str, float], dict, list[Sample]]:
    """Write the samples as a shard through the stage's writer, then read it back; median times."""
    by_id = {sample.id: sample for sample in samples}

    def replay(sequences: list[TokenSequence], aux_layers: list[int]) -> Iterator[Sample]:
        return (by_id[sequence.id] for sequence in sequences)

    settings = HiddenStatesConfig(dtype="bfloat16", compression=compression)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp:
        store = RunStore(tmp, "run")
        shard = write_sequences_of(store, samples)
        index_rel = artifact_path("hidden_states", 0)
        write_shard(store, shard, target, settings, replay)  # warm-up: allocator, page cache, first-call kernels
        read_back = list(read_hidden_state_shard(store, index_rel))
        write_s = median_seconds(lambda: write_shard(store, shard, target, settings, replay), repeats)
        read_s = median_seconds(lambda: list(read_hidden_state_shard(store, index_rel)), repeats)
        index = store.read_json(index_rel)
    total = sum(lengths)
    return {
        "tokens": total,
        "bytes/token": sum(part["bytes"] for part in index["parts"]) / total,
        "bound": 4 * target.hidden_size * 2,
        "write tok/s": total / write_s,
        "read samples/s": len(samples) / read_s,
    }, index, read_back


def write_path_run(target: TargetInfo, samples: list[Sample], compression: Compression, output_uri: str,
                   repeats: int) -> dict[str, float]:
    """The stage's write path (pack, encode, hash, write the parts, the norm and the index; states in memory) against
    a plain write of the same part files' bytes to the same place; median seconds."""
    by_id = {sample.id: sample for sample in samples}

    def replay(sequences: list[TokenSequence], aux_layers: list[int]) -> Iterator[Sample]:
        return (by_id[sequence.id] for sequence in sequences)

    settings = HiddenStatesConfig(dtype="bfloat16", compression=compression)
    store = RunStore(output_uri, f"eagle3-bench-write-{compression}")
    try:
        shard = write_sequences_of(store, samples)
        write_shard(store, shard, target, settings, replay)  # warm-up: allocator, page cache, connections
        stage_s = median_seconds(lambda: write_shard(store, shard, target, settings, replay), repeats)
        parts = [store.read_bytes(f"hidden_states/shard-00000/{part['file']}")
                 for part in store.read_json(artifact_path("hidden_states", 0))["parts"]]
        raw_s = median_seconds(lambda: [store.write_bytes(f"raw/part-{number:05d}.safetensors", data)
                                        for number, data in enumerate(parts)], repeats)
    finally:
        store.fs.rm(store.root, recursive=True)
    tokens, written = sum(len(sample.input_ids) for sample in samples), sum(len(data) for data in parts)
    return {"tokens": tokens, "MB": written / 1e6, "stage tok/s": tokens / stage_s, "stage MB/s": written / 1e6 /
            stage_s, "raw MB/s": written / 1e6 / raw_s, "ratio": raw_s / stage_s}


def write_path_phase(synthetic_tokens: int, destinations: list[str], repeats: int) -> None:
    """Per destination and compression: is the stage's write path as fast as the storage under it?"""
    target, _lengths, samples = synthetic_states(synthetic_tokens, 4096, 2000)
    print(f"\nwrite path: synthetic bf16 states (H 4096, {torch.get_num_threads()} torch threads); stage = pack, "
          "encode, hash, write parts, norm and index; raw = the same part bytes written plainly to the same place")
    print(f"{'destination':<40} {'setting':<5} {'tokens':>7} {'MB':>7} {'stage tok/s':>12} {'stage MB/s':>11} "
          f"{'raw MB/s':>9} {'ratio':>6}")
    for destination in destinations:
        for compression in COMPRESSIONS:
            row = write_path_run(target, samples, compression, destination, repeats)
            print(f"{destination[-40:]:<40} {compression:<5} {row['tokens']:>7} {row['MB']:>7.0f} "
                  f"{row['stage tok/s']:>12,.0f} {row['stage MB/s']:>11,.0f} {row['raw MB/s']:>9,.0f} "
                  f"{row['ratio']:>6.3f}")


def write_sequences_of(store: RunStore, samples: list[Sample]) -> ShardRef:
    """The sequences shard the samples were extracted from (their ids, token ids and masks)."""
    table = pa.table({
        "id": pa.array([sample.id for sample in samples]),
        "input_ids": pa.array([sample.input_ids.tolist() for sample in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([sample.loss_mask.tolist() for sample in samples], pa.list_(pa.int8())),
    })
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return store.write_shard_bytes("sequences", 0, buffer.getvalue(), len(samples))


def state_rows(sample: Sample, hidden: int) -> torch.Tensor:
    """A sample's rows, one per token and layer: [t, 4, H] in float32."""
    aux = sample.aux_hidden_states.view(len(sample.input_ids), 3, hidden)
    return torch.cat([aux, sample.final_hidden_states[:, None]], 1).float()


def ordinary_channel_cosines(original: list[Sample], decoded: list[Sample], hidden: int,
                             massive: float) -> torch.Tensor:
    """Cosine per row of the rows that hold massive activations, over the other channels only: what fp8 does to
    the bulk of such a row, which the two massive channels hide from the whole row's cosine."""
    keep = torch.ones(hidden, dtype=torch.bool)
    keep[list(MASSIVE_CHANNELS)] = False
    cosines = []
    for a, b in zip(original, decoded, strict=True):
        rows_a, rows_b = state_rows(a, hidden), state_rows(b, hidden)
        spiked = rows_a[..., MASSIVE_CHANNELS[0]].abs() > massive / 2 * rows_a.abs().median(-1).values
        cosines.append(torch.nn.functional.cosine_similarity(rows_a[spiked][:, keep], rows_b[spiked][:, keep], dim=-1))
    return torch.cat(cosines)


def compression_phase(tiny_model: str, tiny_tokens: int, synthetic_tokens: int, massive: float,
                      repeats: int) -> None:
    # one thread: the cost per core; with two on a shared 2-core machine, torch's threads spin-wait for a busy
    # core and the same tiny write takes 35 ms or 1.4 s
    torch.set_num_threads(1)
    datasets = {"tiny model (H 64)": tiny_model_states(tiny_model, tiny_tokens),
                f"synthetic (H 4096, massive {massive:g}x)": synthetic_states(synthetic_tokens, 4096, massive)}
    print("\nhidden_states.compression, bf16 states, one thread; bound = 4 x H x 2 bytes per token; write: the stage's "
          "writer with the states in memory; read: read_hidden_state_shard")
    print(f"{'data':<34} {'setting':<5} {'tokens':>7} {'bytes/token':>12} {'bound':>6} {'ratio':>6} "
          f"{'write tok/s':>12} {'write x none':>13} {'read samples/s':>15} {'read x none':>12}")
    fidelity = []
    for name, (target, lengths, samples) in datasets.items():
        rows = {}
        for compression in COMPRESSIONS:
            row, index, read_back = compression_run(target, lengths, samples, compression, repeats)
            rows[compression] = row
            none = rows["none"]
            print(f"{name:<34} {compression:<5} {row['tokens']:>7} {row['bytes/token']:>12.1f} {row['bound']:>6} "
                  f"{row['bytes/token'] / row['bound']:>6.3f} {row['write tok/s']:>12,.0f} "
                  f"{none['write tok/s'] / row['write tok/s']:>13.2f} {row['read samples/s']:>15,.1f} "
                  f"{none['read samples/s'] / row['read samples/s']:>12.2f}")
            if compression == "fp8":
                fidelity.append((name, index["fp8_cosine"]))
                if name.startswith("synthetic"):
                    bulk = ordinary_channel_cosines(samples, read_back, target.hidden_size, massive)
                    fidelity.append(("  its massive rows, other channels", cosine_summary(bulk)))
    print("\nfp8: cosine per row (token x layer) to the bf16 row (from the shard index; goal >= 0.999)")
    print(f"{'data':<34} {'rows':>7} {'min':>8} {'p1':>8} {'p50':>8} {'mean':>8} {'under 0.999':>12}")
    for name, stats in fidelity:
        print(f"{name:<34} {stats['rows']:>7} {stats['min']:>8.5f} {stats['p1']:>8.5f} {stats['p50']:>8.5f} "
              f"{stats['mean']:>8.5f} {stats['under_0.999']:>12}")


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
    parser.add_argument("--device-map", default="cpu", help="hidden_states.device_map, e.g. cuda")
    parser.add_argument("--random-models", default="1024x8", help="random Qwen3 targets besides the tiny model, "
                        "HIDDENxLAYERS, comma-separated")
    parser.add_argument("--rss-shards", default="32,128,384", help="shard sizes (samples) for the RSS runs")
    parser.add_argument("--rss-part-mib", type=int, default=16, help="part size during the RSS runs")
    parser.add_argument("--phases", default="throughput,rss,compression,write",
                        help="a subset of throughput,rss,compression,write")
    parser.add_argument("--write-to", default="", help="output URIs the write phase writes to besides a local "
                        "temporary folder, comma-separated, e.g. s3://bucket/prefix (credentials from the environment)")
    parser.add_argument("--synthetic-tokens", type=int, default=8000, help="tokens of synthetic states (H 4096)")
    parser.add_argument("--massive", type=float, default=2000, help="massive activations, x the row's median")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    settings = HiddenStatesConfig(dtype=args.dtype, max_tokens_per_batch=args.max_tokens_per_batch,
                                  device_map=args.device_map)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-model-") as tmp:
        models = {"tiny": args.tiny_model}
        for shape in filter(None, args.random_models.split(",")):
            hidden, layers = (int(n) for n in shape.split("x"))
            models[f"hidden {hidden} x {layers} layers"] = random_model(Path(tmp) / shape, hidden, layers)
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
    if "compression" in args.phases:
        compression_phase(args.tiny_model, args.tokens, args.synthetic_tokens, args.massive, args.repeats)
    if "write" in args.phases:
        torch.set_num_threads(os.cpu_count() or 1)
        with tempfile.TemporaryDirectory(prefix="eagle3-bench-write-") as local:
            write_path_phase(args.synthetic_tokens, [local, *filter(None, args.write_to.split(","))], args.repeats)


if __name__ == "__main__":
    main()
