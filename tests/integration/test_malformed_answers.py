"""A malformed answer (a 200 whose body breaks the protocol) is the endpoint's failure, retried with back-off like a
5xx, and never crashes the run. A prompt answered malformed on every try while the endpoint answers the others is
rejected with that answer's error, so its shard finishes and no re-run asks it again; an endpoint that answers
every prompt malformed is given up on instead, and its prompts are asked elsewhere or by the next run, never
rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_generation_faults import assert_exactly_once, run_generation, write_prompt_shards

from eagle3_datagen.artifacts import artifact_path, rejected_path
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, questions
from tasks.generation import GenerationError

MAX_RETRIES = 2


def test_a_prompt_always_answered_with_a_broken_body_is_rejected_with_its_reason_and_never_asked_again(
        tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 6)
    with ScriptedServer(Script(broken_for="question 0-3")) as server:
        run_generation(store, refs, [server.url], budget=2, max_retries=MAX_RETRIES)
        asked = questions(server.log.bodies)
        assert asked.count("question 0-3") == 1 + MAX_RETRIES, "a broken answer is retried"
        assert sorted(set(asked)) == [f"question 0-{i}" for i in range(6)] and len(asked) == 5 + 1 + MAX_RETRIES
        run_generation(store, refs, [server.url], budget=2, max_retries=MAX_RETRIES)
        assert server.log.requests == len(asked), "a re-run asks nothing again"
    assert store.exists(artifact_path("generations", 0)), "the shard is finished"
    assert assert_exactly_once(store, refs) == (5, 1)
    [rejected] = store.read_jsonl(rejected_path("generations", 0))
    assert rejected["id"] == "p0-3" and rejected["stage"] == "generations"
    assert rejected["reason"].startswith(f"malformed answer to each of {1 + MAX_RETRIES} tries: {server.url}")
    assert "a choice is not an object" in rejected["reason"] and "\n" not in rejected["reason"]


def test_an_endpoint_that_answers_every_prompt_malformed_is_given_up_on_and_its_prompts_asked_elsewhere(
        tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 10)
    with (ScriptedServer(Script(broken_for="question")) as broken,
          ScriptedServer(Script(latency_s=0.2)) as healthy):
        run_generation(store, refs, [broken.url, healthy.url], budget=1, max_retries=1, max_consecutive_errors=6)
        assert broken.log.requests == 6, "given up on after server.max_consecutive_errors malformed answers"
    assert assert_exactly_once(store, refs) == (20, 0), "no prompt is rejected for the endpoint's answers"


def test_a_run_whose_only_endpoint_answers_every_prompt_malformed_rejects_none_and_resumes_after_the_fix(
        tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 10)
    with (ScriptedServer(Script(broken_for="question")) as broken,
          pytest.raises(GenerationError, match=r"gave up: every endpoint answered 7 requests in a row with an error")):
        # three prompts end malformed on both their tries before the seventh broken answer gives the endpoint up
        run_generation(store, refs, [broken.url], budget=1, max_retries=1, max_consecutive_errors=7)
    assert broken.log.requests == 7
    partial = tmp_path / "run" / "generations" / "shard-00000.partial.jsonl"
    assert not partial.exists() or not any("rejected" in json.loads(line) for line in partial.read_text().splitlines())
    with ScriptedServer(Script()) as fixed:
        run_generation(store, refs, [fixed.url], budget=1)
        assert sorted(questions(fixed.log.bodies)) == [f"question 0-{i}" for i in range(10)], "each asked once"
    assert assert_exactly_once(store, refs) == (10, 0)
