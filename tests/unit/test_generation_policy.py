"""The decisions generation takes on its own: when the early-abort window lets a run go, how `auto` moves a budget
with the server's load, who gets a slot that frees up, the timeline's mean in flight, and how a stall of the event
loop is measured. Pure functions and small classes, no server."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time

import pytest
from early_abort_answers import ENDPOINT, answer, judge

from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import ServerConfig, ValidationConfig, parse_config
from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.protocol import Completion, OpenAIClient, RequestFailed, ServerLoad, parse_metrics
from eagle3_datagen.storage import RunLocation
from tasks.generation.budget import FOLLOW_EVERY_S, RAMP_EVERY_S, SETTLED_EVERY_S, next_limit, next_pause
from tasks.generation.pool import REPEATED_REFUSALS, Endpoint, EndpointPool, HeldRefusals
from tasks.generation.probation import Outcome, Probation, ShareTest
from tasks.generation.progress import Timeline
from tasks.generation.scheduler import StallClock
from tasks.generation.task import GenerationOutcome, GenerationStopped, generated_shards


def test_a_healthy_run_is_let_go_after_its_first_seven_answers_of_a_window_of_32() -> None:
    probation, seen = judge([answer("thinking…")] * 32)
    assert probation.passed and seen == 7


def test_a_run_without_reasoning_is_stopped_at_its_third_answer() -> None:
    probation, seen = judge([answer("")] * 32)
    assert seen == 3 and probation.error is not None
    assert str(probation.error).startswith("early abort: 3 of the first 3 records have empty reasoning")


def test_one_empty_answer_among_good_ones_delays_the_verdict_but_does_not_stop_the_run() -> None:
    probation, seen = judge([answer("")] + [answer("thinking…")] * 31)
    assert probation.passed and 7 < seen < 32


def test_a_run_with_half_its_answers_empty_is_never_let_go() -> None:
    probation, _ = judge([answer(""), answer("thinking…")] * 16)
    assert not probation.passed and probation.error is not None


def test_a_window_smaller_than_the_test_needs_is_judged_on_its_rates() -> None:
    assert judge([answer("thinking…")] * 4, size=4)[0].passed
    probation, seen = judge([answer("thinking…")] * 3 + [answer("")], size=4)
    assert seen == 4 and "1 of the first 4 records have empty reasoning (25% > " in str(probation.error)


def test_a_malformed_first_answer_stops_the_run_and_is_not_kept() -> None:
    inline = Completion("r", "a", "stop", "inline", [1], [2], {}, "m")
    probation = Probation(32, [ENDPOINT], "m", BUILTIN_PROFILES["qwen3"], ValidationConfig())
    assert probation.observe(Outcome(ENDPOINT, completions=[inline])) is False
    assert "--reasoning-parser qwen3" in str(probation.error)


@pytest.mark.parametrize("healthy", [0.0, 0.05, 0.2, 0.5, 0.8, 1.0])
def test_the_sequential_test_stops_a_run_only_when_it_is_emptier_than_allowed(healthy: float) -> None:
    """Two answers in three empty: stopped exactly when that share is above the allowed rate, and then only once
    the share seen so far is above it too."""
    test = ShareTest.allowing(healthy)
    empty = answers = 0
    for k in range(200):
        test.add(k % 3 != 2)
        empty, answers = empty + (k % 3 != 2), answers + 1
        if test.verdict == "abort":
            assert empty / answers > healthy
            break
    assert (test.verdict == "abort") == (healthy < 2 / 3)


def test_the_budget_grows_only_while_it_is_used_and_the_server_has_room() -> None:
    idle = ServerLoad(running=16, waiting=0, kv_cache_usage=0.3)
    assert next_limit(16, peak_in_flight=16, load=idle) == 32, "doubles until the server pushes back"
    assert next_limit(16, peak_in_flight=9, load=idle) == 16, "a budget not used is not grown"
    assert next_limit(16, peak_in_flight=16, load=ServerLoad(16, 0, 0.9)) == 16, "the cache is nearly full"
    assert next_limit(64, peak_in_flight=64, load=ServerLoad(64, 0, 0.3), pushed_back=True) == 68, \
        "slowly once the server pushed back"
    assert next_limit(256, peak_in_flight=256, load=ServerLoad(120, 0, 0.1)) == 256, \
        "not while the server has yet to take in what was sent"
    assert next_limit(32, peak_in_flight=32, load=ServerLoad(19, 0, 0.01)) == 64, \
        "but without waiting for every request to be counted: some are in the server's pre- or post-processing"
    still_reading = ServerLoad(running=128, waiting=0, kv_cache_usage=0.06)
    assert next_limit(256, peak_in_flight=256, load=still_reading, just_grown=True) == 256, \
        "right after a growth, three quarters of the budget must be counted: the front end may still be reading it"
    assert next_limit(256, peak_in_flight=256, load=still_reading) == 512
    assert next_limit(256, peak_in_flight=256, load=ServerLoad(128, 30, 0.06)) == 256, \
        "requests wait while the server runs half the budget: it is full, and the other half is its queue"


def test_the_load_is_read_quickly_while_the_budget_climbs_and_seldom_while_it_stays_put() -> None:
    assert next_pause(0.1, changed=True, ramping=True) == RAMP_EVERY_S
    pauses = [FOLLOW_EVERY_S]
    for _ in range(4):
        pauses.append(next_pause(pauses[-1], changed=False, ramping=False))
    assert pauses == [0.5, 1.0, 2.0, SETTLED_EVERY_S, SETTLED_EVERY_S]
    assert next_pause(SETTLED_EVERY_S, changed=True, ramping=False) == FOLLOW_EVERY_S, "a change: read again soon"


def test_the_budget_shrinks_to_what_runs_plus_a_half_when_more_wait_or_the_cache_is_full() -> None:
    assert next_limit(64, peak_in_flight=64, load=ServerLoad(running=20, waiting=40, kv_cache_usage=0.5)) == 52
    assert next_limit(128, peak_in_flight=128, load=ServerLoad(running=50, waiting=0, kv_cache_usage=0.97)) == 114
    assert next_limit(8, peak_in_flight=8, load=ServerLoad(running=0, waiting=30, kv_cache_usage=None)) == 4
    assert next_limit(64, peak_in_flight=64, load=ServerLoad(running=32, waiting=24, kv_cache_usage=0.5)) == 64, \
        "a queue within half the budget is kept: it feeds the engine while successors are on their way"
    assert next_limit(64, peak_in_flight=64, load=ServerLoad(running=48, waiting=10, kv_cache_usage=0.5)) == 128, \
        "and it grows while a quarter of the budget or less waits"


def test_vllm_metrics_are_summed_over_engines_and_histograms_ignored() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 17.0',
    ])
    assert parse_metrics(text) == ServerLoad(running=7.0, waiting=1.0, kv_cache_usage=0.25)
    assert parse_metrics("# no vLLM here\nprocess_cpu_seconds_total 1.0") is None


def test_metrics_lines_this_client_cannot_read_are_skipped_not_fatal() -> None:
    """A timestamp, a label value with spaces, a sample without a value or with NaN: the budget keeps following."""
    text = "\n".join([
        'vllm:num_requests_running{engine="0",model_name="my model"} 3.0 1700000000000',
        'vllm:num_requests_waiting{engine="0",model_name="my model"} 1',
        'vllm:num_requests_waiting{engine="1"}',
        'vllm:kv_cache_usage_perc{engine="0"} NaN',
    ])
    assert parse_metrics(text) == ServerLoad(running=3.0, waiting=1.0, kv_cache_usage=None)


def test_auto_budget_cannot_be_shared_across_runs() -> None:
    assert ServerConfig(max_in_flight="auto").max_in_flight == "auto"
    with pytest.raises(ConfigurationError, match="share_budget_across_runs needs a number"):
        parse_config({"run_name": "r", "data": {"source": "d.jsonl"},
                      "model": {"name": "m", "profile": "qwen3", "tokenizer": "t"},
                      "server": {"max_in_flight": "auto", "share_budget_across_runs": True}})


def test_the_stall_clock_reports_the_longest_time_the_event_loop_could_not_poll() -> None:
    clock = StallClock()

    async def blocks_once() -> None:
        await asyncio.sleep(0.05)  # waiting is not a stall
        time.sleep(0.3)  # a callback that holds the loop: every request in flight waits
        await asyncio.sleep(0.05)

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(clock)) as runner:
        runner.run(blocks_once())
    assert 0.3 <= clock.longest_s < 3


def test_a_finished_request_keeps_its_slot_for_the_next_prompt_only_while_nothing_else_needs_it() -> None:
    async def scenario() -> None:
        endpoint = Endpoint(ENDPOINT, OpenAIClient(ENDPOINT, None, 5.0), limit=2)
        pool = EndpointPool([endpoint], ServerConfig(endpoints=[ENDPOINT]), logging.getLogger("test"))
        first, second = await pool.acquire(), await pool.acquire()
        assert first is not None and second is not None
        assert pool.release(*first, None, carry_on=True), "a success on a healthy endpoint within its limit"
        assert endpoint.in_flight == 2
        assert not pool.release(*first, RequestFailed("HTTP 503", 503, True), carry_on=True), "not after a failure"
        assert endpoint.in_flight == 1
        first = await pool.acquire()
        assert first is not None
        endpoint.limit = 1  # the adaptive budget shrank
        assert not pool.release(*first, None, carry_on=True) and endpoint.in_flight == 1

        new_prompt = asyncio.create_task(pool.acquire())
        retry = asyncio.create_task(pool.acquire(retry=True))
        await asyncio.sleep(0)
        assert not pool.release(*second, None, carry_on=True), "a retry waits: it gets the slot"
        await asyncio.sleep(0)
        assert retry.done() and not new_prompt.done(), "a retry is woken before a new prompt that waited longer"
        slot = retry.result()
        assert slot is not None
        pool.give_back(*slot)
        assert await new_prompt == (endpoint, False)

    asyncio.run(scenario())


def test_the_timeline_shows_the_exact_mean_in_flight_of_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    endpoint = Endpoint(ENDPOINT, OpenAIClient(ENDPOINT, None, 5.0), limit=4)
    pool = EndpointPool([endpoint], ServerConfig(endpoints=[ENDPOINT]), logging.getLogger("test"))
    timeline = Timeline(finished=0, integral=pool.in_flight_integral())

    async def two_requests() -> tuple[tuple[Endpoint, bool] | None, ...]:
        return await pool.acquire(), await pool.acquire()

    first, second = asyncio.run(two_requests())
    assert first is not None and second is not None
    clock[0] = 101.0
    assert pool.release(*first, None, carry_on=True), "carrying on: still two in flight"
    clock[0] = 102.0
    pool.release(*first, None)
    timeline.close_step(finished=1, integral=pool.in_flight_integral())
    clock[0] = 104.0
    pool.give_back(*second)
    clock[0] = 105.0
    timeline.close_step(finished=1, integral=pool.in_flight_integral())
    assert [(row["t"], row["in_flight"]) for row in timeline.rows] == [(0.0, 0.0), (2.0, 2.0), (5.0, 2 / 3)]


def test_failed_requests_are_no_evidence_so_the_window_stays_open_for_answers() -> None:
    """31 requests that failed every try and one good answer do not pass the window: each failure gives its seat
    back, and the window waits for answers."""
    async def scenario() -> None:
        probation = Probation(32, [ENDPOINT], "m", BUILTIN_PROFILES["qwen3"], ValidationConfig())
        for _ in range(32):
            assert await probation.admit() == "window"
        waiting = asyncio.create_task(probation.admit())
        await asyncio.sleep(0)
        assert not waiting.done(), "the window is full"
        for _ in range(31):
            probation.observe(Outcome(ENDPOINT))  # failed every try
        probation.observe(answer("thinking…"))
        assert not probation.passed and probation.error is None
        assert await waiting == "window", "a failure's seat is given back"
        for _ in range(6):
            probation.observe(answer("thinking…"))
        assert probation.passed, "seven answers are evidence enough"

    asyncio.run(scenario())


@pytest.mark.parametrize(("status", "message", "own"), [
    (400, "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens", True),
    (422, "body -> temperature: Input should be less than or equal to 2", True),
    (400, "The model `qwen3` does not exist.", False),
    (401, "Unauthorized", False),
    (403, "Forbidden", False),
    (404, "The model `qwen3` does not exist.", False),
    (404, "Not Found", False),
    (405, "Method Not Allowed", False),
])
def test_only_a_refusal_about_the_request_itself_is_the_prompts(status: int, message: str, own: bool) -> None:
    failed = RequestFailed(f"HTTP {status} from {ENDPOINT}/v1/chat/completions: {message}", status, False)
    assert failed.refused_request is own


def test_a_refusal_is_held_until_a_later_request_ends_otherwise_and_many_alike_in_a_row_are_the_endpoints() -> None:
    held: HeldRefusals[str] = HeldRefusals()
    assert held.refused(ENDPOINT, 5, "too long", "p5") == []
    assert held.answered(ENDPOINT, 3) == [], "a request sent earlier proves nothing about a later refusal"
    assert held.answered(ENDPOINT, 6) == [("too long", "p5")]
    held.refused(ENDPOINT, 7, "too long", "p7")
    assert held.refused(ENDPOINT, 8, "bad roles", "p8") == [("too long", "p7")], "another message: p7's own"
    last = 8 + REPEATED_REFUSALS - 1
    for sent in range(9, last):
        held.refused(ENDPOINT, sent, "bad roles", f"p{sent}")
        assert not held.repeated(ENDPOINT, sent)
    held.refused(ENDPOINT, last, "bad roles", "last")
    assert held.repeated(ENDPOINT, last), "the same refusal to REPEATED_REFUSALS requests sent in a row"
    assert [item for _, item in held.take(ENDPOINT)] == [f"p{sent}" for sent in range(8, last)] + ["last"]


def test_refusals_that_jump_after_the_window_stop_the_run_and_an_endpoints_are_taken_back() -> None:
    probation, _ = judge([answer("thinking…")] * 7)
    assert probation.passed
    for _ in range(200):  # a healthy run: one refusal in ten
        probation.observe(Outcome(ENDPOINT, refusal="too long"))
        assert probation.error is None and not probation.refusals_in_line
        for _ in range(9):
            probation.observe(answer("thinking…"))
        assert probation.refusals_in_line
    for _ in range(40):
        probation.observe(Outcome(ENDPOINT, refusal="the endpoint's"))
        probation.retract("the endpoint's")
    assert probation.error is None and probation.refusals_in_line, "refusals taken back are no evidence"
    for refused in range(1, 100):
        probation.observe(Outcome(ENDPOINT, refusal=f"refusal {refused}"))
        if probation.error is not None:
            break
    assert 20 < refused < 60
    assert str(probation.error).startswith(f"stopped: the server refused {min(refused, 32)} of the last 32 requests")


def test_one_server_listed_twice_is_refused() -> None:
    tree = {"run_name": "r", "data": {"source": "d.jsonl"},
            "model": {"name": "m", "profile": "qwen3", "tokenizer": "t"}}
    for twice in (["http://h:8000", "http://h:8000/v1"], ["http://h:8000/", "http://H:8000/v1/"]):
        with pytest.raises(ConfigurationError, match=r"are the same server .*list it once"):
            parse_config({**tree, "server": {"endpoints": twice}})
    assert ServerConfig(endpoints=["http://h:8000/v1", "http://g:8000"]).endpoints == ["http://h:8000", "http://g:8000"]


def test_a_generation_that_ends_short_hands_on_its_finished_shards_and_its_own_error() -> None:
    """The failed state is persisted (pickled): the shards, and the verdict with its type and exit status, survive."""
    finished = [ShardRef("generations", 0, "generations/shard-00000.jsonl", 3, "0" * 64)]
    stopped = pickle.loads(pickle.dumps(GenerationStopped(ConfigurationError("fix the key"), finished)))
    assert stopped.one_line() == "fix the key" and stopped.exit_status == 2
    outcome = generated_shards.fn(stopped, RunLocation("runs", "run"))
    assert outcome.shards == finished and type(outcome.error) is ConfigurationError
    assert generated_shards.fn(finished, RunLocation("runs", "run")) == GenerationOutcome(finished)
    crash = RuntimeError("a bug")
    assert generated_shards.fn(crash, RunLocation("runs", "run")) == GenerationOutcome([], crash)
