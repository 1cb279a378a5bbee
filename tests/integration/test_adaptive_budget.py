"""`server.max_in_flight: auto` against a server that runs a fixed number of requests at once and queues the rest,
reporting its load at /metrics as vLLM does."""

from __future__ import annotations

import asyncio
import logging
import statistics
from pathlib import Path

import pytest

from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.diagnosis import ServerCheckFailed
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from tasks.generation import GenerationSettings, generate_shards
from tasks.health import check_servers_async


def test_auto_grows_the_budget_to_what_the_server_runs_and_keeps_a_queue_of_at_most_half(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "auto")
    rows = [{"id": f"p{i}", "row": i, "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(1500)]
    refs = [store.write_shard("prompts", k, rows[k * 500:(k + 1) * 500]) for k in range(3)]
    runs_at_once = 40  # more than `auto` starts with
    with ScriptedServer(Script(latency_s=0.2, max_running=runs_at_once)) as server:
        settings = GenerationSettings("scripted-model", BUILTIN_PROFILES["qwen3"], GenerationConfig(max_tokens=8), "t")
        generate_shards(store, refs, settings, ServerConfig(endpoints=[server.url], max_in_flight="auto"),
                        ValidationConfig(), logging.getLogger("test"))
        samples = server.log.in_flight_samples or []
        assert server.log.requests == 1500
    assert server.log.max_in_flight >= runs_at_once, "the budget grew until the server was saturated"
    steady = [count for _, count in samples[len(samples) // 2:-runs_at_once * 2]]
    # within 10% below: on a loaded 2-core machine the client itself sometimes lags the server by a few requests
    assert 0.9 * runs_at_once <= statistics.median(steady) <= runs_at_once * 2 + 2, \
        "saturated, with a queue of at most half the budget"


def test_auto_refuses_a_server_that_reports_no_load() -> None:
    with ScriptedServer(Script(serve_metrics=False)) as server, pytest.raises(ServerCheckFailed) as failure:
        asyncio.run(check_servers_async("scripted-model", ServerConfig(endpoints=[server.url], max_in_flight="auto"),
                                        GenerationConfig(), ValidationConfig()))
    assert "set a number for server.max_in_flight" in str(failure.value) and "\n" not in str(failure.value)
