"""Resuming a shard from its partial log: every logged answer lands at its prompt's current position, once, however
often the log is replayed (a run in object storage keeps it twice: the local spool and the segments)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from eagle3_datagen.artifacts import ShardRef, artifact_path
from eagle3_datagen.conversations import answer_of
from eagle3_datagen.protocol import Completion
from eagle3_datagen.storage import RunStore
from tasks.generation.records import (
    Prompt,
    Replay,
    ShardState,
    finalize_shard,
    log_header,
    new_records,
    partial_log_path,
    place,
    read_log_lines,
    resume_shard,
    rollout_prompt,
)

RUN_ID = "a-run-id"
LOG = logging.getLogger("test")


def single(prompt_id: str) -> dict[str, Any]:
    return {"id": prompt_id, "messages": [{"role": "user", "content": f"question of {prompt_id}"}]}


def conversation(prompt_id: str, turns: int) -> dict[str, Any]:
    """A rollout's prompt row: `turns` user turns, each with the dataset's own answer after it."""
    messages = [{"role": "system", "content": f"You are {prompt_id}."}]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"{prompt_id} question {turn}"},
                     {"role": "assistant", "content": f"the dataset's answer {turn}"}]
    return {"id": prompt_id, "messages": messages, "turns": turns}


SINGLE, RUNNING, ENDED = single("single"), conversation("running", 3), conversation("ended", 2)
ASKED = {"single": 1, "running": 2, "ended": 2}  # generations answered before the run stopped


def prompt_shard(store: RunStore, rows: list[dict[str, Any]]) -> ShardRef:
    return store.write_shard("prompts", 0, [{**row, "row": k} for k, row in enumerate(rows)])


def answer(messages: list[dict[str, Any]]) -> Completion:
    question = messages[-1]["content"]
    return Completion(reasoning=f"thinking about {question}", content=f"answer to {question}", finish_reason="stop",
                      reasoning_source="reasoning", prompt_token_ids=[1, 2], completion_token_ids=[3, 4], usage={},
                      model="scripted-model")


def ask(state: ShardState, prompt: Prompt, generations: int) -> None:
    """Answer a prompt's next `generations` (a conversation may end sooner), logged as the scheduler logs them."""
    for _ in range(generations):
        done = answer(prompt.messages)
        step = None if prompt.rollout is None else prompt.rollout.after(done)
        if not isinstance(step, list):
            ended = None if step is None else step.reason
            state.append(prompt, records=new_records(prompt, [done], ended), **({"ended": ended} if ended else {}))
            return
        state.append(prompt, records=new_records(prompt, [done]))
        prompt = prompt.followed_by(done, step)


def first_prompt(position: int, row: dict[str, Any]) -> Prompt:
    if "turns" in row:
        return rollout_prompt(0, position, row, (), None, None)
    return Prompt(0, position, row["id"], row["messages"], None)


def log_answers(store: RunStore, ref: ShardRef, spill: Any = None) -> None:
    """What a run answered of the shard's prompts (`ASKED`) before it stopped: its partial log (and segments)."""
    state = ShardState(ref, partial_log_path(store, ref.index, RUN_ID), log_header(RUN_ID, ref), spill=spill)
    for position, row in enumerate(store.read_shard_records(ref)):
        ask(state, first_prompt(position, row), ASKED[row["id"]])
    state.close()


def spill_to(store: RunStore) -> Any:
    """Segments written to run storage, as a run in object storage writes them."""
    return lambda rel, lines: store.write_text(rel, "".join(line + "\n" for line in lines))


def record_ids(lines: list[str]) -> list[str]:
    return [json.loads(line)["id"] for line in lines]


def test_answers_logged_before_the_prompts_moved_are_kept_at_their_prompts_new_positions(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RunStore(str(tmp_path), "run")
    log_answers(store, prompt_shard(store, [SINGLE, RUNNING, ENDED]))
    moved = prompt_shard(store, [single("new"), ENDED, RUNNING, SINGLE])  # a row gained in front, the rest reordered
    with caplog.at_level("WARNING"):
        state = resume_shard(store, moved, RUN_ID, None, LOG)
    assert "dropped" not in caplog.text
    assert record_ids(state.entries[1]["lines"]) == ["ended:turn0", "ended:turn1"]
    assert record_ids(state.entries[3]["lines"]) == ["single"]
    assert set(state.entries) == {1, 3}, "only the new prompt and the running conversation are left to ask"
    assert record_ids(state.turns[2]) == ["running:turn0", "running:turn1"]
    assert set(state.turns) == {2}


@pytest.mark.parametrize("row", [SINGLE, RUNNING, ENDED], ids=["single-turn", "running rollout", "ended rollout"])
def test_replaying_a_log_twice_leaves_the_state_of_replaying_it_once(tmp_path: Path, row: dict[str, Any]) -> None:
    store = RunStore(str(tmp_path), "run")
    ref = prompt_shard(store, [row])
    log_answers(store, ref)
    lines = read_log_lines(partial_log_path(store, 0, RUN_ID))

    def replayed(times: int) -> Replay:
        replay = Replay(ref, RUN_ID, lambda: {})
        for _ in range(times):
            replay.apply(lines, "the log")
        return replay

    once, twice = replayed(1), replayed(2)
    assert (twice.entries, twice.turns) == (once.entries, once.turns)
    assert (0 in once.entries) == (row is not RUNNING), "an ended conversation stays ended"


def test_a_turn_that_skips_the_next_one_is_refused_and_changes_nothing() -> None:
    entries: dict[int, dict[str, Any]] = {}
    turns = {0: ["the first turn's record"]}
    assert not place(entries, turns, 0, {"turn": 2, "lines": ["the third turn's record"]})
    assert (entries, turns) == ({}, {0: ["the first turn's record"]})


def test_a_run_in_object_storage_resumes_from_its_spool_and_segments_holding_the_same_answers(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    rows = [SINGLE, RUNNING, ENDED]
    ref = prompt_shard(store, rows)
    log_answers(store, ref, spill_to(store))
    state = resume_shard(store, ref, RUN_ID, spill_to(store), LOG)
    assert set(state.entries) == {0, 2} and set(state.turns) == {1}, "the ended conversation is not asked again"
    outputs = tuple(answer_of(json.loads(line)) for line in state.turns[1])
    ask(state, rollout_prompt(0, 1, rows[1], outputs, None, None), 1)  # the running conversation's last turn
    assert state.complete
    finalize_shard(store, state)
    assert [record["id"] for record in store.read_jsonl(artifact_path("generations", 0))] == [
        "single", "running:turn0", "running:turn1", "running:turn2", "ended:turn0", "ended:turn1"]


def test_a_run_pinned_with_a_relative_source_resumes_once_sources_are_recorded_absolute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run pinned before local sources were made absolute wrote `data.jsonl`; its re-run names the same file
    absolutely, and is not refused for it. Another file still is."""
    from eagle3_datagen.config import GenerationConfig
    from eagle3_datagen.profiles import BUILTIN_PROFILES
    from tasks.generation.records import GenerationError, GenerationSettings, pin_settings

    monkeypatch.chdir(tmp_path)
    store = RunStore(str(tmp_path), "run")

    def settings(source: str) -> GenerationSettings:
        return GenerationSettings("m", BUILTIN_PROFILES["qwen3"], GenerationConfig(max_tokens=64), source)

    run_id, fresh = pin_settings(store, settings("data.jsonl"))
    assert fresh
    assert pin_settings(store, settings(str(tmp_path / "data.jsonl"))) == (run_id, False)
    with pytest.raises(GenerationError, match="generated with other settings"):
        pin_settings(store, settings(str(tmp_path / "other.jsonl")))
