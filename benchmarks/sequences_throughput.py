"""Token-sequence building speed: both ways (server ids, rebuilt from text) beside a plain tokenizer call.

Prints tokens per second for each way (text only; server ids with every sample or the default sample
cross-checked) and its throughput ratio to two bare calls on the same text: `tokenizer(batch)` and the Rust
backend's `encode_batch_fast` (the fastest bare call, the one the stage makes), measured in one run so the
machine's noise cancels out. Usage:

    .venv/bin/python benchmarks/sequences_throughput.py [--tokenizer ../shared/tokenizers/kimi-k2.5] [--samples 2000]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from eagle3_datagen.config import SequencesConfig
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.think_tokens import discover_think_tokens, load_tokenizer
from tasks.sequences import build_sequences, text_rebuilds

WORDS = [
    "the",
    "model",
    "thinks",
    "about",
    "prime",
    "numbers,",
    "graphs,",
    "proofs,",
    "code",
    "and",
    "the",
    "answer",
    "twice",
    "before",
    "writing",
]


def synthetic_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    return [
        {
            "id": f"s{i}",
            "messages": [{"role": "user", "content": text(40)}],
            "reasoning": "\n" + text(400) + "\n",
            "content": "\n\n" + text(80),
            "finish_reason": "stop",
        }
        for i in range(count)
    ]


def best_of(repeats: int, work) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "kimi-k2.5"
    parser.add_argument("--tokenizer", default=str(default))
    parser.add_argument("--profile", default="kimi-k2.5")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    profile = BUILTIN_PROFILES[args.profile]
    spec = discover_think_tokens(tokenizer, profile)
    every, default_rate = SequencesConfig(cross_check_rate=1.0), SequencesConfig()
    drafts = synthetic_records(args.samples)
    text_records, server_records = [], []
    for record, (prompt, completion) in zip(drafts, text_rebuilds(drafts, tokenizer, profile, spec), strict=True):
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}  # what a server returns
        text_records.append({**record, "usage": usage})
        server_records.append({**record, "usage": usage, "prompt_token_ids": prompt,
                               "completion_token_ids": completion})
    tokens = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in text_records)
    plain_texts = [r["messages"][0]["content"] + r["reasoning"] + r["content"] for r in drafts]

    plain = best_of(args.repeats, lambda: tokenizer(plain_texts, add_special_tokens=False))
    backend = tokenizer.backend_tokenizer
    fastest = best_of(args.repeats, lambda: backend.encode_batch_fast(plain_texts, add_special_tokens=False))
    ways = {
        "rebuilt from text (no ids)": (text_records, default_rate),
        "server ids, every sample cross-checked": (server_records, every),
        f"server ids, {default_rate.cross_check_rate:.0%} cross-checked (default)": (server_records, default_rate),
    }
    print(f"{args.samples} samples, {tokens} tokens, tokenizer {Path(args.tokenizer).name}, one process")
    print(f"{'bare tokenizer(batch)':<44} {tokens / plain:12,.0f} tokens/s")
    print(f"{'bare backend encode_batch_fast':<44} {tokens / fastest:12,.0f} tokens/s")
    print(f"{'':<44} {'':>12}            / tokenizer(batch)  / encode_batch_fast")
    for name, (records, settings) in ways.items():
        took = best_of(args.repeats, lambda r=records, s=settings: build_sequences(r, tokenizer, profile, spec, s))
        print(f"{name:<44} {tokens / took:12,.0f} tokens/s   {plain / took:16.2f}x {fastest / took:18.2f}x")


if __name__ == "__main__":
    main()
