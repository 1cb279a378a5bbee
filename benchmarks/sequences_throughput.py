"""Token-sequence building speed: both ways (server ids, rebuilt from text) beside a plain tokenizer call.

Prints tokens per second for each way and its ratio to `tokenizer(batch)` on the same text, measured in one
run so the machine's noise cancels out. Usage:

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
from tasks.sequences import build_sequences

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
    settings = SequencesConfig()
    text_records = synthetic_records(args.samples)
    built, _ = build_sequences(text_records, tokenizer, profile, spec, settings)
    tokens = sum(len(s.input_ids) for s in built)
    server_records = [
        {
            **r,
            "prompt_token_ids": s.input_ids[: s.loss_mask.index(1)],
            "completion_token_ids": s.input_ids[s.loss_mask.index(1) :],
        }
        for r, s in zip(text_records, built, strict=True)
    ]
    plain_texts = [r["messages"][0]["content"] + r["reasoning"] + r["content"] for r in text_records]

    plain = best_of(args.repeats, lambda: tokenizer(plain_texts, add_special_tokens=False))
    from_text = best_of(args.repeats, lambda: build_sequences(text_records, tokenizer, profile, spec, settings))
    from_server = best_of(args.repeats, lambda: build_sequences(server_records, tokenizer, profile, spec, settings))
    print(f"{args.samples} samples, {tokens} tokens, tokenizer {Path(args.tokenizer).name}")
    print(f"plain tokenizer(batch)         {tokens / plain:12,.0f} tokens/s")
    print(
        f"rebuilt from text              {tokens / from_text:12,.0f} tokens/s   "
        f"time ratio to plain tokenizer {from_text / plain:5.2f}x"
    )
    print(
        f"server ids (+ text cross-check){tokens / from_server:12,.0f} tokens/s   "
        f"time ratio to plain tokenizer {from_server / plain:5.2f}x"
    )


if __name__ == "__main__":
    main()
