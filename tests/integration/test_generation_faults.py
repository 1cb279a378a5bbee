"""Generation under faults: retries, rejections, endpoints that die and return, a killed run that resumes.

Every run here ends with the invariant: each prompt is generated exactly once or rejected with its reason.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from eagle3_datagen.artifacts import ShardRef, artifact_path, rejected_path
from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, expected_content, expected_reasoning
from tasks.generation import GenerationError, GenerationSettings, generate_shards

QWEN3 = BUILTIN_PROFILES["qwen3"]


def write_prompt_shards(store: RunStore, shards: int, per_shard: int) -> list[ShardRef]:
    refs = []
    for index in range(shards):
        rows = [{"id": f"p{index}-{i}", "row": index * per_shard + i,
                 "messages": [{"role": "user", "content": f"question {index}-{i}"}]} for i in range(per_shard)]
        refs.append(store.write_shard("prompts", index, rows))
    return refs


def settings(temperature: float = 1.0) -> GenerationSettings:
    return GenerationSettings("scripted-model", QWEN3, GenerationConfig(max_tokens=64, temperature=temperature), "t")


def run_generation(store: RunStore, refs: list[ShardRef], urls: list[str], budget: int = 8,
                   gen: GenerationSettings | None = None, validation: ValidationConfig | None = None,
                   **server: object) -> list[ShardRef]:
    config = ServerConfig(endpoints=urls, max_in_flight=budget, retry_backoff_s=0.01, **server)
    return generate_shards(store, refs, gen or settings(), config, validation or ValidationConfig(),
                           logging.getLogger("test"), progress_every_s=0.2)


def assert_exactly_once(store: RunStore, refs: list[ShardRef]) -> tuple[int, int]:
    """Every prompt id appears once in the generations or once in the rejected lists, never both."""
    expected = {p["id"] for ref in refs for p in store.read_jsonl(ref.path)}
    generated = [r["id"] for ref in refs if store.exists(artifact_path("generations", ref.index))
                 for r in store.read_jsonl(artifact_path("generations", ref.index))]
    rejected = [r["id"] for ref in refs if store.exists(rejected_path("generations", ref.index))
                for r in store.read_jsonl(rejected_path("generations", ref.index))]
    assert len(generated) == len(set(generated)), "duplicate generations"
    assert sorted(generated + rejected) == sorted(expected), "a prompt was lost or doubled"
    return len(generated), len(rejected)


def test_transient_faults_are_retried_until_every_record_lands(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 10)
    faults = ["http-500", "http-429", "reset", "malformed", "missing", "http-503", "http-502", "http-408", "slow"]
    with ScriptedServer(Script(faults=list(faults), slow_s=3)) as server:
        run_generation(store, refs, [server.url], budget=4, request_timeout_s=1)
        assert server.log.requests == 20 + len(faults)
    assert assert_exactly_once(store, refs) == (20, 0)


def test_a_refused_request_is_rejected_with_the_servers_reason_and_the_run_goes_on(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 6)
    with ScriptedServer(Script(faults=["http-400"])) as server:
        run_generation(store, refs, [server.url], budget=1)
        assert server.log.requests == 6, "a 400 is not retried"
    assert assert_exactly_once(store, refs) == (5, 1)
    [rejected] = store.read_jsonl(rejected_path("generations", 0))
    assert "HTTP 400" in rejected["reason"] and "scripted failure 400" in rejected["reason"]


def test_a_dead_server_fails_the_run_but_keeps_finished_records(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 4)
    dying = Script(faults=["ok", "ok"] + ["http-503"] * 100)
    with ScriptedServer(dying) as server, pytest.raises(GenerationError, match="run again to resume"):
        # a window of two: the answers that came before the server died were judged, so they are kept
        run_generation(store, refs, [server.url], budget=1, max_retries=2,
                       validation=ValidationConfig(early_abort_after=2))
    partial = tmp_path / "run" / "generations" / "shard-00000.partial.jsonl"
    assert sum("records" in json.loads(line) for line in partial.read_text().splitlines()) == 2
    with ScriptedServer(Script()) as server:
        run_generation(store, refs, [server.url], budget=1)
        assert server.log.requests == 2, "only the two unfinished records are asked again"
    assert assert_exactly_once(store, refs) == (4, 0)


def test_budget_is_shared_across_shards_and_never_exceeded(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 20, 5)  # many small shards: per-shard pools would drain at every boundary
    with ScriptedServer(Script(latency_s=0.25)) as server:
        run_generation(store, refs, [server.url], budget=8, validation=ValidationConfig(early_abort_after=8))
        samples = server.log.in_flight_samples
        assert server.log.max_in_flight <= 8
    start, end = samples[0][0], samples[-1][0]
    # after the probation window (the first 8 requests are checked before the budget opens), before the tail
    middle = [(t, n) for t, n in samples if start + 0.2 * (end - start) <= t <= start + 0.8 * (end - start)]
    weighted = sum(n * (t2 - t1) for (t1, n), (t2, _) in itertools.pairwise(middle))
    assert weighted / (middle[-1][0] - middle[0][0]) > 7.0, "in-flight count dropped between shards"
    assert assert_exactly_once(store, refs) == (100, 0)


def test_an_endpoint_that_dies_is_avoided_and_used_again_when_it_returns(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 4, 50)
    with ScriptedServer(Script(latency_s=0.05)) as steady:
        flaky = ScriptedServer(Script(latency_s=0.05)).__enter__()
        port = flaky.port
        revived: list[ScriptedServer] = []

        def kill_then_revive() -> None:
            while flaky.log.requests < 20:
                time.sleep(0.01)
            flaky.__exit__(None, None, None)
            time.sleep(0.5)
            revived.append(ScriptedServer(Script(latency_s=0.05), port=port).__enter__())

        chaos = threading.Thread(target=kill_then_revive)
        chaos.start()
        run_generation(store, refs, [flaky.url, steady.url], budget=4, max_retries=8)
        chaos.join()
        try:
            assert steady.log.requests > 50
            assert revived and revived[0].log.requests > 0, "the endpoint that came back was not used again"
        finally:
            revived[0].__exit__(None, None, None)
    assert assert_exactly_once(store, refs) == (200, 0)


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 2)
    with ScriptedServer(Script()) as server:
        run_generation(store, refs, [server.url])
        with pytest.raises(GenerationError, match="generated with other settings"):
            run_generation(store, refs, [server.url], gen=settings(temperature=0.3))


KILLABLE = """
import logging, sys
from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import ServerConfig, ValidationConfig
from eagle3_datagen.storage import RunStore
from tasks.generation import generate_shards
sys.path.insert(0, {tests!r})
from test_generation_faults import settings
refs = {refs!r}
server = ServerConfig(endpoints=[{url!r}], max_in_flight=4)
generate_shards(RunStore({root!r}, "run"), refs, settings(), server, ValidationConfig(), logging.getLogger("child"))
"""


def test_a_killed_run_resumes_without_repeating_or_losing_a_record(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 3, 30)
    partial = tmp_path / "run" / "generations" / "shard-00001.partial.jsonl"
    with ScriptedServer(Script(latency_s=0.03)) as server:
        code = KILLABLE.format(tests=str(Path(__file__).parent), url=server.url, root=str(tmp_path), refs=refs)
        child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        deadline = time.monotonic() + 60
        while not (partial.exists() and len(partial.read_text().splitlines()) >= 10):
            assert child.poll() is None and time.monotonic() < deadline, "child ended before it could be killed"
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        finished_before = {record["id"] for f in (tmp_path / "run" / "generations").glob("*.partial.jsonl")
                           for line in f.read_text().splitlines() if line.strip()
                           for record in json.loads(line).get("records", [])}
        finished_before |= {r["id"] for ref in refs if store.exists(artifact_path("generations", ref.index))
                            for r in store.read_jsonl(artifact_path("generations", ref.index))}
        sent_before = server.log.requests
        run_generation(store, refs, [server.url], budget=4)
        asked_after = [b["messages"][-1]["content"] for b in server.log.bodies[sent_before:]]
    questions_done = {f"question {i.removeprefix('p')}" for i in finished_before}
    assert not questions_done & set(asked_after), "a finished record was requested again"
    assert assert_exactly_once(store, refs) == (90, 0)
    for ref in refs:
        for record in store.read_jsonl(artifact_path("generations", ref.index)):
            assert record["reasoning"] == expected_reasoning(record["messages"][-1]["content"])


def test_n_samples_per_prompt_give_distinct_records_from_one_request_each(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 4)
    gen = GenerationSettings("scripted-model", QWEN3, GenerationConfig(max_tokens=64, n=3), "t")
    with ScriptedServer(Script()) as server:
        [ref] = run_generation(store, refs, [server.url], gen=gen)
        assert server.log.requests == 4 and server.log.bodies[0]["n"] == 3
    ids = [r["id"] for r in store.read_jsonl(ref.path)]
    assert ids == [f"p0-{i}:{k}" for i in range(4) for k in range(3)]


def test_progress_is_reported_while_generating(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 10)
    seen: list[float] = []

    def record(percent: float) -> None:
        seen.append(percent)

    with ScriptedServer(Script(latency_s=0.1)) as server:
        config = ServerConfig(endpoints=[server.url], max_in_flight=2)
        generate_shards(store, refs, settings(), config, ValidationConfig(early_abort_after=2),
                        logging.getLogger("test"), progress_every_s=0.1, on_progress=record)
    assert seen and seen == sorted(seen) and 0 < seen[-1] <= 100


def test_early_abort_spends_at_most_n_requests(tmp_path: Path) -> None:
    """Thinking off: three empty answers in a row stop the run, the rest of the window is cancelled."""
    store = RunStore(str(tmp_path), "abort")
    refs = write_prompt_shards(store, 4, 50)
    with ScriptedServer(Script(shape="none", latency_s=0.01)) as server:
        with pytest.raises(GenerationError, match="early abort: 3 of the first 3 records have empty reasoning"):
            run_generation(store, refs, [server.url], budget=32, validation=ValidationConfig(early_abort_after=8))
        assert server.log.requests <= 8
    partial = tmp_path / "abort" / "generations" / "shard-00000.partial.jsonl"
    lines = [json.loads(line) for line in partial.read_text().splitlines()]
    kept = sum("records" in line for line in lines)
    assert kept >= 3, "records already received are kept"
    assert sum("discard" in line for line in lines) == kept, "and marked, to be asked again after the fix"
    assert not store.exists("generations/settings.json"), "nothing kept pins the settings"
    with ScriptedServer(Script(latency_s=0.01)) as server:
        out = run_generation(store, refs, [server.url], budget=32, validation=ValidationConfig(early_abort_after=8))
        assert server.log.requests == 200, "the aborted window's prompts are asked again once the server is fixed"
    for ref in out:
        assert all(record["reasoning"].strip() for record in store.read_jsonl(ref.path))


def test_under_auto_a_run_without_reasoning_spends_at_most_the_starting_budget(tmp_path: Path) -> None:
    """The README's promise: at most 32 requests before the abort, however far `auto` would grow the budget."""
    store = RunStore(str(tmp_path), "abort-auto")
    refs = write_prompt_shards(store, 4, 100)
    with ScriptedServer(Script(shape="none", latency_s=0.05)) as server:
        with pytest.raises(GenerationError, match="early abort"):
            run_generation(store, refs, [server.url], budget="auto")  # type: ignore[arg-type]
        assert server.log.requests <= 32


def test_the_verdict_releases_the_budget_without_waiting_for_the_slowest_of_the_window(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 50)
    script = Script(faults=["slow"], slow_s=3, latency_s=0.01)  # the window's first request takes 3 s
    with ScriptedServer(script) as server:
        run_generation(store, refs, [server.url], budget=32, validation=ValidationConfig(early_abort_after=16))
        in_flight = [count for _, count in server.log.in_flight_samples or []]
        assert server.log.requests == 100, "every prompt asked once: the window's answers are kept records"
    assert in_flight[-2:] == [1, 0] and 0 not in in_flight[:-1], \
        "every other prompt was sent and answered while the slowest of the window was still running"
    assert assert_exactly_once(store, refs) == (100, 0)


def test_by_default_the_window_is_one_budget_so_no_slot_waits_for_the_verdict(tmp_path: Path) -> None:
    """The default early-abort window: a healthy run has its whole budget in flight before its first answer; a
    broken one spends that budget at most."""
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 100)
    with ScriptedServer(Script(latency_s=0.3)) as server:
        run_generation(store, refs, [server.url], budget=48)  # more than the smallest window (32)
        in_flight = [count for _, count in server.log.in_flight_samples or []]
    first_answer = next(i for i in range(1, len(in_flight)) if in_flight[i] < in_flight[i - 1])
    assert max(in_flight[:first_answer]) == 48
    broken = RunStore(str(tmp_path), "broken")
    with ScriptedServer(Script(shape="none", latency_s=0.05)) as server:
        with pytest.raises(GenerationError, match="early abort: 3 of the first 3 records have empty reasoning"):
            run_generation(broken, write_prompt_shards(broken, 4, 50), [server.url], budget=48)
        assert server.log.requests <= 48


def test_a_record_that_cannot_be_kept_stops_the_run_with_its_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up mid-run: the run ends with that error (not as a gap read as unreachable servers), and
    what was kept before stays for the re-run."""
    from tasks.generation.records import Prompt, ShardState

    append, kept = ShardState.append, []

    def fills_up(state: ShardState, prompt: Prompt, **outcome: object) -> None:
        if len(kept) == 20:
            raise OSError(28, "No space left on device")
        append(state, prompt, **outcome)
        kept.append(outcome)

    monkeypatch.setattr(ShardState, "append", fills_up)
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 50)
    with ScriptedServer(Script(latency_s=0.01)) as server:
        with pytest.raises(OSError, match="No space left on device"):
            run_generation(store, refs, [server.url])
        asked = server.log.requests
    assert asked < 100, "the run stopped instead of asking every prompt"
    monkeypatch.setattr(ShardState, "append", append)
    with ScriptedServer(Script(latency_s=0.01)) as server:
        run_generation(store, refs, [server.url])
        assert server.log.requests == 100 - 20, "the records kept before the error are not asked again"
    assert assert_exactly_once(store, refs) == (100, 0)


def test_every_record_is_captured_byte_for_byte(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "gen")
    refs = write_prompt_shards(store, 3, 20)
    with ScriptedServer(Script(latency_s=0.02)) as server:
        out = run_generation(store, refs, [server.url], budget=8)
        assert server.log.max_in_flight <= 8 and server.log.requests == 60
    assert [r.num_records for r in out] == [20, 20, 20]
    for ref in out:
        for record in store.read_jsonl(ref.path):
            question = record["messages"][-1]["content"]
            assert record["reasoning"] == expected_reasoning(question)
            assert record["content"] == expected_content(question)


def test_a_grown_dataset_generates_only_the_new_prompts(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    [ref] = write_prompt_shards(store, 1, 6)
    rows = store.read_jsonl(ref.path)
    yesterday = store.write_shard("prompts", 0, rows[:4])  # yesterday's dataset: the shard had 4 prompts
    with ScriptedServer(Script()) as server:
        run_generation(store, [yesterday], [server.url])
        tonight = store.write_shard("prompts", 0, rows)  # two more prompts landed in the same shard
        [done] = run_generation(store, [tonight], [server.url])
        asked = [b["messages"][-1]["content"] for b in server.log.bodies]
    assert asked[4:] == ["question 0-4", "question 0-5"], "finished prompts are not asked again"
    assert [r["id"] for r in store.read_jsonl(done.path)] == [r["id"] for r in rows]


def test_concurrent_runs_share_an_endpoints_budget_through_prefect(tmp_path: Path) -> None:
    """Two runs at once, each allowed 4 in flight: with the shared budget the server never sees more than 4."""
    from prefect.testing.utilities import prefect_test_harness

    def two_runs(url: str, share: bool) -> None:
        config = ServerConfig(endpoints=[url], max_in_flight=4, share_budget_across_runs=share)
        stores = [RunStore(str(tmp_path / f"{share}"), name) for name in ("a", "b")]
        with ThreadPoolExecutor(2) as runs:
            for run in [runs.submit(generate_shards, store, write_prompt_shards(store, 2, 12), settings(), config,
                                    ValidationConfig(early_abort_after=1), logging.getLogger("test"))
                        for store in stores]:
                run.result()

    with prefect_test_harness(server_startup_timeout=120):
        for share, ceiling in ((False, 8), (True, 4)):
            with ScriptedServer(Script(latency_s=0.1)) as server:
                two_runs(server.url, share)
                assert server.log.requests == 48
                assert server.log.max_in_flight <= ceiling
                if not share:
                    assert server.log.max_in_flight > 4, "without sharing, two runs do oversubscribe"


def test_a_server_that_fails_every_request_ends_the_run_after_the_consecutive_error_limit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 2, 16)
    started = time.monotonic()
    with ScriptedServer(Script(faults=["http-500"] * 10_000)) as server, caplog.at_level(logging.DEBUG, "test"):
        with pytest.raises(GenerationError, match=r"gave up: every endpoint answered 10 requests in a row with an "
                                                  r"error .*HTTP 500"):
            run_generation(store, refs, [server.url], budget=8, max_consecutive_errors=10)
        sent = server.log.requests
    assert sent <= 8 + 10, "at most one budget of requests in flight plus the limit"
    assert time.monotonic() - started < 30
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "is down" in warnings[0], "one warning per endpoint state change, none per record"


def test_a_server_that_dies_mid_run_ends_it_within_give_up_after_s(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 3, 40)
    server = ScriptedServer(Script(latency_s=0.02)).__enter__()

    def kill() -> None:
        while server.log.requests < 50:
            time.sleep(0.01)
        server.__exit__(None, None, None)

    killer = threading.Thread(target=kill)
    killer.start()
    started = time.monotonic()
    with pytest.raises(GenerationError, match=r"no endpoint answered successfully for \d+s .*records are kept"):
        run_generation(store, refs, [server.url], budget=4, give_up_after_s=2, max_retries=100)
    killer.join()
    assert time.monotonic() - started < 30
    kept = sum("records" in json.loads(line) for log in (tmp_path / "run" / "generations").glob("*.partial.jsonl")
               for line in log.read_text().splitlines())
    kept += sum(len(store.read_jsonl(artifact_path("generations", ref.index))) for ref in refs
                if store.exists(artifact_path("generations", ref.index)))
    assert kept >= 40, "what was answered before the server died is kept for the resume"


def test_an_outage_the_run_survives_is_reported_once_down_and_once_recovered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 40)
    outage = Script(latency_s=0.01)
    with ScriptedServer(outage) as server, caplog.at_level(logging.INFO, "test"):
        outage.faults = ["ok"] * 10 + ["http-503"] * 12
        run_generation(store, refs, [server.url], budget=2, max_retries=20)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w.split(" ")[2] for w in warnings] == ["is", "recovered"], warnings
    assert assert_exactly_once(store, refs) == (40, 0)


def test_an_early_abort_counts_refusals_and_names_the_servers_reason(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 4, 25)
    with ScriptedServer(Script(faults=["http-400"] * 100)) as server:
        with pytest.raises(GenerationError, match=r"early abort: the server refused 5 of the first 5 requests .*"
                                                  r"scripted failure 400"):
            run_generation(store, refs, [server.url], budget=4, validation=ValidationConfig(early_abort_after=8))
        assert server.log.requests <= 8, "more refusals than min_accepted_rate allows: the run stops at once"
    assert not any(store.exists(rejected_path("generations", ref.index)) for ref in refs)


def test_prompts_are_queued_a_few_shards_ahead_never_the_whole_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A million prompts must not sit in memory at once: the queue holds about two budgets' worth plus the
    shard being opened, and every prompt is still answered exactly once."""
    from tasks.generation.scheduler import GenerationScheduler

    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 12, 10)
    longest: list[int] = []
    refill = GenerationScheduler._refill

    async def watched(self: GenerationScheduler) -> None:
        await refill(self)
        longest.append(len(self.queue))

    monkeypatch.setattr(GenerationScheduler, "_refill", watched)
    with ScriptedServer(Script(latency_s=0.01)) as server:
        written = run_generation(store, refs, [server.url], budget=3)
    assert max(longest) <= 2 * 3 + 10, "two budgets ahead, plus at most one shard opened past them"
    assert [ref.num_records for ref in written] == [10] * 12
    assert_exactly_once(store, refs)
