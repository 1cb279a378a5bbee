"""Stage 3: chat completions for every prompt, with one in-flight budget per endpoint shared by all shards.

Shards are the unit of storage and re-runs, not of concurrency: a request starts the moment any finishes,
whatever shard it belongs to. Records are appended to a shard's partial log as they complete, so a killed
run resumes without repeating a finished request; a finished shard is written atomically.

Failure is bounded: an endpoint that keeps failing is backed off (one warning when it goes down, one when it
recovers), and the run gives up, keeping what it finished, once every endpoint has answered
`server.max_consecutive_errors` requests in a row with an error, or after `server.give_up_after_s` without a
success. Stage verdicts are UserErrors, never retried by Prefect.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from eagle3_datagen.artifacts import ShardRef, artifact_path, prompt_id_of, rejected_path, sample_id, sha256_hex
from eagle3_datagen.caching import STAGE_CACHE
from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.diagnosis import ServerCheckFailed, diagnose
from eagle3_datagen.errors import UserError, retry_unless_user_error
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion, OpenAIClient, RequestFailed, api_key, build_chat_request
from eagle3_datagen.storage import RunStore

SETTINGS_FILE = "generations/settings.json"
ENDPOINT_FAILURES_BEFORE_BACKOFF = 3
ENDPOINT_MAX_COOLDOWN_S = 30.0
PROGRESS_PUSH_EVERY_S = 5.0

Log = logging.Logger | logging.LoggerAdapter[Any]
Admission = Literal["window", "open", "aborted"]


class GenerationError(UserError):
    """Generation could not finish; finished records are kept and a re-run resumes from them."""


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that changes a generated record. A resume under different settings is refused."""

    model: str
    profile: ModelProfile
    generation: GenerationConfig
    prompt_source: str

    def fingerprint(self) -> str:
        payload = {
            "model": self.model,
            "profile": self.profile.model_dump(),
            "generation": self.generation.model_dump(),
            "prompt_source": self.prompt_source,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class _Item:
    shard: int
    position: int
    record_id: str
    messages: list[dict[str, str]]
    seed: int | None


@dataclass(frozen=True)
class _Outcome:
    """How one prompt ended: answered, refused by the server (with its reason), failed, or abandoned."""

    completion: Completion | None = None
    refusal: str | None = None
    abandoned: bool = False  # the run gave up before this prompt was answered; it stays pending


@dataclass
class _Endpoint:
    url: str
    client: OpenAIClient
    in_flight: int = 0
    failures: int = 0  # in a row, while up
    trips: int = 0
    down_since: float | None = None
    available_at: float = 0.0
    trial_in_flight: bool = False
    broken_answers: int = 0  # HTTP 500 or protocol-breaking answers in a row
    dead: bool = False  # given up on: no more requests go to it


class EndpointPool:
    """The shared in-flight budget: picks the endpoint with the most free slots, backs off failing ones.

    A failing endpoint is marked down after three failures in a row and then gets one trial request per
    cool-down (1, 2, 4… up to 30 s) until one succeeds: a server that is away or busy (refused connections,
    timeouts, 429/502/503/504) is waited for, up to `give_up_after_s` without any success anywhere. A server
    that answers, but with errors (HTTP 500, a response that breaks the protocol), is given up on after
    `max_consecutive_errors` such answers in a row. The pool closes, and the run gives up, when no endpoint
    is left or the wait is over.
    """

    def __init__(self, endpoints: list[_Endpoint], server: ServerConfig, log: Log) -> None:
        self.endpoints = endpoints
        self.budget = server.max_in_flight
        self._server = server
        self._log = log
        self._changed = asyncio.Condition()
        self._timers: list[asyncio.TimerHandle] = []
        self._wakers: set[asyncio.Task[None]] = set()
        self.last_success = time.monotonic()
        self.last_error = ""
        self.gave_up: str | None = None

    def _ready(self, endpoint: _Endpoint, now: float) -> bool:
        if endpoint.dead:
            return False
        if endpoint.down_since is None:
            return endpoint.in_flight < self.budget
        return now >= endpoint.available_at and not endpoint.trial_in_flight

    async def acquire(self) -> tuple[_Endpoint, bool] | None:
        """(endpoint, is a trial of a down endpoint) with a slot taken; None once the pool has given up."""
        async with self._changed:
            while self.gave_up is None:
                now = time.monotonic()
                ready = [e for e in self.endpoints if self._ready(e, now)]
                if ready:
                    chosen = max(ready, key=lambda e: self.budget - e.in_flight)
                    trial = chosen.down_since is not None
                    chosen.trial_in_flight |= trial
                    chosen.in_flight += 1
                    return chosen, trial
                await self._changed.wait()
            return None

    async def release(self, endpoint: _Endpoint, trial: bool, error: RequestFailed | None) -> None:
        """Return a slot; `error` is a server or transport failure (a refusal is a healthy answer)."""
        async with self._changed:
            endpoint.in_flight -= 1
            endpoint.trial_in_flight &= not trial
            now = time.monotonic()
            if error is None:
                self._succeeded(endpoint, trial, now)
            else:
                self._answered_broken(endpoint, error)
                if not endpoint.dead and (endpoint.down_since is None or trial):
                    self._failed(endpoint, trial, error, now)
            self.check(now)
            self._changed.notify_all()

    def _succeeded(self, endpoint: _Endpoint, trial: bool, now: float) -> None:
        """A success; only a trial's brings a down endpoint back (one sent before it went down proves nothing)."""
        self.last_success = now
        if endpoint.down_since is not None and not trial:
            return
        endpoint.failures = endpoint.trips = endpoint.broken_answers = 0
        if endpoint.down_since is not None:
            self._log.warning("endpoint %s recovered after %.0fs down", endpoint.url, now - endpoint.down_since)
            endpoint.down_since = None

    def _answered_broken(self, endpoint: _Endpoint, error: RequestFailed) -> None:
        self.last_error = str(error)
        endpoint.broken_answers += error.broken_answer
        limit = self._server.max_consecutive_errors
        if endpoint.broken_answers < limit or endpoint.dead:
            return
        endpoint.dead = True
        if any(not e.dead for e in self.endpoints):
            self._log.warning("endpoint %s answered %d requests in a row with an error (server.max_consecutive_errors"
                              "): no more requests go to it; last: %s", endpoint.url, limit, error)

    def _failed(self, endpoint: _Endpoint, trial: bool, error: RequestFailed, now: float) -> None:
        if not trial:
            endpoint.failures += 1
            if endpoint.failures < ENDPOINT_FAILURES_BEFORE_BACKOFF:
                return
            endpoint.down_since = now
        cooldown = min(ENDPOINT_MAX_COOLDOWN_S, self._server.retry_backoff_s * 2**endpoint.trips)
        endpoint.trips += 1
        endpoint.failures = 0
        endpoint.available_at = now + cooldown
        if not trial:
            self._log.warning("endpoint %s is down (%d failures in a row, last: %s): backing off, next try in %.1fs",
                              endpoint.url, ENDPOINT_FAILURES_BEFORE_BACKOFF, error, cooldown)
        self._timers.append(asyncio.get_running_loop().call_later(cooldown, self._wake))

    def _wake(self) -> None:
        """A cool-down ended: let waiting workers look again."""
        waker = asyncio.get_running_loop().create_task(self._notify())
        self._wakers.add(waker)
        waker.add_done_callback(self._wakers.discard)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def check(self, now: float) -> None:
        """Give up (and wake every waiting worker) when the servers are judged gone."""
        if self.gave_up is not None:
            return
        limit = self._server.max_consecutive_errors
        silent = now - self.last_success
        alive = [e for e in self.endpoints if not e.dead]
        if not alive:
            self.gave_up = (f"every endpoint answered {limit} requests in a row with an error "
                            f"(server.max_consecutive_errors {limit})")
        elif all(e.down_since is not None for e in alive) and silent >= self._server.give_up_after_s:
            self.gave_up = (f"no endpoint answered successfully for {silent:.0f}s "
                            f"(server.give_up_after_s {self._server.give_up_after_s:.0f})")
        else:
            return
        self.gave_up += f"; last error: {self.last_error}"
        self._changed.notify_all()

    async def check_now(self) -> None:
        async with self._changed:
            self.check(time.monotonic())

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()


class ProbationGate:
    """Lets only the first N requests of a run out until their answers are checked.

    This bounds the cost of a run that was never told to think, whose reasoning nobody reads, or whose every
    request the server refuses (a context too small for max_tokens, say) to N requests.
    """

    def __init__(self, size: int, validation: ValidationConfig, check: Callable[[list[Completion]], None]) -> None:
        self.size = size
        self._validation = validation
        self._check = check
        self._started = 0
        self._finished = 0
        self._results: list[Completion] = []
        self._refusals: list[str] = []
        self._open = asyncio.Event()
        self.error: GenerationError | None = None
        self._abandoned = False
        if size == 0:
            self._open.set()

    @property
    def passed(self) -> bool:
        return self._open.is_set() and self.error is None and not self._abandoned

    def abandon(self) -> None:
        """The run gave up before the window was judged: let every waiting worker go and stop."""
        self._abandoned = True
        self._open.set()

    async def admit(self) -> Admission:
        if not self._open.is_set() and self._started < self.size:
            self._started += 1
            return "window"
        await self._open.wait()
        return "open" if self.error is None else "aborted"

    def observe(self, outcome: _Outcome) -> None:
        """Count a finished request of the window."""
        if self._open.is_set():
            return
        self._finished += 1
        if outcome.completion is not None:
            self._results.append(outcome.completion)
        if outcome.refusal is not None:
            self._refusals.append(outcome.refusal)
        if self._finished >= self.size:
            self.error = self._verdict()
            self._open.set()

    def _verdict(self) -> GenerationError | None:
        answered = len(self._results) + len(self._refusals)
        refused_rate = len(self._refusals) / max(1, answered)
        if self._refusals and refused_rate > 1 - self._validation.min_accepted_rate:
            reason, _ = Counter(self._refusals).most_common(1)[0]
            return GenerationError(
                f"early abort: the server refused {len(self._refusals)} of the first {answered} requests "
                f"({refused_rate:.0%}; validation.min_accepted_rate {self._validation.min_accepted_rate:.0%} "
                f"cannot be met): {reason}"
            )
        empty = [c for c in self._results if not c.reasoning.strip()]
        rate = len(empty) / max(1, len(self._results))
        if not empty or rate <= self._validation.max_empty_reasoning_rate:
            return None
        try:
            self._check(empty)
            reason = "the server sent no reasoning for them"
        except ServerCheckFailed as diagnosis:
            reason = str(diagnosis)
        return GenerationError(
            f"early abort: {len(empty)} of the first {len(self._results)} records have empty reasoning "
            f"({rate:.0%} > validation.max_empty_reasoning_rate {self._validation.max_empty_reasoning_rate:.0%}); "
            f"{reason}"
        )


def partial_log_path(store: RunStore, index: int) -> Path:
    """Where a shard's partial log lives: beside the shard on local disk, else in a local spool folder."""
    rel = artifact_path("generations", index).replace(".jsonl", ".partial.jsonl")
    local = store.local_path(rel)
    if local is not None:
        return Path(local)
    spool = Path(os.environ.get("EAGLE3_SPOOL_DIR", Path.home() / ".cache" / "eagle3-datagen" / "partials"))
    return spool / hashlib.sha256(store.uri.encode()).hexdigest()[:16] / rel


def read_partial_log(path: Path) -> dict[int, dict[str, Any]]:
    """Finished entries by position; a torn last line (killed mid-write) is ignored.

    A `discard` line voids the entry before it at that position (records of an aborted early-abort window),
    so the prompt is asked again once the cause is fixed.
    """
    done: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "discard" in entry:
            done.pop(entry["position"], None)
        else:
            done[entry["position"]] = entry
    return done


@dataclass
class _ShardState:
    ref: ShardRef
    size: int
    log_path: Path
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    log: Any = None

    def append(self, entry: dict[str, Any]) -> None:
        if self.log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log = self.log_path.open("a", encoding="utf-8")
        self.log.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.log.flush()
        if "discard" in entry:
            self.entries.pop(entry["position"], None)
        else:
            self.entries[entry["position"]] = entry

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.size


def _record(item: _Item, done: Completion, sample: int, samples: int) -> dict[str, Any]:
    """One generated record; with `n` samples per prompt, each sample's id gets its own suffix."""
    return {
        "id": sample_id(item.record_id, sample, samples),
        "messages": item.messages,
        "reasoning": done.reasoning,
        "content": done.content,
        "finish_reason": done.finish_reason,
        "reasoning_source": done.reasoning_source,
        "prompt_token_ids": done.prompt_token_ids,
        "completion_token_ids": done.completion_token_ids,
        "usage": done.usage,
    }


def finalize_shard(store: RunStore, state: _ShardState) -> ShardRef:
    """Write the finished shard atomically (records in prompt order), its rejections, then drop the log."""
    ordered = [state.entries[p] for p in sorted(state.entries)]
    records = [record for e in ordered for record in e.get("records", [])]
    rejected = [e["rejected"] for e in ordered if "rejected" in e]
    if rejected:
        store.write_jsonl(rejected_path("generations", state.ref.index), rejected)
    ref = store.write_shard("generations", state.ref.index, records)
    state.close()
    state.log_path.unlink(missing_ok=True)
    return ref


def finished_shard(
    store: RunStore, index: int, prompts: list[dict[str, Any]]
) -> tuple[ShardRef, dict[int, dict[str, Any]]] | None:
    """A finished shard's ref, and its records and rejections keyed by their prompt's current position.

    None if the shard was never finished. Fewer entries than prompts means the prompt shard grew (a dataset
    that gained rows, say): only the new prompts are generated, the finished records are kept.
    """
    path = artifact_path("generations", index)
    if not store.exists(path):
        return None
    data = store.read_bytes(path)
    position = {prompt["id"]: i for i, prompt in enumerate(prompts)}
    entries: dict[int, dict[str, Any]] = {}
    for line in data.decode("utf-8").splitlines():
        record = json.loads(line)
        at = position.get(prompt_id_of(record["id"]))
        if at is not None:
            entries.setdefault(at, {"position": at, "records": []})["records"].append(record)
    rejected = rejected_path("generations", index)
    for row in store.read_jsonl(rejected) if store.exists(rejected) else []:
        at = position.get(row["id"])
        if at is not None:
            entries[at] = {"position": at, "rejected": row}
    return ShardRef("generations", index, path, data.count(b"\n"), sha256_hex(data)), entries


def budget_limit_name(endpoint: str) -> str:
    return "eagle3:" + endpoint.removeprefix("http://").removeprefix("https://")


async def shared_budget(server: ServerConfig) -> Callable[[str], AbstractAsyncContextManager[Any]]:
    """One Prefect global concurrency limit per endpoint, so concurrent runs share its in-flight budget."""
    from prefect.client.orchestration import get_client
    from prefect.concurrency.asyncio import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    async with get_client() as client:
        for url in server.endpoints:
            name = budget_limit_name(url)
            try:
                await client.upsert_global_concurrency_limit_by_name(name, server.max_in_flight)
            except ObjectAlreadyExists:  # another run created it between the look-up and the create
                await client.upsert_global_concurrency_limit_by_name(name, server.max_in_flight)
    return lambda url: concurrency(budget_limit_name(url), occupy=1, strict=True)


def _no_shared_budget(url: str) -> AbstractAsyncContextManager[None]:
    return contextlib.nullcontext()


def unfinished_shards(prompt_shards: list[ShardRef], output_uri: str, run_name: str) -> list[int]:
    """Shards with prompts not yet generated: the server is needed only if this is non-empty."""
    store = RunStore(output_uri, run_name)
    unfinished = []
    for ref in prompt_shards:
        prompts = store.read_shard_records(ref)
        done = finished_shard(store, ref.index, prompts)
        if done is None or len(done[1]) < len(prompts):
            unfinished.append(ref.index)
    return unfinished


def check_settings(store: RunStore, settings: GenerationSettings) -> None:
    """Refuse to resume or extend a run whose generations were made with other settings."""
    if store.exists(SETTINGS_FILE) and store.read_json(SETTINGS_FILE)["fingerprint"] != settings.fingerprint():
        raise GenerationError(
            f"run {store.uri} was generated with other settings (model, sampling, profile or prompt "
            f"source differ): use a new run_name, or restore the settings recorded in {SETTINGS_FILE}"
        )


def record_settings(store: RunStore, settings: GenerationSettings) -> None:
    """Pin the settings once a record is kept under them (after the early-abort window passed)."""
    if not store.exists(SETTINGS_FILE):
        payload = json.loads(json.dumps(asdict(settings), default=lambda o: o.model_dump()))
        store.write_json(SETTINGS_FILE, {"fingerprint": settings.fingerprint(), **payload})


@dataclass
class _Counts:
    accepted: int = 0  # prompts answered (their records kept)
    rejected: int = 0  # prompts the server refused, each with its reason
    failed: int = 0  # prompts that failed every try
    retries: int = 0
    tokens: int = 0


class GenerationScheduler:
    """Generates every unfinished prompt of a run through one shared endpoint pool.

    `plan` reads the prompt shards and resumes from finished shards and partial logs; `run` sends the rest and
    returns the generation ShardRefs in shard order, or raises a GenerationError that says what to do next.
    """

    def __init__(self, store: RunStore, settings: GenerationSettings, server: ServerConfig,
                 validation: ValidationConfig, log: Log, progress_every_s: float = 5.0,
                 on_progress: Callable[[float], None] | None = None) -> None:
        self.store = store
        self.settings = settings
        self.server = server
        self.validation = validation
        self.log = log
        self.progress_every_s = progress_every_s
        self.on_progress = on_progress
        self.finished: dict[int, ShardRef] = {}
        self.states: dict[int, _ShardState] = {}
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.counts = _Counts()
        self.total = 0
        self._window: list[_Item] = []
        self._swept = False  # shards completed inside the window were finalized once it passed
        self._kept_before = False  # the run already held records when this attempt started
        self._run_budget: Callable[[str], AbstractAsyncContextManager[Any]] = _no_shared_budget

    def plan(self, prompt_shards: list[ShardRef]) -> None:
        check_settings(self.store, self.settings)
        seed_base = self.settings.generation.seed
        for ref in prompt_shards:
            prompts = self.store.read_shard_records(ref)
            previous = finished_shard(self.store, ref.index, prompts)
            if previous is not None and len(previous[1]) == len(prompts):
                self.finished[ref.index] = previous[0]
                continue
            state = _ShardState(ref, len(prompts), partial_log_path(self.store, ref.index))
            state.entries = {**(previous[1] if previous else {}), **read_partial_log(state.log_path)}
            self.states[ref.index] = state
            for position, prompt in enumerate(prompts):
                if position not in state.entries:
                    seed = None if seed_base is None else seed_base + prompt["row"]
                    self.queue.put_nowait(_Item(ref.index, position, prompt["id"], prompt["messages"], seed))
        self._kept_before = bool(self.finished) or any(state.entries for state in self.states.values())
        for index, state in list(self.states.items()):
            if state.complete:
                self._finalize(index)

    def _finalize(self, index: int) -> None:
        self.finished[index] = finalize_shard(self.store, self.states.pop(index))

    async def run(self, prompt_shards: list[ShardRef]) -> list[ShardRef]:
        self.plan(prompt_shards)
        self.total = self.queue.qsize()
        if self.total == 0:
            return [self.finished[r.index] for r in prompt_shards]
        if self.server.share_budget_across_runs:
            self._run_budget = await shared_budget(self.server)
        key = api_key(self.server)
        clients = [OpenAIClient(url, key, self.server.request_timeout_s, self.server.max_in_flight)
                   for url in self.server.endpoints]
        self.pool = EndpointPool([_Endpoint(c.base_url, c) for c in clients], self.server, self.log)
        settings = self.settings
        self.gate = ProbationGate(
            min(self.validation.early_abort_after, self.total), self.validation,
            lambda empty: diagnose("the server", [settings.model], empty, settings.profile,
                                   self.validation.allow_inline_reasoning),
        )
        self.started_at = time.monotonic()
        workers = [asyncio.create_task(self._worker()) for _ in range(self.server.max_in_flight * len(clients))]
        reporter = asyncio.create_task(self._report())
        try:
            await asyncio.gather(*workers)
        finally:
            for pending in [*workers, reporter]:
                pending.cancel()
            await asyncio.gather(*workers, reporter, return_exceptions=True)
            self.pool.close()
            for state in self.states.values():
                state.close()
            await asyncio.gather(*(c.aclose() for c in clients))
        self._raise_if_short()
        self.log.info("generation done: %d prompts, %d retries, %.1fs", self.total, self.counts.retries,
                      time.monotonic() - self.started_at)
        return [self.finished[r.index] for r in prompt_shards]

    async def _worker(self) -> None:
        while not self.queue.empty():
            item = self.queue.get_nowait()
            admission = await self.gate.admit()
            if admission == "aborted":
                return
            if admission == "window":
                self._window.append(item)
            outcome = await self._send(item)
            if outcome.abandoned:
                self.gate.abandon()
                return
            self.gate.observe(outcome)
            if self.gate.error is not None:
                return
            if self.gate.passed:
                self._after_pass(item)

    def _after_pass(self, item: _Item) -> None:
        """Finalize shards as they complete; the first time, also those completed inside the window."""
        if not self._swept:
            self._swept = True
            record_settings(self.store, self.settings)
            for index in [i for i, state in self.states.items() if state.complete]:
                self._finalize(index)
        elif item.shard in self.states and self.states[item.shard].complete:
            self._finalize(item.shard)

    async def _send(self, item: _Item) -> _Outcome:
        settings = self.settings
        body = build_chat_request(settings.model, item.messages, settings.profile, settings.generation,
                                  seed=item.seed)
        for attempt in range(self.server.max_retries + 1):
            slot = await self.pool.acquire()
            if slot is None:
                return _Outcome(abandoned=True)
            endpoint, trial = slot
            try:
                async with self._run_budget(endpoint.url):
                    completions = await endpoint.client.chat(body, settings.profile)
            except RequestFailed as error:
                await self.pool.release(endpoint, trial, error if error.retryable else None)
                if not error.retryable:
                    self.states[item.shard].append({"position": item.position, "rejected": {
                        "id": item.record_id, "stage": "generations", "reason": str(error)}})
                    self.counts.rejected += 1
                    return _Outcome(refusal=str(error))
                if attempt == self.server.max_retries:
                    self.counts.failed += 1
                    self.log.debug("record %s not generated after %d tries: %s", item.record_id, attempt + 1, error)
                    return _Outcome()
                self.counts.retries += 1
                await asyncio.sleep(self.server.retry_backoff_s * 2**attempt * random.uniform(0.5, 1.5))
                continue
            await self.pool.release(endpoint, trial, None)
            records = [_record(item, done, k, len(completions)) for k, done in enumerate(completions)]
            self.states[item.shard].append({"position": item.position, "records": records})
            self.counts.accepted += 1
            self.counts.tokens += int(completions[0].usage.get("completion_tokens") or 0)
            return _Outcome(completion=completions[0])
        raise AssertionError("unreachable")

    def _remaining(self) -> int:
        return self.total - self.counts.accepted - self.counts.rejected - self.counts.failed

    async def _report(self) -> None:
        """Every `progress_every_s`: counts, rates and in flight; an ETA only while requests complete."""
        done_before = 0
        while True:
            await asyncio.sleep(self.progress_every_s)
            await self.pool.check_now()
            counts, elapsed = self.counts, time.monotonic() - self.started_at
            done = self.total - self._remaining()
            recent = (done - done_before) / self.progress_every_s
            done_before = done
            eta = f"ETA {self._remaining() / recent:.0f}s" if recent else "ETA unknown (no request completed lately)"
            flights = " ".join(f"{e.url}={e.in_flight}" for e in self.pool.endpoints)
            self.log.info("generation: %d accepted, %d rejected, %d failed, %d remaining  %.1f req/s  %.0f tok/s  "
                          "in flight %s  %s", counts.accepted, counts.rejected, counts.failed, self._remaining(),
                          done / elapsed, counts.tokens / elapsed, flights, eta)
            if self.on_progress is not None:
                self.on_progress(100.0 * done / self.total)

    def _raise_if_short(self) -> None:
        """Turn an unfinished generation into one error that says what was kept and what to do."""
        if self.gate.error is not None:
            self._discard_window()
            raise self.gate.error
        kept = sum(ref.num_records for ref in self.finished.values()) + sum(
            len(state.entries) for state in self.states.values())
        if self.pool.gave_up is not None:
            raise GenerationError(
                f"gave up: {self.pool.gave_up}. {kept} finished records are kept: fix the servers, then run "
                "again to resume"
            )
        unfinished = sorted(self.states)
        if unfinished:
            raise GenerationError(
                f"{self.counts.failed} records could not be generated (servers unreachable or failing) in shards "
                f"{unfinished}; finished records are kept: run again to resume"
            )

    def _discard_window(self) -> None:
        """Void what the aborted window produced, so a run after the fix asks those prompts again."""
        reason = "early abort window"
        for item in self._window:
            state = self.states.get(item.shard)
            if state is not None and item.position in state.entries:
                state.append({"position": item.position, "discard": reason})
        for state in self.states.values():
            state.close()
        if not self._kept_before:
            self.store.remove(SETTINGS_FILE)


async def generate_async(
    store: RunStore,
    prompt_shards: list[ShardRef],
    settings: GenerationSettings,
    server: ServerConfig,
    validation: ValidationConfig,
    log: Log,
    progress_every_s: float = 5.0,
    on_progress: Callable[[float], None] | None = None,
) -> list[ShardRef]:
    """Generate every unfinished shard; returns the generation ShardRefs in shard order."""
    scheduler = GenerationScheduler(store, settings, server, validation, log, progress_every_s, on_progress)
    return await scheduler.run(prompt_shards)


class _ProgressArtifact:
    """The Prefect progress artifact, pushed from a thread: the event loop never waits on the Prefect API."""

    def __init__(self, description: str) -> None:
        self._id = create_progress_artifact(0.0, key="generation-progress", description=description)
        self._percent = self._shown = 0.0
        self._stop = threading.Event()
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=lambda: context.run(self._push), daemon=True)

    def set(self, percent: float) -> None:
        self._percent = percent

    def _push(self) -> None:
        while not self._stop.wait(PROGRESS_PUSH_EVERY_S):
            self._flush()

    def _flush(self) -> None:
        if self._percent != self._shown:
            self._shown = self._percent
            update_progress_artifact(self._id, self._shown)

    def __enter__(self) -> _ProgressArtifact:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=PROGRESS_PUSH_EVERY_S * 2)
        if exc[0] is None:
            self._percent = 100.0
        self._flush()


@task(name="generate", retries=1, retry_condition_fn=retry_unless_user_error, persist_result=True,
      cache_policy=STAGE_CACHE - "server")
def generate(
    prompt_shards: list[ShardRef],
    settings: GenerationSettings,
    server: ServerConfig,
    validation: ValidationConfig,
    output_uri: str,
    run_name: str,
) -> list[ShardRef]:
    """Generate all shards with one shared in-flight budget; resumes from partial logs."""
    store = RunStore(output_uri, run_name)
    with _ProgressArtifact(f"generation of {run_name}") as progress:
        return asyncio.run(generate_async(store, prompt_shards, settings, server, validation, get_run_logger(),
                                          on_progress=progress.set))
