"""Image prompts end to end on real parts: the tiny vision-language model (Idefics3, built here) served by the real
vLLM CPU server with images, an image dataset with bad rows among good ones, hidden states of the real
multimodal forward (transformers backend), exports read by the trainers' own loaders."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from bad_images import huge_png_header, truncated_png
from built_models import built_model
from PIL import Image
from safetensors.torch import load_file
from trainer_files import assert_the_trainers_read_every_sample
from transformers import AutoModelForImageTextToText, AutoProcessor

from cli.demo import DEMO_VLM_NAME, image_demo_config
from cli.runner import run_pipeline
from eagle3_datagen.config import parse_config
from eagle3_datagen.hidden_state_format import read_hidden_state_shard
from eagle3_datagen.images import image_names, image_path
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.drafts import new_draft, train_draft
from eagle3_datagen.testing.tiny_vlm import IMAGE_TOKEN, build_tiny_vlm, shape_image, write_image_dataset
from eagle3_datagen.testing.vllm_server import LocalVLLMServer, free_port
from tasks.export import export_run
from tasks.generation import GenerationError
from tasks.verify import verify_run

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("prefect_api")]
IMAGE_ROWS = 24


@pytest.fixture(scope="module")
def tiny_vlm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny vision-language model (a fresh build takes a few minutes)."""
    return built_model("EAGLE3_TINY_VLM", lambda: build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), tiny_model))


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServer]:
    log_path = tmp_path_factory.mktemp("vllm-vlm") / "server.log"
    with LocalVLLMServer(tiny_vlm, served_name=DEMO_VLM_NAME, log_path=log_path,
                         extra_args=["--limit-mm-per-prompt", '{"image": 4}']) as server:
        yield server


def with_bad_rows(source: Path) -> dict[str, str]:
    """Rows whose image cannot be used, appended to the dataset: the start of the reason each must get, by url."""
    folder = source.parent
    (folder / "truncated.png").write_bytes(truncated_png())
    (folder / "huge.png").write_bytes(huge_png_header(20_000, 20_000))
    silent = f"http://127.0.0.1:{free_port()}/cat.png"  # nothing listens there
    reasons = {"missing.png": f"image file {folder / 'missing.png'} does not exist",
               "truncated.png": "image is corrupt or truncated",
               silent: f"image URL {silent} did not answer",
               "huge.png": "image is 400,000,000 pixels > data.images.max_pixels 40,000,000"}
    with source.open("a") as rows:
        for url in reasons:
            rows.write(json.dumps({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What shape is it?"}]}]})
                + "\n")
    return reasons


@pytest.fixture(scope="module")
def image_run(tiny_vlm: Path, vlm_server: LocalVLLMServer, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, dict[str, str]]:
    """One run of the image dataset with its bad rows, exported for both trainers."""
    folder = tmp_path_factory.mktemp("image-run")
    source = write_image_dataset(folder / "data", IMAGE_ROWS)
    reasons = with_bad_rows(source)
    run_pipeline(image_demo_config(tiny_vlm, vlm_server.url, folder / "out", source, run_name="images"))
    run = folder / "out" / "images"
    exported = {trainer: export_run(str(run), trainer)["num_samples"] for trainer in ("speculators", "specforge")}
    assert exported["speculators"] == exported["specforge"]
    return run, reasons


def test_bad_images_reject_their_rows_with_the_reason_and_the_run_completes(image_run: tuple[Path, dict[str, str]]
                                                                             ) -> None:
    run, reasons = image_run
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed", manifest.get("cause")
    rejected = [json.loads(line) for line in (run / "rejected" / "prompts.jsonl").read_text().splitlines()]
    bad = [row for row in rejected if row["row"] >= IMAGE_ROWS]
    assert [row["row"] for row in bad] == list(range(IMAGE_ROWS, IMAGE_ROWS + len(reasons)))
    for row, reason in zip(bad, reasons.values(), strict=True):
        assert row["reason"].startswith(reason), row
    totals = manifest["totals"]
    assert totals["images"] == len(list((run / "images").iterdir())) > 1
    assert totals["images_per_image_prompt"] == 1.0 and totals["image_tokens_per_image_sample"] > 0
    assert verify_run(RunStore.at(str(run)), deep=True).complete


def test_image_samples_are_the_servers_ids_with_the_image_tokens_it_expanded(image_run: tuple[Path, dict[str, str]],
                                                                            tiny_vlm: Path) -> None:
    """The server's prompt ids hold each image's expanded tokens (what the model's own processor makes of the same
    picture and text); the sequence is those ids exactly, the loss mask the answer's tokens only."""
    run, _ = image_run
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    records = {json.loads(line)["id"]: json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()}
    rows = [row for f in sorted((run / "sequences").glob("shard-*.parquet")) for row in pq.read_table(f).to_pylist()]
    assert len(rows) >= IMAGE_ROWS * 0.75 and {row["mode"] for row in rows} == {"thinking", "instant"}
    for row in rows:
        record = records[row["id"]]
        prompt, completion = record["prompt_token_ids"], record["completion_token_ids"]
        assert row["input_ids"] == prompt + completion and row["source"] == "server"
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
        assert row["images"] == image_names(record["messages"]) and len(row["images"]) == 1
        image_positions = [i for i, token in enumerate(prompt) if token == image_id]
        assert [i for start, end in row["image_spans"] for i in range(start, end)] == image_positions
        pictures = [Image.open(run / image_path(name)).convert("RGB") for name in row["images"]]
        text = processor.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False,
                                             enable_thinking=record["mode"] == "thinking")
        expected = processor(text=[text], images=[pictures], return_tensors="pt")["input_ids"][0].tolist()
        assert prompt == expected, "vLLM expanded the image to the tokens the model's own processor makes"


def test_image_hidden_states_are_the_multimodal_forwards_and_the_trainers_read_them(
        image_run: tuple[Path, dict[str, str]], tiny_vlm: Path) -> None:
    """Stored states equal the whole vision-language model's own forward (pixels through the vision tower into the
    language model), not a text-only pass over the same ids; both trainers' loaders read every sample."""
    run, _ = image_run
    store = RunStore.at(str(run))
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    index_rel = "hidden_states/shard-00000/index.json"
    index = store.read_json(index_rel)
    samples = list(read_hidden_state_shard(store, index_rel))
    aux = index["aux_layers"]["input_to_layer"]
    rows = {row["id"]: row for row in pq.read_table(run / "sequences" / "shard-00000.parquet").to_pylist()}
    for sample in samples[:4]:
        row = rows[sample.id]
        assert index["image_spans"][sample.id] == row["image_spans"]
        pictures = [Image.open(run / image_path(name)).convert("RGB") for name in row["images"]]
        pixels = processor.image_processor(images=[pictures], return_tensors="pt")
        ids = torch.tensor([row["input_ids"]])
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, **pixels)
            text_only = model.model.text_model(input_ids=ids, output_hidden_states=True)
        states = torch.cat([out.hidden_states[i][0] for i in aux], dim=-1)
        torch.testing.assert_close(sample.aux_hidden_states.float(), states, rtol=1e-4, atol=1e-4)
        start = row["image_spans"][0][0]
        assert not torch.allclose(out.hidden_states[aux[0]][0, start], text_only.hidden_states[aux[0]][0, start]), \
            "the image positions carry the vision tower's features, not the placeholder's embedding"
    total = sum(json.loads(path.read_text())["num_samples"] for path in (run / "hidden_states").glob("*/index.json"))
    assert_the_trainers_read_every_sample(run, total)


def test_speculators_trains_a_draft_on_the_image_export(image_run: tuple[Path, dict[str, str]], tiny_vlm: Path,
                                                       tmp_path: Path) -> None:
    """speculators' own Trainer takes optimizer steps on the image samples, on this CPU."""
    run, _ = image_run
    index = json.loads((run / "hidden_states" / "shard-00000" / "index.json").read_text())
    draft = new_draft(str(tiny_vlm), index["aux_layers"]["input_to_layer"])
    untrained = {name: tensor.clone() for name, tensor in draft.state_dict().items()}
    checkpoint = train_draft(draft, run / "exports" / "speculators", tmp_path / "draft", max_steps=2)
    trained = load_file(checkpoint / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in trained.values())
    assert any(not torch.equal(trained[name], untrained[name]) for name in trained if name in untrained)


def test_a_redrawn_picture_is_a_new_prompt_and_every_other_answer_is_kept(
        tiny_vlm: Path, vlm_server: LocalVLLMServer, tmp_path: Path) -> None:
    """A prompt's id hashes its picture's bytes: a picture redrawn under the same path is asked as a new prompt,
    its old answer dropped; the other answers are kept, not asked again."""
    source = write_image_dataset(tmp_path / "data", 6)
    config = image_demo_config(tiny_vlm, vlm_server.url, tmp_path / "out", source, run_name="redrawn")
    run = tmp_path / "out" / "redrawn"

    def answers() -> dict[str, dict[str, Any]]:
        return {json.loads(line)["id"]: json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
                for line in f.read_text().splitlines()}

    run_pipeline(config)
    before = answers()
    redrawn = json.loads(source.read_text().splitlines()[2])["messages"][0]["content"][0]["image_url"]["url"]
    shape_image("star", "green", 70, 90).save(source.parent / redrawn, format="PNG")
    run_pipeline(config)
    after = answers()

    assert len(after) == len(before) == 6
    [gone], [new] = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    assert image_names(before[gone]["messages"]) != image_names(after[new]["messages"])
    assert all(after[key] == before[key] for key in set(before) & set(after))
    second_log = sorted((run / "logs").glob("run-*.log"))[-1].read_text()
    assert "generation done: 1 prompts" in second_log, "only the redrawn picture's prompt was asked"
    assert verify_run(RunStore.at(str(run)), deep=True).complete


def test_image_prompts_sent_to_a_text_only_server_stop_the_run_in_one_line(
        vllm_server: LocalVLLMServer, tiny_vlm: Path, tmp_path: Path) -> None:
    """The server's refusal of images ends the run at its first answers, its reason in the cause."""
    source = write_image_dataset(tmp_path / "data", 8)
    tree = image_demo_config(tiny_vlm, vllm_server.url, tmp_path / "out", source).model_dump(mode="json")
    tree["model"]["name"] = vllm_server.served_name  # the tiny text model
    with pytest.raises(GenerationError, match="is not a multimodal model"):
        run_pipeline(parse_config(tree))
    manifest = json.loads((tmp_path / "out" / "demo-images" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "is not a multimodal model" in manifest["cause"]
    assert "\n" not in manifest["cause"]


def test_verify_names_a_missing_image_and_one_changed_after_its_prompts(image_run: tuple[Path, dict[str, str]],
                                                                        tmp_path: Path) -> None:
    run, _ = image_run
    copy = tmp_path / "images-run"
    shutil.copytree(run, copy)
    missing, changed = sorted((copy / "images").iterdir())[:2]
    missing.unlink()
    changed.write_bytes(changed.read_bytes() + b"\0")
    structural = verify_run(RunStore.at(str(copy)))
    assert any("images in storage" in problem for problem in structural.problems), structural.problems
    deep = verify_run(RunStore.at(str(copy)), deep=True)
    assert not deep.complete
    assert any(f"shows images/{missing.name}, which is not in storage" in p for p in deep.problems), deep.problems
    assert f"images/{changed.name} no longer hashes to its name: the image was changed after its prompts were " \
           "made" in deep.problems
