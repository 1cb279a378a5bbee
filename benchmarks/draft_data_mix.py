"""What the data mix buys: small EAGLE-3 drafts trained on four kinds of data, judged on one held-out split.

A real vLLM CPU server serves the tiny reasoning model; the pipeline (`eagle3-datagen run`, hidden states from the
transformers backend) regenerates two-turn arithmetic conversations, and speculators' own Trainer trains a
one-layer draft for the same number of steps on each of:

  a  original     the dataset's own answers (another writer's words), rendered through the chat template, the
                  target's hidden states over them: what a pipeline that does not regenerate trains on;
  b  single-turn  the last turn regenerated after the dataset's earlier answer (`data.turns: last`), thinking;
  c  thinking     each turn regenerated on the model's own answers (`data.turns: rollout`), thinking only;
  d  mix          the same rollouts, half the conversations in thinking mode and half in instant mode.

Every draft is judged by `evaluate` on the same held-out split: other conversations, regenerated as rollouts in
both modes. Printed per draft and mode: the expected acceptance length τ with its 95 % interval, and acc@1..3.
A measurement, not a test: it reports what it shows.

    .venv/bin/python benchmarks/draft_data_mix.py [--train 160] [--eval 48] [--steps 300] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from cli.demo import DEMO_MODEL_NAME, demo_config, tiny_model_dir
from eagle3_datagen.artifacts import MANIFEST
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.drafts import new_draft, train_draft
from eagle3_datagen.testing.vllm_server import LocalVLLMServer
from eagle3_datagen.think_tokens import load_tokenizer
from tasks.evaluate.evaluation import evaluate_draft
from tasks.export import export_run
from tasks.hidden_states.transformers_backend import extract_shard, load_target_model
from tasks.sequences import Sequence, to_parquet, to_table

AUX = [2, 4, 5]
MIX = [{"mode": "thinking", "weight": 0.5}, {"mode": "instant", "weight": 0.5}]
# the tiny model was taught a few dozen questions: on others it may ramble or cut short, which is what it does,
# so no validation rate stops a run here (each is tested elsewhere)
UNPOLICED = {f"max_{rate}_rate": 1.0 for rate in ("empty_content", "leaked_tags", "token_text_mismatch", "truncated",
                                                  "unclosed_reasoning", "rebuild_mismatch", "unexpected_reasoning")}
OPERATIONS = [("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b)]


def conversations(count: int, seed: int) -> list[dict[str, Any]]:
    """Two-turn arithmetic conversations with the dataset's own terse answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 20)
        word, operation = rng.choice(OPERATIONS)
        first = operation(a, b)
        rows.append({"messages": [
            {"role": "user", "content": f"What is {a} {word} {b}?"},
            {"role": "assistant", "content": f"{a} {word} {b} is {first}."},
            {"role": "user", "content": "And what is that times 2?"},
            {"role": "assistant", "content": f"That is {first * 2}."},
        ]})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_pipeline(model: Path, url: str, out: Path, name: str, source: Path, **sections: Any) -> Path:
    """`eagle3-datagen run` on a config like the demo's, as a user runs it; the run folder."""
    config = demo_config(model, url, out, run_name=name).model_dump(mode="json", exclude_none=True)
    config["model"]["name"] = DEMO_MODEL_NAME
    config["data"] = {"source": str(source), "shard_size": 64, **sections.pop("data", {})}
    config["generation"] = {**config["generation"], "max_tokens": 96, **sections.pop("generation", {})}
    config["validation"] = UNPOLICED
    config_file = out / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    command = [str(Path(sys.executable).parent / "eagle3-datagen"), "run", "--config", str(config_file)]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode:
        raise SystemExit(f"run {name} failed: {finished.stderr.strip().splitlines()[-1:]}")
    return out / name


def original_answers_run(model: Path, rows: list[dict[str, Any]], out: Path) -> Path:
    """(a): each conversation with the dataset's answers, rendered by the chat template, the assistant's turns
    supervised; the target's hidden states over them from the pipeline's extraction stage."""
    tokenizer = load_tokenizer(str(model))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sequences = []
    for i, row in enumerate(rows):
        messages = row["messages"]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        mask = [0] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"])
                end = ids.index(end_of_turn, start)
                mask[start:end + 1] = [1] * (end + 1 - start)
        sequences.append(Sequence(f"original-{i}", ids, mask, "text", None, None, "original"))
    store = RunStore(str(out), "original")
    store.write_json(MANIFEST, {"config": {"hidden_states": {"backend": "transformers"}},
                                "shards": {"shard-00000": {}}, "status": "completed"})
    ref = store.write_shard_bytes("sequences", 0, to_parquet([to_table(sequences)]), len(sequences))
    extract_shard(store, ref, load_target_model(str(model), "float32", "cpu"), HiddenStatesConfig(dtype="float32"))
    return out / "original"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=160, help="training conversations (two turns each)")
    parser.add_argument("--eval", type=int, default=48, help="held-out conversations, regenerated in both modes")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per draft (256 tokens each)")
    parser.add_argument("--keep", type=Path, help="write the runs and drafts here and keep them (default: a "
                        "temporary folder, removed)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    os.environ.setdefault("EAGLE3_TRAINERS", str(Path(__file__).resolve().parents[1] / "build" / "trainers"))
    model = tiny_model_dir()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="eagle3-draft-mix-") as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        train = write_jsonl(out / "train.jsonl", conversations(args.train, seed=1))
        held = write_jsonl(out / "eval.jsonl", conversations(args.eval, seed=2))
        runs: dict[str, Path] = {}
        with LocalVLLMServer(model, served_name=DEMO_MODEL_NAME, log_path=out / "vllm.log") as server:
            print(f"vLLM CPU server ready in {time.monotonic() - started:.0f} s", flush=True)
            evaluation = run_pipeline(model, server.url, out, "heldout", held, generation={"modes": MIX},
                                      data={"turns": "rollout", "holdout": 0.99, "holdout_min_per_mode": 0})
            runs["b single-turn"] = run_pipeline(model, server.url, out, "single-turn", train,
                                                 data={"turns": "last", "holdout": 0})
            runs["c thinking"] = run_pipeline(model, server.url, out, "thinking", train,
                                              data={"turns": "rollout", "holdout": 0})
            runs["d mix"] = run_pipeline(model, server.url, out, "mix", train, generation={"modes": MIX},
                                         data={"turns": "rollout", "holdout": 0})
        original = original_answers_run(model, [json.loads(line) for line in train.read_text().splitlines()], out)
        runs = {"a original": original, **runs}
        generated = time.monotonic()
        print(f"runs and hidden states in {generated - started:.0f} s", flush=True)
        results = []
        for name, run in runs.items():
            export = export_run(str(run), "speculators")
            trained = time.monotonic()
            draft = train_draft(new_draft(str(model), AUX), Path(export["out"]), out / "drafts" / name.split()[0],
                                max_steps=args.steps)
            summary = evaluate_draft(str(evaluation), str(draft))
            results.append((name, export["num_samples"], time.monotonic() - trained, summary))
        print_table(results)
    print(f"total {time.monotonic() - started:.0f} s (runs {generated - started:.0f} s)")


def print_table(results: list[tuple[str, int, float, dict[str, Any]]]) -> None:
    print(f"\n{'draft':<14}{'trained on':>11}{'train s':>8} | {'mode':<9}{'held-out':>9}"
          f"{'acc@1':>7}{'acc@2':>7}{'acc@3':>7}{'τ':>7}  95% CI")
    for name, samples, seconds, summary in results:
        for row in summary["rows"]:
            if row["group"] not in ("all", "mode"):
                continue
            acc = "".join(f"{a:>7.3f}" for a in row["full_acc"])
            print(f"{name:<14}{samples:>11}{seconds:>8.0f} | {row['value']:<9}{row['samples']:>9}{acc}"
                  f"{row['acceptance_length']:>7.3f}  {row['interval'][0]:.3f}-{row['interval'][1]:.3f}")


if __name__ == "__main__":
    main()
