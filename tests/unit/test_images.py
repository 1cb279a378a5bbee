"""Image rows: read in the shapes public datasets use, stored once by content, rejected per row with the reason."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bad_images import huge_png_header, png, truncated_png
from PIL import Image

from eagle3_datagen.artifacts import REJECTED_PATH, sha256_hex
from eagle3_datagen.config import DataConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.images import as_sent, image_names, image_path
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.vllm_server import free_port
from eagle3_datagen.think_tokens import load_tokenizer
from tasks.prompts import build_prompt_shards
from tasks.sequences import image_token_id, token_runs


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(words: str) -> dict[str, str]:
    return {"type": "text", "text": words}


def load(tmp_path: Path, rows: list[dict[str, Any]], **data: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                          RunStore]:
    source = tmp_path / "data" / "rows.jsonl"
    source.parent.mkdir(exist_ok=True)
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    store = RunStore(str(tmp_path / "out"), "run")
    result = build_prompt_shards(DataConfig(source=str(source), holdout=0, **data), store)
    prompts = [p for ref in result.shards for p in store.read_shard_records(ref)]
    return prompts, store.read_jsonl(REJECTED_PATH), store


def test_an_image_is_stored_once_under_its_hash_and_the_same_pixels_under_two_paths_are_one_prompt(
    tmp_path: Path,
) -> None:
    picture = png()
    (tmp_path / "data" / "a").mkdir(parents=True)
    (tmp_path / "data" / "a" / "one.png").write_bytes(picture)
    (tmp_path / "data" / "two.png").write_bytes(picture)
    uri = "data:image/png;base64," + base64.b64encode(picture).decode()
    rows = [user(image_url("a/one.png"), text("What shape?")),
            user(image_url(f"file://{tmp_path / 'data' / 'two.png'}"), text("What shape?")),
            user(image_url(uri), text("What shape?")),
            user(image_url("two.png"), text("What colour?"))]
    prompts, rejected, store = load(tmp_path, rows)

    name = f"{sha256_hex(picture)}.png"
    assert store.list("images") == [image_path(name)]
    assert store.read_bytes(image_path(name)) == picture
    assert len(prompts) == 2, "the same picture and question from a path, a file URL and a data URI is one prompt"
    assert [r["reason"] for r in rejected][:2] == [f"duplicate of id {prompts[0]['id']} (row 0)"] * 2
    assert prompts[0]["messages"] == [{"role": "user", "content": [{"type": "image", "image": name},
                                                                   {"type": "text", "text": "What shape?"}]}]
    sent = as_sent(prompts[0]["messages"], store.read_bytes)
    assert sent[0]["content"][0] == image_url("data:image/png;base64," + base64.b64encode(picture).decode())


def test_llava_image_marks_and_an_images_column_place_each_image_where_its_mark_is(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    for colour in ("red", "blue"):
        (tmp_path / "data" / f"{colour}.png").write_bytes(png(colour))
    rows = [{"image": "red.png", "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                                                   {"from": "gpt", "value": "A red square."}]},
            {"images": ["red.png", "blue.png"],
             "conversations": [{"from": "human", "value": "Compare <image> with <image>."}]},
            {"image": "blue.png", "conversations": [{"from": "human", "value": "No mark here."}]},
            {"images": ["red.png"], "conversations": [{"from": "human", "value": "<image> and <image>?"}]},
            {"images": ["red.png"],  # TRL's shape: an image part without a reference, the column holds it
             "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}]}]
    prompts, rejected, _ = load(tmp_path, rows, turns="last")

    red, blue = (f"{sha256_hex(png(colour))}.png" for colour in ("red", "blue"))
    assert [p["messages"][0]["content"] for p in prompts] == [
        [{"type": "image", "image": red}, {"type": "text", "text": "\nWhat is this?"}],
        [{"type": "text", "text": "Compare "}, {"type": "image", "image": red}, {"type": "text", "text": " with "},
         {"type": "image", "image": blue}, {"type": "text", "text": "."}],
        [{"type": "image", "image": blue}, {"type": "text", "text": "No mark here."}],
        [{"type": "image", "image": red}, {"type": "text", "text": "Which?"}],
    ]
    assert rejected == [{"row": 3, "stage": "prompts", "reason": "the turns show 2 images but the images column "
                                                                 "holds 1"}]


def test_parquet_image_features_are_read_from_their_bytes(tmp_path: Path) -> None:
    picture = png("green")
    table = pa.table({"images": [[{"bytes": picture, "path": "x.png"}]],
                      "messages": [[{"role": "user", "content": "<image>Describe it."}]]})
    source = tmp_path / "rows.parquet"
    pq.write_table(table, source)
    store = RunStore(str(tmp_path / "out"), "run")
    result = build_prompt_shards(DataConfig(source=str(source), holdout=0), store)
    [prompt] = [p for ref in result.shards for p in store.read_shard_records(ref)]
    assert image_names(prompt["messages"]) == [f"{sha256_hex(picture)}.png"]


def test_datasets_image_features_are_stored_as_the_bytes_the_dataset_holds(tmp_path: Path) -> None:
    """A Parquet file written by `datasets` with Image features: the stored image is the JPEG it holds, not a
    picture decoded and encoded again."""
    buffer = io.BytesIO()
    Image.new("RGB", (24, 16), "orange").save(buffer, format="JPEG")
    jpeg = buffer.getvalue()
    turns = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
    for column, feature in (("images", datasets.List(datasets.Image())), ("image", datasets.Image())):
        value = {"bytes": jpeg, "path": "x.jpg"}
        rows = datasets.Dataset.from_dict(
            {column: [[value] if column == "images" else value],
             "messages": [[{"role": "user", "content": "<image>What colour?"}]]},
            features=datasets.Features({column: feature, "messages": turns}))
        source = tmp_path / f"{column}.parquet"
        rows.to_parquet(source)
        store = RunStore(str(tmp_path / "out"), column)
        result = build_prompt_shards(DataConfig(source=str(source), holdout=0), store)
        [prompt] = [p for ref in result.shards for p in store.read_shard_records(ref)]
        assert image_names(prompt["messages"]) == [f"{sha256_hex(jpeg)}.jpeg"]
        assert store.read_bytes(image_path(f"{sha256_hex(jpeg)}.jpeg")) == jpeg


def test_unusable_images_reject_their_row_with_the_reason_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "truncated.png").write_bytes(truncated_png())
    (tmp_path / "data" / "huge.png").write_bytes(huge_png_header(20_000, 20_000))
    (tmp_path / "data" / "wide.png").write_bytes(huge_png_header(10_000, 5_000))
    (tmp_path / "data" / "heavy.png").write_bytes(png(size=(300, 300)))
    (tmp_path / "data" / "good.png").write_bytes(png())
    (tmp_path / "data" / "notes.png").write_text("not a picture")
    silent = f"http://127.0.0.1:{free_port()}/cat.png"  # nothing listens there
    rows = [user(image_url("missing.png"), text("a")), user(image_url("truncated.png"), text("b")),
            user(image_url("huge.png"), text("c")), user(image_url(silent), text("d")),
            user(image_url("notes.png"), text("e")), user(image_url("good.png"), text("f")),
            {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]},
            user(image_url("wide.png"), text("g"))]
    prompts, rejected, store = load(tmp_path, rows, images={"max_bytes": 5_000, "fetch_timeout_s": 1})

    reasons = {r["row"]: r["reason"] for r in rejected}
    assert reasons[0] == f"image file {tmp_path / 'data' / 'missing.png'} does not exist"
    assert reasons[1].startswith("image is corrupt or truncated")
    assert reasons[2] == "image is 400,000,000 pixels > data.images.max_pixels 40,000,000"
    assert reasons[3] == f"image URL {silent} did not answer (ConnectError)"
    assert reasons[4] == "not an image Pillow can read"
    assert reasons[6] == "turn 0 has a content part of type 'audio'; expected text, image_url or image"
    assert reasons[7] == "image is 10000x5000 = 50,000,000 pixels > data.images.max_pixels 40,000,000"
    assert [image_names(p["messages"]) for p in prompts] == [[f"{sha256_hex(png())}.png"]]
    assert len(store.list("images")) == 1, "a rejected row stores no image"


def test_an_image_over_the_byte_limit_is_rejected_before_it_is_decoded(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    buffer = io.BytesIO()
    Image.effect_noise((200, 200), 50).save(buffer, format="PNG")
    (tmp_path / "data" / "noise.png").write_bytes(buffer.getvalue())
    _, rejected, _ = load(tmp_path, [user(image_url("noise.png"), text("a")), user(text("only words"))],
                          images={"max_bytes": 1_000})
    assert rejected == [{"row": 0, "stage": "prompts", "reason": "image is over data.images.max_bytes 1,000"}]


def test_a_list_of_text_parts_is_the_text_vllm_makes_of_it(tmp_path: Path) -> None:
    prompts, _, store = load(tmp_path, [user(text("Hello"), text("world"))])
    assert prompts[0]["messages"] == [{"role": "user", "content": "Hello\nworld"}]
    assert not store.exists("images")


KIMI_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "tokenizers" / "kimi-k2.5"


@pytest.mark.skipif(not KIMI_TOKENIZER.is_dir(), reason="../shared/tokenizers/kimi-k2.5 is absent")
def test_the_kimi_profile_names_kimis_own_media_pad_token() -> None:
    tokenizer = load_tokenizer(str(KIMI_TOKENIZER))
    media = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]
    assert tokenizer.convert_tokens_to_ids(media) == [163602, 163603, 163604, 163605]
    assert image_token_id(tokenizer, BUILTIN_PROFILES["kimi-k2.5"]) == 163605
    wrong = BUILTIN_PROFILES["kimi-k2.5"].model_copy(update={"image_token": "<|image_pad|>"})
    with pytest.raises(UserError, match=r"image_token '<\|image_pad\|>' is not a token of the tokenizer"):
        image_token_id(tokenizer, wrong)


def test_token_runs_find_each_expanded_image() -> None:
    assert token_runs([1, 9, 9, 2, 9, 3, 9, 9, 9], 9) == ((1, 3), (4, 5), (6, 9))
    assert token_runs([1, 2], 9) == ()
