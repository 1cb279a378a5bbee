"""Failures of the endpoint are the endpoint's, not the prompts': a rejected key, a model the server no longer
serves, the same refusal to every prompt, or refusals that jump after the first answers stop the run (or drop the
endpoint) with the cause, and no prompt is written as rejected for them; a re-run after the fix asks exactly the
prompts left. A budget helper that fails stops the run instead of freezing the budget.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_generation_faults import assert_exactly_once, run_generation, write_prompt_shards

from eagle3_datagen.artifacts import ShardRef, artifact_path, rejected_path
from eagle3_datagen.config import ValidationConfig
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from tasks.generation import GenerationError

WINDOW = ValidationConfig(early_abort_after=8)


def written_rejections(store: RunStore, refs: list[ShardRef]) -> list[str]:
    """Every rejection written anywhere: in a finished shard's rejected list or in a partial log."""
    reasons = [row["reason"] for ref in refs if store.exists(rejected_path("generations", ref.index))
               for row in store.read_jsonl(rejected_path("generations", ref.index))]
    for log in (Path(store.uri) / "generations").glob("*.partial.jsonl"):
        reasons += [entry["rejected"]["reason"] for entry in map(json.loads, log.read_text().splitlines())
                    if "rejected" in entry]
    return reasons


def generated(store: RunStore, refs: list[ShardRef]) -> int:
    """Prompts answered so far, finished shards and partial logs together."""
    done = sum(len(store.read_jsonl(artifact_path("generations", ref.index))) for ref in refs
               if store.exists(artifact_path("generations", ref.index)))
    for log in (Path(store.uri) / "generations").glob("*.partial.jsonl"):
        answered: set[int] = set()
        for entry in map(json.loads, log.read_text().splitlines()):
            if "records" in entry:
                answered.add(entry["position"])
            elif "discard" in entry:
                answered.discard(entry["position"])
        done += len(answered)
    return done


def resume_asks_exactly_the_rest(store: RunStore, refs: list[ShardRef], prompts: int) -> None:
    kept = generated(store, refs)
    with ScriptedServer(Script()) as server:
        run_generation(store, refs, [server.url], budget=4, validation=WINDOW)
        assert server.log.requests == prompts - kept, "the re-run asks every prompt left, and only those"
    assert assert_exactly_once(store, refs) == (prompts, 0)


def test_a_key_rejected_mid_run_fails_the_run_with_the_fix_and_rejects_no_prompt(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 4, 25)
    rotated = Script(faults=["ok"] * 70 + ["http-401"] * 1000)
    with ScriptedServer(rotated) as server:
        with pytest.raises(GenerationError, match=r"no endpoint is left that accepts requests: HTTP 401 .*"
                                                  r"refuses the API key: set the right key in \$VLLM_API_KEY"):
            run_generation(store, refs, [server.url], budget=4, validation=WINDOW)
        assert server.log.requests <= 70 + 4, "one 401 per request in flight, then nothing more is sent"
    assert written_rejections(store, refs) == []
    assert generated(store, refs) >= 70 - 4, "what was answered before is kept"
    resume_asks_exactly_the_rest(store, refs, 100)


def test_an_endpoint_that_no_longer_serves_the_model_is_dropped_and_the_others_finish(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 30)
    renamed = Script(model="renamed-model", check_model=True)  # restarted under another --served-model-name
    with ScriptedServer(renamed) as stale, ScriptedServer(Script(latency_s=0.01)) as good, \
            caplog.at_level(logging.WARNING, "test"):
        run_generation(store, refs, [stale.url, good.url], budget=4, validation=WINDOW)
        assert good.log.requests == 60
    assert assert_exactly_once(store, refs) == (60, 0), "no prompt is rejected for the endpoint's refusal"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"endpoint {stale.url} refuses every request" in warning and "does not exist" in warning
    alone = RunStore(str(tmp_path), "alone")
    refused_model = r"The model `scripted-model` does not exist.*set model.name"
    with ScriptedServer(renamed) as stale, pytest.raises(GenerationError, match=refused_model):
        run_generation(alone, write_prompt_shards(alone, 1, 10), [stale.url], budget=2)


def test_the_same_refusal_to_many_prompts_in_a_row_is_the_endpoints_and_rejects_none(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 4, 25)
    repeated = r"no endpoint is left .*HTTP 400 .*scripted failure 400 \(the same refusal to 16 different prompts"
    with ScriptedServer(Script(faults=["ok"] * 40 + ["http-400"] * 1000)) as server, \
            pytest.raises(GenerationError, match=repeated):
        run_generation(store, refs, [server.url], budget=4, validation=WINDOW)
    assert written_rejections(store, refs) == [], "the refusals seen before the repetition showed are not kept"
    resume_asks_exactly_the_rest(store, refs, 100)


def test_refusals_that_jump_after_the_window_stop_the_run_and_are_asked_again(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 4, 40)
    with ScriptedServer(Script(faults=["ok"] * 40 + ["refuse"] * 1000)) as server:  # a refusal of each prompt
        with pytest.raises(GenerationError, match=r"stopped: the server refused \d+ of the last 32 requests, more "
                                                  r"than validation.min_accepted_rate 50% allows: .*scripted refusal"):
            run_generation(store, refs, [server.url], budget=4, validation=WINDOW)
        assert server.log.requests < 160
    assert written_rejections(store, refs) == []
    resume_asks_exactly_the_rest(store, refs, 160)


def test_a_budget_helper_that_fails_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `auto`, a reading of the server's load that raises stops the run with its error, not the budget."""
    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("budget rule broke")

    monkeypatch.setattr("tasks.generation.budget.next_limit", broken)
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 200)
    with ScriptedServer(Script(latency_s=0.05)) as server:
        with pytest.raises(RuntimeError, match="budget rule broke"):
            run_generation(store, refs, [server.url], budget="auto")  # type: ignore[arg-type]
        assert server.log.requests < 400
