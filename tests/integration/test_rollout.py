"""Rollouts on the scripted server: each turn asked on the target's own earlier answers, ended by a refusal,
resumed after a kill at the next unanswered turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_generation_faults import run_generation

from eagle3_datagen.artifacts import ShardRef, artifact_path, prompt_id_of, rejected_path
from eagle3_datagen.conversations import TOOL_RESULT_MISSING, Ended, answer_of, next_turn
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, expected_content
from tasks.generation import GenerationError
from tasks.prompts import write_prompt_shards
from tasks.verify import verify_run


def conversations(count: int, turns: int) -> list[dict[str, Any]]:
    """Rows of `turns` user turns, each with the dataset's own (another model's) answer after it."""
    rows = []
    for c in range(count):
        messages: list[dict[str, str]] = [{"role": "system", "content": f"You are helper {c}."}]
        for t in range(turns):
            messages += [{"role": "user", "content": f"conversation {c} question {t}"},
                         {"role": "assistant", "content": f"the dataset's answer {c}.{t}"}]
        rows.append({"messages": messages})
    return rows


def rollout_shards(store: RunStore, count: int, turns: int, shard_size: int = 4) -> list[ShardRef]:
    return write_prompt_shards(conversations(count, turns), store, shard_size, turns="rollout").shards


def records_of(store: RunStore, refs: list[ShardRef]) -> list[dict[str, Any]]:
    return [record for ref in refs if store.exists(artifact_path("generations", ref.index))
            for record in store.read_jsonl(artifact_path("generations", ref.index))]


def assert_transcripts(store: RunStore, refs: list[ShardRef]) -> dict[str, list[dict[str, Any]]]:
    """Every kept turn was asked on the turns before it, as the server answered them; returns the turns of each
    conversation in order."""
    scripts = {prompt["id"]: prompt for ref in refs for prompt in store.read_jsonl(ref.path)}
    turns: dict[str, list[dict[str, Any]]] = {}
    for record in records_of(store, refs):
        turns.setdefault(prompt_id_of(record["id"]), []).append(record)
    for conversation, kept in turns.items():
        assert [r["turn"] for r in kept] == list(range(len(kept))), f"{conversation}: turns out of order or twice"
        for record in kept:
            earlier = [answer_of(r) for r in kept[: record["turn"]]]
            assert record["messages"] == next_turn(scripts[conversation]["messages"], earlier)
            assert record.get("tool_calls") or record["content"] == expected_content(record["messages"][-1]["content"])
    return turns


def test_each_turn_is_asked_on_the_targets_own_earlier_answers(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = rollout_shards(store, count=10, turns=3)
    assert [ref.num_records for ref in refs] == [4, 4, 2], "one prompt per conversation"
    with ScriptedServer(Script(latency_s=0.01)) as server:
        run_generation(store, refs, [server.url], budget=4)
        bodies = list(server.log.bodies)
    turns = assert_transcripts(store, refs)
    assert sorted(map(len, turns.values())) == [3] * 10
    assert len(bodies) == 30, "every turn asked once"
    sent_history = [m["content"] for body in bodies for m in body["messages"] if m["role"] == "assistant"]
    assert sent_history and not [text for text in sent_history if "the dataset's answer" in text]
    first, second = turns[next(iter(turns))][:2]
    assert first["messages"][-1] == {"role": "user", "content": first["messages"][-1]["content"]}
    assert second["messages"][-2] == {"role": "assistant", "content": first["content"]}


def test_a_refused_turn_ends_its_conversation_and_keeps_the_turns_before_it(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = rollout_shards(store, count=6, turns=3, shard_size=6)
    with ScriptedServer(Script(refused_for="conversation 2 question 1")) as server:
        run_generation(store, refs, [server.url], budget=2)
        asked = [body["messages"][-1]["content"] for body in server.log.bodies]
    turns = assert_transcripts(store, refs)
    ended = [c for c, kept in turns.items() if len(kept) < 3]
    assert len(ended) == 1 and len(turns[ended[0]]) == 1, "the turn before the refused one stays"
    assert "conversation 2 question 2" not in asked, "no turn is asked after a refused one"
    assert asked.count("conversation 2 question 1") == 1
    rejected = store.read_jsonl(rejected_path("generations", 0))
    assert [(prompt_id_of(r["id"]), r["id"].rsplit(":", 1)[1]) for r in rejected] == [(ended[0], "turn1")]
    assert "400" in rejected[0]["reason"]


KILLABLE = """
import logging, sys
sys.path.insert(0, {tests!r})
from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import ServerConfig, ValidationConfig
from eagle3_datagen.storage import RunStore
from tasks.generation import generate_shards
from test_generation_faults import settings
refs = {refs!r}
server = ServerConfig(endpoints=[{url!r}], max_in_flight=4)
generate_shards(RunStore({root!r}, "run"), refs, settings(), server, ValidationConfig(), logging.getLogger("child"))
"""


def test_a_killed_rollout_resumes_at_each_conversations_next_turn_and_asks_no_answered_turn_again(
        tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = rollout_shards(store, count=24, turns=4, shard_size=8)
    logs = [tmp_path / "run" / "generations" / f"shard-{i:05d}.partial.jsonl" for i in range(3)]
    with ScriptedServer(Script(latency_s=0.03)) as server:
        code = KILLABLE.format(tests=str(Path(__file__).parent), url=server.url, root=str(tmp_path), refs=refs)
        child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        deadline = time.monotonic() + 60
        while sum(len(log.read_text().splitlines()) for log in logs if log.exists()) < 20:
            assert child.poll() is None and time.monotonic() < deadline, "child ended before it could be killed"
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        answered_before = {(record["messages"][-1]["content"]) for log in logs if log.exists()
                           for line in log.read_text().splitlines() if line.strip()
                           for record in json.loads(line).get("records", [])}
        answered_before |= {r["messages"][-1]["content"] for r in records_of(store, refs)}
        assert 0 < len(answered_before) < 96
        sent_before = server.log.requests
        run_generation(store, refs, [server.url], budget=4)
        asked_after = [body["messages"][-1]["content"] for body in server.log.bodies[sent_before:]]
    assert not answered_before & set(asked_after), "an answered turn was asked again"
    assert len(asked_after) == len(set(asked_after)) == 96 - len(answered_before)
    turns = assert_transcripts(store, refs)
    assert sorted(map(len, turns.values())) == [4] * 24


CALLS = {**{f"weather in {city}?": [("get_weather", {"city": city})]
            for city in ("Tokyo", "Paris", "Rome", "Oslo", "Cairo", "Lima")},
         "weather in Paris and in Rome?": [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
         "weather in Oslo and in Cairo?": [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Cairo"})],
         "time is it in Tokyo?": [("get_time", {"city": "Tokyo"})],
         "time is it in Lima?": [("get_time", {"city": "Lima"})],
         "time is it in Cairo?": [("get_time", {"city": "Cairo"})]}  # the dataset recorded no get_time there


def tool_call_rows() -> list[dict[str, Any]]:
    path = Path(__file__).parents[2] / "eagle3_datagen" / "data" / "demo_tool_calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tool_calls_are_paired_with_the_recorded_results_and_a_call_without_one_ends_its_conversation(
        tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(tool_call_rows(), store, 5, turns="rollout").shards
    with ScriptedServer(Script(tool_calls=CALLS)) as server:
        run_generation(store, refs, [server.url], budget=3)
        bodies = list(server.log.bodies)
    assert all(body["tools"][0]["function"]["name"] == "get_weather" and body["tool_choice"] == "auto"
               for body in bodies), "every request offers the row's tools"
    turns = assert_transcripts(store, refs)
    records = [r for kept in turns.values() for r in kept]
    assert len(records) == len(bodies) == 6 * 2 + 2 * 2 + 2 * 4 + 1 + 1, "each call and each answer is a sample"
    ends = {kept[-1]["messages"][0]["content"]: kept[-1]["ended"] for kept in turns.values()}
    assert ends.pop("What time is it in Cairo?") == TOOL_RESULT_MISSING
    assert set(ends.values()) == {"complete"}
    call, answer = next(kept for kept in turns.values() if kept[0]["messages"][-1]["content"].endswith("and in Rome?"))
    assert [c["function"]["name"] for c in call["tool_calls"]] == ["get_weather", "get_weather"]
    assert answer["messages"][-3:] == [
        {"role": "assistant", "content": "", "tool_calls": call["tool_calls"], "reasoning": call["reasoning"]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-0", "content": "rain, 14 C"},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "clear, 25 C"}]
    assert "tool_calls" not in answer and answer["user_turn"] == call["user_turn"] == 0
    second_day = next(kept for kept in turns.values() if len(kept) == 4)
    assert [r["user_turn"] for r in second_day] == [0, 0, 1, 1]
    assert second_day[2]["messages"][-2] == {"role": "assistant", "content": second_day[1]["content"]}, \
        "an answered user turn goes back as its content only"
    assert verify_run(store).problems == []
    assert isinstance(next_turn(store.read_jsonl(refs[0].path)[0]["messages"], []), list)
    assert isinstance(next_turn([{"role": "user", "content": "q"}], [{"content": "a", "reasoning": ""}]), Ended)


def test_a_server_that_parses_no_tool_calls_stops_the_run_naming_the_flags(tmp_path: Path) -> None:
    """vLLM without --enable-auto-tool-choice refuses every request that offers tools: that is the server's setup,
    not each prompt's refusal, so nothing is written off as rejected."""
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(tool_call_rows(), store, 12, turns="rollout").shards
    with ScriptedServer(Script(tool_parser=False)) as server, pytest.raises(GenerationError) as stopped:
        run_generation(store, refs, [server.url], budget=2)
    assert "--enable-auto-tool-choice --tool-call-parser NAME" in str(stopped.value)
    assert not store.exists(rejected_path("generations", 0))
