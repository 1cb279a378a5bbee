"""A server that answers one prompt with a 200 whose body breaks the protocol: that answer is the endpoint's
failure, retried with back-off like a 5xx, and never crashes the run; every other prompt is answered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_generation_faults import run_generation, write_prompt_shards

from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from tasks.generation import GenerationError

MAX_RETRIES = 2


def test_a_prompt_always_answered_with_a_broken_body_is_retried_and_the_others_are_kept(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 6)
    with (ScriptedServer(Script(broken_for="question 0-3")) as server,
          pytest.raises(GenerationError, match=r"1 records could not be generated.*run again to resume")):
        run_generation(store, refs, [server.url], budget=2, max_retries=MAX_RETRIES)
    asked = [body["messages"][-1]["content"] for body in server.log.bodies]
    assert asked.count("question 0-3") == 1 + MAX_RETRIES, "a broken answer is retried"
    partial = tmp_path / "run" / "generations" / "shard-00000.partial.jsonl"
    kept = [entry["id"] for line in partial.read_text().splitlines() if "records" in (entry := json.loads(line))]
    assert sorted(kept) == ["p0-0", "p0-1", "p0-2", "p0-4", "p0-5"]
