"""Stage 3: chat completions for every prompt, with one in-flight budget per endpoint shared by all shards.

Shards are the unit of storage and re-runs, not of concurrency: a request starts the moment any finishes,
whatever shard it belongs to. Records are appended to a shard's partial log as they complete, so a killed
run resumes without repeating a finished request; a finished shard is written atomically.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import aupdate_progress_artifact, create_progress_artifact, update_progress_artifact

from eagle3_datagen.artifacts import ShardRef, artifact_path, rejected_path, sha256_hex
from eagle3_datagen.caching import STAGE_CACHE
from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion, OpenAIClient, RequestFailed, api_key, build_chat_request
from eagle3_datagen.storage import RunStore
from tasks.health import ServerCheckFailed, diagnose

SETTINGS_FILE = "generations/settings.json"
ENDPOINT_FAILURES_BEFORE_BACKOFF = 3
ENDPOINT_MAX_COOLDOWN_S = 30.0


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


@dataclass
class _Endpoint:
    url: str
    client: OpenAIClient
    in_flight: int = 0
    failures: int = 0
    trips: int = 0
    available_at: float = 0.0
    sent: int = 0


class EndpointPool:
    """The shared in-flight budget: picks the endpoint with the most free slots, backs off failing ones."""

    def __init__(self, endpoints: list[_Endpoint], budget: int, backoff_s: float) -> None:
        self.endpoints = endpoints
        self.budget = budget
        self._backoff_s = backoff_s
        self._changed = asyncio.Condition()

    async def acquire(self) -> _Endpoint:
        async with self._changed:
            while True:
                now = time.monotonic()
                ready = [e for e in self.endpoints if e.in_flight < self.budget and e.available_at <= now]
                if ready:
                    chosen = max(ready, key=lambda e: self.budget - e.in_flight)
                    chosen.in_flight += 1
                    chosen.sent += 1
                    return chosen
                waits = [e.available_at - now for e in self.endpoints if e.available_at > now]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=min(waits) if waits else None)

    async def release(self, endpoint: _Endpoint, healthy: bool) -> None:
        """Return a slot; three failures in a row open the endpoint's breaker for a growing cool-down.

        Failures of requests that were already in flight when the breaker opened do not lengthen it, so an
        endpoint that comes back is tried again within `ENDPOINT_MAX_COOLDOWN_S`.
        """
        async with self._changed:
            endpoint.in_flight -= 1
            now = time.monotonic()
            if healthy:
                endpoint.failures = endpoint.trips = 0
            elif endpoint.available_at <= now:
                endpoint.failures += 1
                if endpoint.failures >= ENDPOINT_FAILURES_BEFORE_BACKOFF:
                    cooldown = min(ENDPOINT_MAX_COOLDOWN_S, self._backoff_s * 2**endpoint.trips)
                    endpoint.available_at = now + cooldown
                    endpoint.trips += 1
                    endpoint.failures = 0
            self._changed.notify_all()


class ProbationGate:
    """Lets only the first N requests of a run out until their reasoning is checked.

    This bounds the cost of a run that was never told to think (or whose reasoning nobody reads) to N requests.
    """

    def __init__(self, size: int, max_empty_rate: float, check: Callable[[list[Completion]], None]) -> None:
        self.size = size
        self.max_empty_rate = max_empty_rate
        self._check = check
        self._started = 0
        self._finished = 0
        self._results: list[Completion] = []
        self._open = asyncio.Event()
        self._error: BaseException | None = None
        if size == 0:
            self._open.set()

    async def admit(self) -> None:
        if not self._open.is_set() and self._started < self.size:
            self._started += 1
            return
        await self._open.wait()
        if self._error is not None:
            raise self._error

    def observe(self, completion: Completion | None) -> None:
        """Count a finished request of the probation window (None: it ended without a completion)."""
        if self._open.is_set():
            return
        self._finished += 1
        if completion is not None:
            self._results.append(completion)
        if self._finished >= self.size:
            self._evaluate()

    def _evaluate(self) -> None:
        empty = [c for c in self._results if not c.reasoning.strip()]
        rate = len(empty) / max(1, len(self._results))
        if empty and rate > self.max_empty_rate:
            try:
                self._check(empty)
                reason = "the server sent no reasoning for them"
            except ServerCheckFailed as diagnosis:
                reason = str(diagnosis)
            self._error = GenerationError(
                f"early abort: {len(empty)} of the first {len(self._results)} records have empty reasoning "
                f"({rate:.0%} > validation.max_empty_reasoning_rate {self.max_empty_rate:.0%}); {reason}"
            )
        self._open.set()


def partial_log_path(store: RunStore, index: int) -> Path:
    """Where a shard's partial log lives: beside the shard on local disk, else in a local spool folder."""
    rel = artifact_path("generations", index).replace(".jsonl", ".partial.jsonl")
    local = store.local_path(rel)
    if local is not None:
        return Path(local)
    spool = Path(os.environ.get("EAGLE3_SPOOL_DIR", Path.home() / ".cache" / "eagle3-datagen" / "partials"))
    return spool / hashlib.sha256(store.uri.encode()).hexdigest()[:16] / rel


def read_partial_log(path: Path) -> dict[int, dict[str, Any]]:
    """Finished entries by position; a torn last line (killed mid-write) is ignored."""
    done: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
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
        self.entries[entry["position"]] = entry

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.size


def _record(item: _Item, done: Completion, sample: int, samples: int) -> dict[str, Any]:
    """One generated record; with `n` samples per prompt, ids get a `:k` suffix so each stays unique."""
    return {
        "id": item.record_id if samples == 1 else f"{item.record_id}:{sample}",
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
    path = artifact_path("generations", state.ref.index)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    store.write_bytes(path, data)
    if state.log is not None:
        state.log.close()
    state.log_path.unlink(missing_ok=True)
    return ShardRef("generations", state.ref.index, path, len(records), sha256_hex(data))


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
        at = position.get(record["id"].split(":")[0])
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
        prompts = store.read_jsonl(ref.path)
        done = finished_shard(store, ref.index, prompts)
        if done is None or len(done[1]) < len(prompts):
            unfinished.append(ref.index)
    return unfinished


def check_settings(store: RunStore, settings: GenerationSettings) -> None:
    """Refuse to resume or extend a run whose generations were made with other settings."""
    fingerprint = settings.fingerprint()
    if store.exists(SETTINGS_FILE):
        recorded = store.read_json(SETTINGS_FILE)
        if recorded["fingerprint"] != fingerprint:
            raise GenerationError(
                f"run {store.uri} was generated with other settings (model, sampling, profile or prompt "
                "source differ): use a new run_name, or restore the settings recorded in "
                f"{SETTINGS_FILE}"
            )
        return
    store.write_json(SETTINGS_FILE, {"fingerprint": fingerprint, **_settings_json(settings)})


def _settings_json(settings: GenerationSettings) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(settings), default=lambda o: o.model_dump()))


async def generate_async(
    store: RunStore,
    prompt_shards: list[ShardRef],
    settings: GenerationSettings,
    server: ServerConfig,
    validation: ValidationConfig,
    log: logging.Logger | logging.LoggerAdapter[Any],
    progress_every_s: float = 5.0,
    on_progress: Callable[[float], Awaitable[Any]] | None = None,
) -> list[ShardRef]:
    """Generate every unfinished shard; returns the generation ShardRefs in shard order.

    Every `progress_every_s` a line with done/total, requests/s, tokens/s, in flight per endpoint and ETA
    goes to `log`, and the percentage done to `on_progress` (the task shows it as a Prefect artifact).
    """
    check_settings(store, settings)
    finished: dict[int, ShardRef] = {}
    states: dict[int, _ShardState] = {}
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    for ref in prompt_shards:
        prompts = store.read_jsonl(ref.path)
        previous = finished_shard(store, ref.index, prompts)
        if previous is not None and len(previous[1]) == len(prompts):
            finished[ref.index] = previous[0]
            continue
        state = _ShardState(ref, len(prompts), partial_log_path(store, ref.index))
        state.entries = {**(previous[1] if previous else {}), **read_partial_log(state.log_path)}
        states[ref.index] = state
        for position, prompt in enumerate(prompts):
            if position in state.entries:
                continue
            seed = None if settings.generation.seed is None else settings.generation.seed + prompt["row"]
            queue.put_nowait(_Item(ref.index, position, prompt["id"], prompt["messages"], seed))
    for index, state in list(states.items()):
        if state.complete:
            finished[index] = finalize_shard(store, state)
            del states[index]
    total = queue.qsize()
    if total == 0:
        return [finished[r.index] for r in prompt_shards]

    run_budget = await shared_budget(server) if server.share_budget_across_runs else _no_shared_budget
    key = api_key(server)
    clients = [OpenAIClient(url, key, server.request_timeout_s, server.max_in_flight) for url in server.endpoints]
    pool = EndpointPool([_Endpoint(c.base_url, c) for c in clients], server.max_in_flight, server.retry_backoff_s)
    gate = ProbationGate(
        min(validation.early_abort_after, total),
        validation.max_empty_reasoning_rate,
        lambda empty: diagnose("the server", [settings.model], empty, settings.profile,
                               validation.allow_inline_reasoning),
    )
    stats = {"done": 0, "tokens": 0, "retries": 0, "failed": 0}
    started_at = time.monotonic()

    async def send(item: _Item) -> Completion | None:
        body = build_chat_request(settings.model, item.messages, settings.profile, settings.generation,
                                  seed=item.seed)
        for attempt in range(server.max_retries + 1):
            endpoint = await pool.acquire()
            try:
                async with run_budget(endpoint.url):
                    completions = await endpoint.client.chat(body, settings.profile)
            except RequestFailed as error:
                await pool.release(endpoint, healthy=not error.retryable)
                if not error.retryable:
                    states[item.shard].append({"position": item.position, "rejected": {
                        "id": item.record_id, "stage": "generations", "reason": str(error)}})
                    return None
                if attempt == server.max_retries:
                    stats["failed"] += 1
                    log.warning("record %s not generated after %d tries: %s", item.record_id, attempt + 1, error)
                    return None
                stats["retries"] += 1
                await asyncio.sleep(server.retry_backoff_s * 2**attempt * random.uniform(0.5, 1.5))
                continue
            await pool.release(endpoint, healthy=True)
            samples = len(completions)
            records = [_record(item, done, k, samples) for k, done in enumerate(completions)]
            states[item.shard].append({"position": item.position, "records": records})
            stats["tokens"] += int(completions[0].usage.get("completion_tokens") or 0)
            return completions[0]
        return None

    async def worker() -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await gate.admit()
            completion = await send(item)
            gate.observe(completion)
            stats["done"] += 1
            state = states[item.shard]
            if state.complete:
                finished[item.shard] = finalize_shard(store, state)

    async def report_progress() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            elapsed = time.monotonic() - started_at
            rate = stats["done"] / elapsed
            eta = (total - stats["done"]) / rate if rate else float("inf")
            flights = " ".join(f"{e.url}={e.in_flight}" for e in pool.endpoints)
            log.info("generation %d/%d  %.1f req/s  %.0f tok/s  in flight %s  ETA %.0fs",
                     stats["done"], total, rate, stats["tokens"] / elapsed, flights, eta)
            if on_progress is not None:
                await on_progress(100.0 * stats["done"] / total)

    workers = [asyncio.create_task(worker()) for _ in range(server.max_in_flight * len(clients))]
    reporter = asyncio.create_task(report_progress())
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for pending in workers:
            pending.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    finally:
        reporter.cancel()
        for state in states.values():
            if state.log is not None:
                state.log.close()
        await asyncio.gather(*(c.aclose() for c in clients))
    unfinished = [i for i in states if i not in finished]
    if unfinished:
        raise GenerationError(
            f"{stats['failed']} records could not be generated (servers unreachable or failing) in shards "
            f"{unfinished}; finished records are kept: run again to resume"
        )
    log.info("generation done: %d requests, %d retries, %.1fs", total, stats["retries"],
             time.monotonic() - started_at)
    return [finished[r.index] for r in prompt_shards]


@task(name="generate", retries=1, persist_result=True, cache_policy=STAGE_CACHE - "server")
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
    artifact = create_progress_artifact(0.0, key="generation-progress", description=f"generation of {run_name}")

    done = asyncio.run(generate_async(store, prompt_shards, settings, server, validation, get_run_logger(),
                                      on_progress=lambda percent: aupdate_progress_artifact(artifact, percent)))
    update_progress_artifact(artifact, 100.0)
    return done
