"""Build a tiny vision-language reasoning model offline, so the image-prompt tests and the demo can serve a real VLM.

vLLM's Qwen-VL and LLaVA paths need torchvision, which this project cannot install; Idefics3 (the SmolVLM family)
does not: its PIL image processor tiles an image without it, and vLLM's CPU server serves it with images. So this is
a ~0.55 M-parameter `Idefics3ForConditionalGeneration` (a Llama text model, a SigLIP-like vision tower and a
pixel-shuffle connector) on the tiny text model's tokenizer (build/tiny-model) plus Idefics3's image tokens.

It is trained for a few minutes of one CPU thread on synthetic pictures (one coloured shape on a light
background, drawn with Pillow) and questions about them, plus some of the tiny text model's conversations, to answer
in Qwen3's format `<think>\\n{reasoning}\\n</think>\\n\\n{answer}<|im_end|>` (vLLM's `qwen3` reasoning parser) with
margin, and to name the colour and shape it sees more often than chance. Deterministic: the same seed and tokenizer
give the same bytes.

Usage: `python -m eagle3_datagen.testing.tiny_vlm --out build/tiny-vlm [--tokenizer build/tiny-model]`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    PreTrainedModel,
)
from transformers.utils import logging as transformers_logging

from eagle3_datagen.testing.tiny_model import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    PAD,
    THINK_END,
    THINK_START,
    Row,
    _checked,
    _pad,
    _save,
    _train_with_margin,
    _training_conversations,
    format_margin,
)

# Idefics3's image markup. The processor expands each `<image>` of the rendered prompt into
# `<fake_token_around_image><row_R_col_C>` + IMAGE_SEQ_LEN x `<image>` per tile, then the same for the
# `<global-img>` (the whole picture downscaled), closed by `<fake_token_around_image>`.
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"  # Idefics3's processor insists on it; the template ends turns with <|im_end|>
TILE_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2))
IMAGE_MARKUP = (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN, *TILE_TOKENS)
TILE = 56  # the vision tower's input side: 4 x 4 patches of 14 px
LONGEST_EDGE = 112  # a picture is resized to this longest edge, then cut into at most 2 x 2 tiles
IMAGE_SEQ_LEN = 4  # (56 / 14)^2 patches / scale_factor^2: image tokens per tile

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {
    "red": (215, 35, 35), "green": (40, 150, 60), "blue": (35, 75, 215), "yellow": (235, 205, 25),
    "black": (25, 25, 25),
}
BACKGROUNDS = {"white": (255, 255, 255), "light grey": (232, 232, 232), "cream": (250, 243, 222)}
MIN_SIDE, MAX_SIDE = 40, 160

QUESTIONS = {
    "shape": ["What shape is in the picture?", "Which shape do you see?", "What is the shape in this image?",
              "Name the shape in the picture."],
    "colour": ["What colour is the shape?", "What color is the shape in the image?", "Which colour do you see?",
               "What is the colour of the shape?"],
    "describe": ["Describe the image.", "What is in this picture?", "Describe what you see.",
                 "What does the image show?"],
}
_ASKS = {"shape": "The user asks for the shape.", "colour": "The user asks for the colour.",
         "describe": "The user wants a short description."}
_ANSWERS = {"shape": ["It is a {shape}.", "The shape is a {shape}."],
            "colour": ["The shape is {colour}.", "It is {colour}."],
            "describe": ["A {colour} {shape} on a light background.", "The image shows a {colour} {shape}."]}
KINDS = tuple(sorted(QUESTIONS))
INSTANT = 1 / 6  # the share of rows with thinking off (the template pre-fills an empty think block)
_SEEN = "The picture shows a"  # the reasoning opens with what is seen: "... a {colour} {shape}."

IMAGE_ROWS = 1200  # training rows with a picture (400 pictures, one question of each kind)
TEXT_ROWS = 240  # the tiny text model's conversations (its 40 demo prompts four times, then others)
MARGIN_ROWS = (192, 64)  # image and text rows the format margin is checked on
HELD_OUT = 120  # fresh pictures the colour and shape words are checked on
STEPS = 300

MODEL_README = """# Tiny demo vision-language reasoning model (eagle3-datagen)

Built offline by `python -m eagle3_datagen.testing.tiny_vlm`: a {params:,}-parameter
`Idefics3ForConditionalGeneration` (float32), the SmolVLM architecture, chosen because vLLM serves it on a CPU
without torchvision:

- text model: Llama, hidden 64, intermediate 128, 8 layers, 2 heads, 1 KV head, head_dim 32, tied embeddings;
- vision tower: SigLIP-like, hidden 64, 2 layers, 2 heads, 56 px input, 14 px patches (16 patches a tile);
- connector: pixel shuffle (scale factor 2), so {seq} image tokens a tile.

Tokenizer: the tiny text model's byte-level BPE ({base_vocab} ids) plus Idefics3's image tokens ({vocab} ids in all):
{markup}. The image processor (`Idefics3ImageProcessorPil`) resizes a picture to a longest edge of {edge} px and cuts
it into {tile} px tiles (1 x 2, 2 x 1 or 2 x 2) plus a downscaled global tile; `<image>` in the rendered prompt
becomes `<fake_token_around_image><row_R_col_C>` + {seq} x `<image>` per tile, then `<global-img>` + {seq} x
`<image>`.

Chat template: the tiny text model's Qwen3-style one, with list content rendered (`image` / `image_url` parts as
`<image>`, text parts as their text); `chat_template_kwargs={{"enable_thinking": false}}` pre-fills an empty think
block. Reasoning: `<think>\\n{{reasoning}}\\n</think>\\n\\n{{answer}}<|im_end|>` (`--reasoning-parser qwen3`).

Trained for {steps} steps (AdamW, batch 32, one CPU thread) on {image_rows} questions about {pictures} synthetic
pictures (a {shapes} in {colours} on a light background, {lo} to {hi} px a side) and {text_rows} of the tiny text
model's conversations; a sixth of them with thinking off. Its words are canned; it is not a useful model.

- Format margin on taught replies (temperature 0.7): {margin}.
- Image dependence, teacher-forced on {held_out} fresh pictures (chance {colour_chance:.0%} and {shape_chance:.0%}):
  colour word right {colour_acc:.0%}, shape word right {shape_acc:.0%}.
"""


def shape_image(shape: str, colour: str, width: int, height: int, background: str = "white") -> Image.Image:
    """One `colour` `shape` centred on a plain `background`: the pictures the tiny VLM was trained on."""
    image = Image.new("RGB", (width, height), BACKGROUNDS[background])
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    side = 0.7 * min(width, height)
    cx, cy, r = width / 2, height / 2, side / 2
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    elif shape == "star":
        points = [(cx + (r if k % 2 == 0 else 0.4 * r) * math.sin(k * math.pi / 5),
                   cy - (r if k % 2 == 0 else 0.4 * r) * math.cos(k * math.pi / 5)) for k in range(10)]
        draw.polygon(points, fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    return image


def _random_picture(rng: random.Random) -> tuple[str, str, int, int, str]:
    """(shape, colour, width, height, background): sides drawn apart, so the tiling varies (1x2, 2x1, 2x2)."""
    return (rng.choice(SHAPES), rng.choice(sorted(COLOURS)), rng.randint(MIN_SIDE, MAX_SIDE),
            rng.randint(MIN_SIDE, MAX_SIDE), rng.choice(sorted(BACKGROUNDS)))


def write_image_dataset(folder: Path, rows: int, seed: int = 0) -> Path:
    """Pictures under `folder/images/` and `folder/prompts.jsonl` of OpenAI-shaped rows asking about them
    (`{"id", "messages"}`, the image an `image_url` part whose url is relative to the jsonl's folder); returns the
    jsonl path. The same seed writes the same bytes."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for index in range(rows):
        shape, colour, width, height, background = _random_picture(rng)
        question = rng.choice(QUESTIONS[rng.choice(sorted(QUESTIONS))])
        name = f"{index:05d}-{colour}-{shape}.png"
        shape_image(shape, colour, width, height, background).save(folder / "images" / name, format="PNG")
        content = [{"type": "image_url", "image_url": {"url": f"images/{name}"}}, {"type": "text", "text": question}]
        lines.append(json.dumps({"id": f"image-{index:05d}", "messages": [{"role": "user", "content": content}]}))
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def chat_template() -> str:
    """The tiny text model's template, rendering list content: image parts as `<image>`, text parts as text."""
    plain = "{%- set content = message.content if message.content is string else '' -%}"
    parts = ("{%- if message.content is string -%}{%- set content = message.content -%}{%- else -%}"
             "{%- set parts = namespace(text='') -%}{%- for part in message.content -%}"
             "{%- if part.type == 'image' or part.type == 'image_url' -%}{%- set parts.text = parts.text + '"
             + IMAGE_TOKEN + "' -%}"
             "{%- elif part.type == 'text' -%}{%- set parts.text = parts.text + part.text -%}{%- endif -%}"
             "{%- endfor -%}{%- set content = parts.text -%}{%- endif -%}")
    assert CHAT_TEMPLATE.count(plain) == 1, "tiny_model.CHAT_TEMPLATE changed: update the list-content rendering"
    return CHAT_TEMPLATE.replace(plain, parts)


def _processor(tokenizer_dir: Path) -> Idefics3Processor:
    """The text model's tokenizer with Idefics3's image tokens, and the tiling image processor."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_MARKUP)})
    images = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE},
                                       do_image_splitting=True)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, chat_template=chat_template(),
                             image_seq_len=IMAGE_SEQ_LEN)


def _reply(kind: str, shape: str, colour: str, rng: random.Random) -> tuple[str, str]:
    """Canned (reasoning, answer): the reasoning names colour and shape first, then what is asked."""
    reasoning = f"{_SEEN} {colour} {shape}. {_ASKS[kind]}"
    return reasoning, rng.choice(_ANSWERS[kind]).format(shape=shape, colour=colour)


def _image_rows(processor: Idefics3Processor, rng: random.Random, pictures: int, kinds: Sequence[str] = KINDS,
                instant: float = INSTANT) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """(prompt ids, reply ids, pixel tiles) rows: one question of each kind per picture, the image part first
    mostly, after the text sometimes, a system prompt now and then; a share `instant` with thinking off."""
    tokenizer = processor.tokenizer
    rows = []
    for index in range(pictures * len(kinds)):
        if index % len(kinds) == 0:
            shape, colour, width, height, background = _random_picture(rng)
            image = shape_image(shape, colour, width, height, background)
            tiles = None
        kind = kinds[index % len(kinds)]
        parts = [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS[kind])}]
        if rng.random() < 0.2:
            parts.reverse()
        messages = [{"role": "user", "content": parts}]
        if rng.random() < 0.1:
            messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        thinking = rng.random() >= instant
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=thinking)
        encoded = processor(text=[prompt], images=[[image]], return_tensors="pt")
        tiles = encoded["pixel_values"][0] if tiles is None else tiles  # the same picture: its tiles shared
        reasoning, answer = _reply(kind, shape, colour, rng)
        reply = f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n{answer}{IM_END}" if thinking else f"{answer}{IM_END}"
        rows.append((encoded["input_ids"][0].tolist(), tokenizer.encode(reply), tiles))
    return rows


def _text_rows(processor: Idefics3Processor, rng: random.Random, count: int) -> list[tuple[list[int], list[int]]]:
    """The tiny text model's conversations, so text-only prompts keep working."""
    tokenizer = processor.tokenizer
    rows = []
    for messages, reasoning, answer in _training_conversations(rng, count):
        thinking = rng.random() >= INSTANT
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=thinking)
        reply = f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n{answer}{IM_END}" if thinking else f"{answer}{IM_END}"
        rows.append((tokenizer.encode(prompt), tokenizer.encode(reply)))
    return rows


def vlm_reply_logits(model: PreTrainedModel, chunk: Sequence[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tiny_model's reply logits, with each row's image tiles fed in row order (Idefics3 scatters the tiles'
    features over the `<image>` ids in that order); text-only rows carry no tiles."""
    ids, labels = _pad(chunk, pad_id)
    tiles = [row[2] for row in chunk if len(row) > 2]
    pixels = torch.cat(tiles)[None] if tiles else None
    hidden = model.model(input_ids=ids, pixel_values=pixels, use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    predicted = targets != -100
    return model.lm_head(hidden[:, :-1][predicted]), targets[predicted]


def _image_accuracy(model: PreTrainedModel, processor: Idefics3Processor, rng: random.Random,
                    pictures: int) -> tuple[float, float]:
    """Teacher-forced on fresh pictures (thinking rows): how often the reasoning's most likely next token is the
    first token of the right colour word, and of the right shape word. Chance is 1/5 and 1/4."""
    tokenizer = processor.tokenizer
    rows = _image_rows(processor, rng, pictures, kinds=("describe",), instant=0.0)
    seen = tokenizer.encode(f"{THINK_START}\n{_SEEN}")
    right = [0, 0]
    with torch.no_grad():
        for start in range(0, len(rows), 8):
            chunk = rows[start : start + 8]
            logits, _ = vlm_reply_logits(model, chunk, tokenizer.pad_token_id)
            offset = 0
            for _prompt, reply, _tiles in chunk:
                assert reply[: len(seen)] == seen
                colour_at = len(seen)
                shape_at = colour_at + next(k for k in range(1, 6) if tokenizer.decode(reply[colour_at + k])[0] == " ")
                for slot, at in enumerate((colour_at, shape_at)):
                    right[slot] += int(logits[offset + at].argmax()) == reply[at]
                offset += len(reply)
    return right[0] / len(rows), right[1] / len(rows)


def build_tiny_vlm(out_dir: Path, tokenizer_dir: Path, seed: int = 0, steps: int = STEPS,
                   check_margin: bool = True) -> Path:
    """Build processor + trained model into `out_dir` and return it; same seed, same bytes. Refuses a model that
    keeps its format without margin (tiny_model's `FormatMargin`), unless `check_margin` is off."""
    out_dir = Path(out_dir)
    rng = random.Random(seed)
    processor = _processor(Path(tokenizer_dir))
    tokenizer = processor.tokenizer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as tiny_model: the weights depend on the thread count, and one thread never stalls
    try:
        image_rows = _image_rows(processor, rng, IMAGE_ROWS // len(QUESTIONS))
        text_rows = _text_rows(processor, rng, TEXT_ROWS)
        rows: list[Row] = [*image_rows, *text_rows]
        margin_rows = [*image_rows[: MARGIN_ROWS[0]], *text_rows[: MARGIN_ROWS[1]]]
        pad_id = tokenizer.pad_token_id
        text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 2048,
                "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": pad_id, "rope_theta": 10000.0}
        vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "image_size": TILE, "patch_size": 14}
        # The top-level pad id is the text model's (Idefics3Config's default, 128002, is outside this vocabulary).
        config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2, tie_word_embeddings=True,
                                image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), pad_token_id=pad_id)
        structural = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END, IM_END, PAD, IM_START, *IMAGE_MARKUP])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _train_with_margin(Idefics3ForConditionalGeneration(config), rows, rng, pad_id, steps,
                                       structural, margin_rows, reply_logits=vlm_reply_logits)
            margin = format_margin(model, margin_rows, structural, pad_id, reply_logits=vlm_reply_logits)
            colour_acc, shape_acc = _image_accuracy(model, processor, random.Random(seed + 1), HELD_OUT)
    finally:
        torch.set_num_threads(threads)
    if check_margin:
        _checked(margin)
    readme = MODEL_README.format(
        params=sum(p.numel() for p in model.parameters()), seq=IMAGE_SEQ_LEN, base_vocab=len(tokenizer) - len(
            IMAGE_MARKUP), vocab=len(tokenizer), markup=", ".join(f"`{t}`" for t in IMAGE_MARKUP), edge=LONGEST_EDGE,
        tile=TILE, steps=steps, image_rows=len(image_rows), pictures=len(image_rows) // len(QUESTIONS),
        shapes=" / ".join(SHAPES), colours=" / ".join(COLOURS), lo=MIN_SIDE, hi=MAX_SIDE, text_rows=len(text_rows),
        margin=margin, held_out=HELD_OUT, colour_chance=1 / len(COLOURS), shape_chance=1 / len(SHAPES),
        colour_acc=colour_acc, shape_acc=shape_acc,
    )
    verbosity = transformers_logging.get_verbosity()
    # Saving instantiates a default Idefics3Config to diff against, whose own pad id (128002) lies outside its
    # default 32000-id vocabulary: transformers warns about that default, not about this model.
    transformers_logging.set_verbosity_error()
    try:
        return _save(out_dir, model, processor, [tokenizer.eos_token_id, pad_id], readme)
    finally:
        transformers_logging.set_verbosity(verbosity)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model into")
    parser.add_argument("--tokenizer", type=Path, default=Path("build/tiny-model"),
                        help="the tiny text model's folder, whose tokenizer is extended (default: build/tiny-model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    started = time.monotonic()
    out_dir = build_tiny_vlm(args.out, args.tokenizer, seed=args.seed, steps=args.steps)
    params = sum(t.numel() for t in load_file(out_dir / "model.safetensors").values())
    notes = (out_dir / "README.md").read_text(encoding="utf-8").splitlines()[-3:]
    print(f"tiny VLM ({params:,} parameters) written to {out_dir} in {time.monotonic() - started:.0f} s.")
    print("\n".join(notes))


if __name__ == "__main__":
    main()

