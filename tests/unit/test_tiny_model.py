"""The tiny demo model: deterministic, Qwen3-like tokens and template (including Qwen3's reasoning trap)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from eagle3_datagen.testing.tiny_model import build_tiny_model

USER = [{"role": "user", "content": "What is 2 plus 2?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    # A few training steps are enough to show it: the full build runs the same code for longer.
    first = _hashes(build_tiny_model(tmp_path / "a", seed=3, steps=2, check_margin=False))
    second = _hashes(build_tiny_model(tmp_path / "b", seed=3, steps=2, check_margin=False))
    assert first == second
    assert {"model.safetensors", "tokenizer.json", "config.json", "generation_config.json", "README.md"} <= set(first)


def test_model_shape(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["dtype"]) == (8, 64, "float32")
    assert config["tie_word_embeddings"] is True


def test_think_tags_are_single_non_special_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    for tag in ("<think>", "</think>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1, tag
    assert "<think>" not in tokenizer.all_special_tokens
    assert "</think>" not in tokenizer.all_special_tokens
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer.encode("<|im_start|><think>\nr\n</think>\n\na<|im_end|>", add_special_tokens=False)
    # The reasoning parser reads text decoded with skip_special_tokens: the think tags must survive it.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nr\n</think>\n\na"


def test_template_thinking_switch(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n"
    render = tokenizer.apply_chat_template
    assert render(USER, tokenize=False, add_generation_prompt=True) == prompt
    assert render(USER, tokenize=False, add_generation_prompt=True, enable_thinking=True) == prompt
    off = render(USER, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == prompt + "<think>\n\n</think>\n\n"


def test_template_drops_reasoning_of_completed_turns(tokenizer: PreTrainedTokenizerBase) -> None:
    """The trap (facts §2): re-rendering a conversation does not give back the reasoning the model wrote."""
    render = tokenizer.apply_chat_template
    earlier = {"role": "assistant", "content": "Four.", "reasoning_content": "SECRET"}
    history = render([*USER, earlier, {"role": "user", "content": "And 3 plus 3?"}], tokenize=False)
    assert "Four." in history
    assert "SECRET" not in history
    assert "<think>" not in history
    # vLLM returns the field as `reasoning`; Qwen3's template only reads `reasoning_content`.
    final = render([*USER, {"role": "assistant", "content": "Four.", "reasoning": "SECRET"}], tokenize=False)
    assert final.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nFour.<|im_end|>\n")
    # The safe way: the generation prompt plus the reply's own pieces (or the server's token ids).
    prompt = render(USER, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False) + tokenizer.encode(
        "<think>\nSECRET\n</think>\n\nFour.<|im_end|>", add_special_tokens=False
    )
    assert "SECRET" in tokenizer.decode(ids)


def test_a_model_that_did_not_learn_its_format_with_margin_is_refused_at_build(tmp_path: Path) -> None:
    """Two steps teach nothing: the build says so with the margin it measured, and writes no model."""
    with pytest.raises(RuntimeError, match=r"did not learn its format with margin: \d+ of \d+ reply positions"):
        build_tiny_model(tmp_path / "untrained", seed=3, steps=2)
    assert not (tmp_path / "untrained").exists()
