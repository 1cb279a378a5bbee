"""Reasoning capture against a real HTTP server speaking every response shape vLLM has sent (or no longer sends).

Each way a server hides reasoning stops the run at its first answers with a message that names the fix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from eagle3_datagen.config import GenerationConfig, SequencesConfig, ServerConfig, ValidationConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.modes import ModeWeight, assign_mode
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.protocol import OpenAIClient, build_chat_request
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, expected_content, expected_reasoning
from eagle3_datagen.think_tokens import discover_think_tokens, load_tokenizer
from tasks.generation import GenerationSettings, generate_shards
from tasks.health import ServerCheckFailed, check_servers_async, wait_until_healthy
from tasks.sequences import build_sequences

QWEN3 = BUILTIN_PROFILES["qwen3"]
QUESTION = "Combien font 6 × 7 ? Réponds en une phrase."


async def _chat(url: str, profile_name: str = "qwen3") -> tuple[str, str, str]:
    profile = BUILTIN_PROFILES[profile_name]
    body = build_chat_request("scripted-model", [{"role": "user", "content": QUESTION}], profile.mode(None),
                              GenerationConfig())
    async with OpenAIClient(url, None, 30) as client:
        done = (await client.chat(body, profile))[0]
    return done.reasoning, done.content, done.reasoning_source


@pytest.mark.parametrize(
    ("shape", "source"),
    [("reasoning", "reasoning"), ("reasoning_content", "reasoning_content"), ("both", "reasoning+reasoning_content"),
     ("inline", "inline"), ("inline_with_start", "inline")],
)
def test_every_shape_is_captured_byte_for_byte(shape: str, source: str) -> None:
    with ScriptedServer(Script(shape=shape)) as server:
        reasoning, content, found = asyncio.run(_chat(server.url))
    assert reasoning == expected_reasoning(QUESTION)
    assert content == expected_content(QUESTION)
    assert found == source


def test_gpt_oss_analysis_channel_is_split_from_final() -> None:
    gpt_oss = BUILTIN_PROFILES["gpt-oss"]
    script = Script(shape="gpt_oss", think_start=gpt_oss.think_start, think_end=gpt_oss.think_end)
    with ScriptedServer(script) as server:
        reasoning, content, found = asyncio.run(_chat(server.url, "gpt-oss"))
        sent = server.log.bodies[0]
    assert (reasoning, content, found) == (expected_reasoning(QUESTION), expected_content(QUESTION), "inline")
    assert sent["reasoning_effort"] == "high"


def test_request_puts_template_switch_and_token_ids_at_top_level() -> None:
    with ScriptedServer() as server:
        asyncio.run(_chat(server.url))
        sent = server.log.bodies[0]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert sent["return_token_ids"] is True
    assert "extra_body" not in sent


def _generate(url: str, tmp_path: Path, sequence_source: str = "auto", **validation: object) -> RunStore:
    """Generate four prompts: each endpoint's first answers are the probe."""
    store = RunStore(str(tmp_path), "probe")
    rows = [{"id": f"p{i}", "row": i, "messages": [{"role": "user", "content": f"{QUESTION} ({i})"}]}
            for i in range(4)]
    refs = [store.write_shard("prompts", 0, rows)]
    generate_shards(store, refs, GenerationSettings("scripted-model", QWEN3, GenerationConfig(max_tokens=64), "t"),
                    ServerConfig(endpoints=[url], max_in_flight=4), ValidationConfig(**validation),
                    logging.getLogger("test"), sequence_source=sequence_source)
    return store


@pytest.mark.parametrize(
    ("script", "fix"),
    [
        (Script(shape="none"), "thinking is off or the switch is ignored"),
        (Script(shape="inline"), "--reasoning-parser qwen3"),
        (Script(shape="inline_with_start"), "--reasoning-parser qwen3"),
        (Script(shape="other_field"), "field(s) thinking that this run does not read"),
        (Script(model="another-model"), "answered as model 'another-model'"),
    ],
    ids=["thinking-off", "no-parser", "no-parser-start-tag", "unread-field", "wrong-model"],
)
def test_the_first_answers_stop_each_failure_with_its_fix(script: Script, fix: str, tmp_path: Path) -> None:
    with ScriptedServer(script) as server, pytest.raises(UserError) as failure:
        _generate(server.url, tmp_path, early_abort_after=4)
    assert fix in str(failure.value)
    assert "\n" not in str(failure.value)
    assert not list((tmp_path / "probe" / "generations").glob("shard-*[0-9].jsonl")), "no shard kept"


def test_a_server_without_token_ids_is_used_through_text_unless_its_ids_are_asked_for(tmp_path: Path) -> None:
    with ScriptedServer(Script(return_token_ids=False)) as server:
        store = _generate(server.url, tmp_path / "auto")
        with pytest.raises(UserError) as refused:
            _generate(server.url, tmp_path / "server", sequence_source="server")
    records = store.read_jsonl("generations/shard-00000.jsonl")
    assert len(records) == 4 and all(r["completion_token_ids"] is None and r["usage"] for r in records)
    assert "returns no token ids" in str(refused.value) and "set sequences.source: auto" in str(refused.value)


def test_inline_reasoning_is_accepted_when_the_config_allows_it(tmp_path: Path) -> None:
    with ScriptedServer(Script(shape="inline")) as server:
        store = _generate(server.url, tmp_path, allow_inline_reasoning=True)
    assert [r["reasoning_source"] for r in store.read_jsonl("generations/shard-00000.jsonl")] == ["inline"] * 4


def test_a_served_model_of_another_name_is_refused_before_any_request() -> None:
    with ScriptedServer(Script(model="another-model")) as server, pytest.raises(ServerCheckFailed) as failure:
        asyncio.run(check_servers_async("scripted-model", ServerConfig(endpoints=[server.url], startup_timeout_s=5),
                                        GenerationConfig(), ValidationConfig()))
        assert server.log.requests == 0
    assert "--served-model-name scripted-model" in str(failure.value)


def test_a_port_nothing_listens_on_fails_in_seconds_not_after_the_startup_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(ServerCheckFailed, match=r"^nothing listens at http://127.0.0.1:9 \(connection refused for "
                                                r"\d+ s\): start vLLM there, or fix server.endpoints$"):
        asyncio.run(check_servers_async("m", ServerConfig(endpoints=["http://127.0.0.1:9"]),  # waits up to 600 s
                                        GenerationConfig(), ValidationConfig()))
    assert time.monotonic() - started < 30


def test_an_unknown_host_fails_at_once_naming_the_endpoint() -> None:
    with pytest.raises(ServerCheckFailed, match=r"^the host of http://no-such-host.invalid:8000 is not known .*: "
                                                r"fix server.endpoints$"):
        asyncio.run(check_servers_async("m", ServerConfig(endpoints=["http://no-such-host.invalid:8000"]),
                                        GenerationConfig(), ValidationConfig()))


def test_a_starting_server_is_waited_for_saying_what_and_how_long_is_left() -> None:
    said: list[str] = []
    with ScriptedServer(Script(starting_for_s=3.5)) as server:
        async def check() -> None:
            async with OpenAIClient(server.url, None, 5) as client:
                await wait_until_healthy(client, timeout_s=60, report=said.append, every_s=1.5)
        asyncio.run(check())
    assert 2 <= len(said) <= 4, said
    assert said[0] == f"waiting for {server.url} to start: /health answers HTTP 503; 0 s so far, 60 s left " \
                      "(server.startup_timeout_s)"


def test_a_server_that_never_becomes_healthy_fails_at_the_startup_timeout_saying_what_it_answered() -> None:
    with ScriptedServer(Script(starting_for_s=60)) as server, pytest.raises(
            ServerCheckFailed, match=r"did not answer /health within 2s \(/health answers HTTP 503\): start the "
                                     r"server or fix server.endpoints"):
        asyncio.run(check_servers_async("scripted-model", ServerConfig(endpoints=[server.url], startup_timeout_s=2),
                                        GenerationConfig(), ValidationConfig()))


MIX = [ModeWeight(mode="thinking", weight=0.5), ModeWeight(mode="instant", weight=0.5)]


def _generate_mixed(url: str, tmp_path: Path, prompts: int = 24, **validation: object) -> RunStore:
    store = RunStore(str(tmp_path), "mixed")
    rows = [{"id": f"p{i}", "row": i, "messages": [{"role": "user", "content": f"{QUESTION} ({i})"}]}
            for i in range(prompts)]
    refs = [store.write_shard("prompts", 0, rows)]
    settings = GenerationSettings("scripted-model", QWEN3, GenerationConfig(max_tokens=64, modes=MIX), "t")
    generate_shards(store, refs, settings, ServerConfig(endpoints=[url], max_in_flight=4),
                    ValidationConfig(**validation), logging.getLogger("test"))
    return store


def test_a_mixed_run_asks_each_prompt_in_its_mode_and_each_sequence_is_exact(tiny_model: Path,
                                                                              tmp_path: Path) -> None:
    """Thinking prompts are answered with reasoning, instant ones without (the switch turns it off); each record
    names its mode, and each mode's text rebuild equals the server's ids."""
    tokenizer = load_tokenizer(str(tiny_model))
    with ScriptedServer(Script(tokenizer=tokenizer)) as server:
        store = _generate_mixed(server.url, tmp_path)
        switches = {body["messages"][-1]["content"]: body["chat_template_kwargs"] for body in server.log.bodies}
    records = store.read_jsonl("generations/shard-00000.jsonl")
    assert {r["mode"] for r in records} == {"thinking", "instant"}
    for record in records:
        assert record["mode"] == assign_mode(record["id"], MIX)
        assert switches[record["messages"][-1]["content"]] == {"enable_thinking": record["mode"] == "thinking"}
        assert bool(record["reasoning"]) is (record["mode"] == "thinking")
    shard = build_sequences(records, tokenizer, QWEN3, discover_think_tokens(tokenizer, QWEN3),
                            SequencesConfig(cross_check_rate=1.0))
    assert shard.rejected == [] and len(shard.sequences) == len(records)
    assert all(sequence.agrees for sequence in shard.sequences), [s.first_diff for s in shard.sequences]
    assert [s.mode for s in shard.sequences] == [r["mode"] for r in records]


def test_a_server_that_ignores_the_instant_switch_is_stopped_by_its_first_answers(tmp_path: Path) -> None:
    with ScriptedServer(Script(ignore_thinking_switch=True)) as server, pytest.raises(UserError) as failure:
        _generate_mixed(server.url, tmp_path)
    assert "records asked in mode instant carry reasoning" in str(failure.value)
    assert "(instant: {'enable_thinking': False}) is ignored" in str(failure.value)
    assert not list((tmp_path / "mixed" / "generations").glob("shard-*[0-9].jsonl")), "no shard kept"
