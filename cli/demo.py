"""The embedded default: the tiny local reasoning model on a real vLLM CPU server, local storage, Prefect local mode."""

from __future__ import annotations

import os
import time
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3_datagen.config import PipelineConfig, parse_config
from eagle3_datagen.errors import UserError
from eagle3_datagen.testing.vllm_server import LAUNCHER, REPO_ROOT, vllm_python

DEMO_MODEL_NAME = "tiny-reasoner"
DEMO_VLM_NAME = "tiny-vision-reasoner"
DEMO_IMAGE_ROWS = 48


class DemoNeedsCheckout(UserError):
    """The demo runs vLLM from files of the repository that the installed package does not hold."""


def check_checkout() -> None:
    """Stop in one line where the demo cannot start its server: outside a checkout (the vLLM launcher is in
    infra/, the tiny model goes to build/) or in one without the vLLM environment that `make setup` builds."""
    if not LAUNCHER.is_file():
        raise DemoNeedsCheckout(
            f"`eagle3-datagen demo` runs from a checkout of the eagle3-datagen repository (its vLLM launcher "
            f"{LAUNCHER} is missing): clone the repository, then run `make demo` in it"
        )
    try:
        vllm_python()
    except FileNotFoundError as missing:
        raise DemoNeedsCheckout(str(missing)) from None


def demo_questions() -> Path:
    return Path(str(resources.files("eagle3_datagen") / "data" / "demo_questions.jsonl"))


def tiny_model_dir() -> Path:
    """The tiny model built by `make` (or EAGLE3_TINY_MODEL); built here if it is missing."""
    folder = Path(os.environ.get("EAGLE3_TINY_MODEL", REPO_ROOT / "build" / "tiny-model"))
    if not (folder / "config.json").exists():
        from eagle3_datagen.testing.tiny_model import build_tiny_model

        build_tiny_model(folder)
    return folder


def demo_config(model_dir: Path, endpoint: str, output_uri: Path, run_name: str = "demo") -> PipelineConfig:
    return parse_config({
        "run_name": run_name,
        "output_uri": str(output_uri),
        "data": {"source": str(demo_questions()), "shard_size": 16},
        "model": {"name": DEMO_MODEL_NAME, "profile": "qwen3", "tokenizer": str(model_dir)},
        "server": {"endpoints": [endpoint], "max_in_flight": 16, "startup_timeout_s": 120},
        "generation": {"max_tokens": 256, "temperature": 0.7, "top_p": 0.9, "seed": 0},
        "sequences": {"max_seq_len": 2048},
        "hidden_states": {"backend": "transformers", "model": str(model_dir), "dtype": "float32"},
    })


def tiny_vlm_dir() -> Path:
    """The tiny vision-language model built by `make` (or EAGLE3_TINY_VLM); built here if it is missing."""
    folder = Path(os.environ.get("EAGLE3_TINY_VLM", REPO_ROOT / "build" / "tiny-vlm"))
    if not (folder / "config.json").exists():
        from eagle3_datagen.testing.tiny_vlm import build_tiny_vlm

        build_tiny_vlm(folder, tiny_model_dir())
    return folder


def image_demo_config(model_dir: Path, endpoint: str, output_uri: Path, source: Path,
                      run_name: str = "demo-images") -> PipelineConfig:
    """The demo on pictures: the tiny vision-language model (qwen3's profile and its image token), half the
    prompts asked with thinking on, half with it off."""
    from eagle3_datagen.profiles import BUILTIN_PROFILES
    from eagle3_datagen.testing.tiny_vlm import IMAGE_TOKEN

    tree = demo_config(model_dir, endpoint, output_uri, run_name).model_dump(mode="json", exclude_unset=True)
    profile = {**BUILTIN_PROFILES["qwen3"].model_dump(mode="json"), "image_token": IMAGE_TOKEN}
    return parse_config({
        **tree,
        "data": {"source": str(source), "shard_size": 16, "holdout": 0},
        "profiles": {"tiny-vlm": profile},
        "model": {"name": DEMO_VLM_NAME, "profile": "tiny-vlm", "tokenizer": str(model_dir)},
        "generation": {**tree["generation"], "modes": [{"mode": "thinking", "weight": 0.5},
                                                       {"mode": "instant", "weight": 0.5}]},
        "validation": {"max_unexpected_reasoning_rate": 0.5, "max_unclosed_reasoning_rate": 0.5},
    })


def run_demo(output_uri: Path, images: bool = False) -> dict[str, Any]:
    """Start the vLLM CPU server on the tiny model, run the whole pipeline on the demo questions, stop it. With
    `images`, the tiny vision-language model on a small dataset of drawn shapes instead."""
    from cli.runner import run_pipeline
    from eagle3_datagen.testing.vllm_server import LocalVLLMServer

    check_checkout()
    model_dir = tiny_vlm_dir() if images else tiny_model_dir()
    started = time.monotonic()
    log_path = output_uri / ("demo-images-vllm-server.log" if images else "demo-vllm-server.log")
    output_uri.mkdir(parents=True, exist_ok=True)
    served = DEMO_VLM_NAME if images else DEMO_MODEL_NAME
    extra = ["--limit-mm-per-prompt", '{"image": 4}'] if images else []
    with LocalVLLMServer(model_dir, served_name=served, reasoning_parser="qwen3", log_path=log_path,
                         extra_args=extra) as server:
        server_ready = time.monotonic() - started
        if images:
            from eagle3_datagen.testing.tiny_vlm import write_image_dataset

            source = write_image_dataset(output_uri / "demo-images-data", DEMO_IMAGE_ROWS)
            config = image_demo_config(model_dir, server.url, output_uri, source)
        else:
            config = demo_config(model_dir, server.url, output_uri)
        summary = run_pipeline(config)
    return {**summary, "stages": [f"vLLM CPU server ready in {server_ready:.1f}s (log: {log_path})",
                                  *summary["stages"]]}
