"""The probe's context check counts exactly the prompts that cannot fit, whatever shortcut it takes."""

from __future__ import annotations

from pathlib import Path

from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunStore
from eagle3_datagen.think_tokens import load_tokenizer, render_generation_prompt
from tasks.health import PromptLengths


def test_prompt_lengths_count_exactly_the_prompts_longer_than_the_room(tiny_model: Path, tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    tokenizer, profile = load_tokenizer(str(tiny_model)), BUILTIN_PROFILES["qwen3"]
    rows = [{"id": f"p{i}", "row": i, "messages": [{"role": "user", "content": "naïve word ✅ " * n}]}
            for i, n in enumerate([1, 5, 40, 200, 7])]
    lengths = PromptLengths(store, [store.write_shard("prompts", 0, rows)], tokenizer, profile)
    exact = [len(tokenizer(render_generation_prompt(tokenizer, row["messages"], profile),
                           add_special_tokens=False)["input_ids"]) for row in rows]
    for room in (0, min(exact), sorted(exact)[2], max(exact) - 1, max(exact)):
        over = [n for n in exact if n > room]
        assert lengths.beyond(room) == (len(over), len(rows), max(over, default=0))
