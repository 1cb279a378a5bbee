"""How exact is an image run? The demo's image variant end to end, then its figures read back from the run folder.

Starts the real vLLM CPU server on the tiny vision-language model (`make setup` builds it), runs the pipeline on
`--rows` drawn-shape prompts, half thinking, half instant (`eagle3-datagen demo --images`), exports it for both
trainers, and prints:
- rows, images and samples by mode, and image tokens per sample;
- how many samples' server prompt ids equal what the model's own processor makes of the same picture and
  template;
- the lowest per-token cosine between the stored states and the whole model's own forward;
- the samples each trainer's export holds.
A measurement, not an assertion: `tests/e2e/test_images_vllm.py` asserts the same properties.

Usage: `.venv/bin/python benchmarks/image_exactness.py [--rows 48]`
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from cli.demo import DEMO_VLM_NAME, image_demo_config, tiny_vlm_dir
from cli.runner import run_pipeline
from eagle3_datagen.hidden_state_format import read_hidden_state_shard
from eagle3_datagen.images import image_path
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.tiny_vlm import write_image_dataset
from eagle3_datagen.testing.vllm_server import REPO_ROOT, LocalVLLMServer
from tasks.export import export_run


def exactness(run: Path, model_dir: Path) -> tuple[int, int, float]:
    """(samples, samples whose server prompt ids are the processor's, lowest per-token-and-layer cosine to the
    model's own forward)."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = {json.loads(line)["id"]: json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()}
    store, samples, same, lowest = RunStore.at(str(run)), 0, 0, 1.0
    for index in sorted((run / "hidden_states").glob("shard-*/index.json")):
        rows = {row["id"]: row for row in pq.read_table(run / "sequences" / f"{index.parent.name}.parquet").to_pylist()}
        aux = json.loads(index.read_text())["aux_layers"]["input_to_layer"]
        for sample in read_hidden_state_shard(store, str(index.relative_to(run))):
            row, record = rows[sample.id], records[sample.id]
            pictures = [Image.open(run / image_path(name)).convert("RGB") for name in row["images"]]
            text = processor.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=record.get("mode") == "thinking")
            expected = processor(text=[text], images=[pictures], return_tensors="pt")["input_ids"][0].tolist()
            ids = torch.tensor([row["input_ids"]])
            with torch.inference_mode():
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                            **processor.image_processor(images=[pictures], return_tensors="pt"))
            own = torch.stack([out.hidden_states[layer][0] for layer in aux], dim=1)  # [T, layers, H]
            stored = sample.aux_hidden_states.float().view(own.shape)
            cosine = torch.nn.functional.cosine_similarity(stored, own, dim=-1)  # per token and layer
            samples, same, lowest = samples + 1, same + (expected == record["prompt_token_ids"]), min(
                lowest, float(cosine.min()))
    return samples, same, lowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=48)
    args = parser.parse_args()
    model_dir = tiny_vlm_dir()
    with tempfile.TemporaryDirectory(prefix="eagle3-images-", dir=REPO_ROOT / "build") as tmp:
        out = Path(tmp)
        source = write_image_dataset(out / "data", args.rows)
        with LocalVLLMServer(model_dir, served_name=DEMO_VLM_NAME, log_path=out / "server.log",
                             extra_args=["--limit-mm-per-prompt", '{"image": 4}']) as server:
            started = time.monotonic()
            run_pipeline(image_demo_config(model_dir, server.url, out, source))
            seconds = time.monotonic() - started
        run = out / "demo-images"
        manifest = json.loads((run / "manifest.json").read_text())
        totals = manifest["totals"]
        modes = Counter(row["mode"] for f in (run / "sequences").glob("shard-*.parquet")
                        for row in pq.read_table(f, columns=["mode"]).to_pylist())
        exported = {name: export_run(str(run), name)["num_samples"] for name in ("speculators", "specforge")}
        samples, same, lowest = exactness(run, model_dir)
    print(f"run: {manifest['status']} in {seconds:.1f} s; rows {totals['input_rows']}, rejected {totals['rejected']}, "
          f"images {totals['images']} ({totals['images_per_image_prompt']} per prompt), samples "
          f"{dict(sorted(modes.items()))}, image tokens per sample {totals['image_tokens_per_image_sample']}")
    print(f"server prompt ids equal the model's own processor: {same}/{samples}")
    print(f"lowest per-token, per-layer cosine, stored states to the model's own forward: {lowest:.6f}")
    print(f"exported samples: {exported}")


if __name__ == "__main__":
    main()
