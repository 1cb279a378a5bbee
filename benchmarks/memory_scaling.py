"""Does a run's memory stay flat as the prompt count grows?

`eagle3-datagen run` end to end against a scripted server in its own process (real token ids from the tiny
model's tokenizer, every reasoning padded to --reasoning-chars characters), hidden states off, at each prompt
count. The command's resident memory is sampled every 0.1 s; the stages' windows come from the run folder (the
last generations shard ends generation, the last sequences shard ends validation and sequences, which
interleave, and the manifest ends the report). Prints peak RSS per stage and each count's ratio to the first.

    .venv/bin/python benchmarks/memory_scaling.py [--prompts 5000,20000,50000] [--reasoning-chars 30000]

Figures are printed, never asserted. The command's child (Prefect's temporary API) is not counted: its memory
is Prefect's own and does not follow the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from eagle3_datagen.testing.vllm_server import free_port

REPO = Path(__file__).resolve().parents[1]
STAGES = ("generation", "validation+sequences", "report")


def rss_mib(pid: int) -> float:
    """Resident memory of one process, from /proc (0 once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def write_prompts(path: Path, count: int) -> None:
    with path.open("w") as out:
        for i in range(count):
            question = f"Question {i}: how many primes are there below {1000 + i}, and why?"
            out.write(json.dumps({"messages": [{"role": "user", "content": question}]}) + "\n")


def stage_ends(run: Path) -> dict[str, float]:
    """When each stage finished, from its last output's modification time."""
    def last(pattern: str) -> float:
        return max((p.stat().st_mtime for p in run.glob(pattern)), default=0.0)

    return {"generation": last("generations/shard-*.jsonl"), "validation+sequences": last("sequences/shard-*.parquet"),
            "report": last("manifest.json")}


def measure(prompts: int, reasoning_chars: int, work: Path, tokenizer: Path) -> dict[str, float]:
    """Peak RSS (MiB) of the command in each stage's window, and the run's seconds."""
    data = work / f"prompts-{prompts}.jsonl"
    write_prompts(data, prompts)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "eagle3_datagen.testing.scripted_server", "--port", str(port),
                               "--tokenizer", str(tokenizer), "--reasoning-chars", str(reasoning_chars),
                               "--model", "tiny"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().startswith("http://")
        config = work / f"config-{prompts}.yaml"
        config.write_text(yaml.safe_dump({
            "run_name": f"mem-{prompts}", "output_uri": str(work / "runs"),
            "data": {"source": str(data), "shard_size": 500},
            "model": {"name": "tiny", "profile": "qwen3", "tokenizer": str(tokenizer)},
            "server": {"endpoints": [f"http://127.0.0.1:{port}"], "max_in_flight": 64},
            "generation": {"max_tokens": 32768},
            "sequences": {"max_seq_len": 65536},
            "hidden_states": {"backend": "none"},
        }))
        samples: list[tuple[float, float]] = []
        started = time.time()
        command = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--config", str(config)], cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = threading.Thread(target=lambda: sample_rss(command, samples), daemon=True)
        sampler.start()
        output, _ = command.communicate()
        sampler.join()
        if command.returncode != 0:
            raise SystemExit(f"run of {prompts} prompts failed:\n{output[-3000:]}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    ends = stage_ends(work / "runs" / f"mem-{prompts}")
    peaks, start = {}, started
    for stage in STAGES:
        window = [rss for t, rss in samples if start <= t <= ends[stage] + 0.2]
        peaks[stage] = max(window, default=0.0)
        start = ends[stage]
    return {**peaks, "seconds": time.time() - started}


def sample_rss(command: subprocess.Popen[str], samples: list[tuple[float, float]]) -> None:
    while command.poll() is None:
        samples.append((time.time(), rss_mib(command.pid)))
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="5000,20000,50000", help="prompt counts, comma-separated")
    parser.add_argument("--reasoning-chars", type=int, default=30_000, help="characters of reasoning per answer")
    parser.add_argument("--tokenizer", default=os.environ.get("EAGLE3_TINY_MODEL", str(REPO / "build/tiny-model")))
    args = parser.parse_args()
    counts = [int(n) for n in args.prompts.split(",")]
    with tempfile.TemporaryDirectory(prefix="eagle3-memory-", dir=REPO / "build") as work:
        rows = {n: measure(n, args.reasoning_chars, Path(work), Path(args.tokenizer)) for n in counts}
    first = rows[counts[0]]
    print(f"peak RSS (MiB) of `eagle3-datagen run` per stage, {args.reasoning_chars} characters of reasoning "
          f"per answer; ratio to {counts[0]} prompts")
    print(f"{'prompts':>8} " + " ".join(f"{s:>26}" for s in STAGES) + f" {'seconds':>8}")
    for n, row in rows.items():
        cells = " ".join(f"{row[s]:>12.0f} ({row[s] / first[s]:>5.2f}x)      " if first[s] else f"{row[s]:>26.0f}"
                         for s in STAGES)
        print(f"{n:>8} {cells} {row['seconds']:>8.0f}")


if __name__ == "__main__":
    main()
