"""Chat completions for every prompt of a run, with one in-flight budget per endpoint shared by all shards.

Shards are the unit of storage and re-runs, not of concurrency: a request starts the moment any slot frees up,
whatever shard it belongs to. One dispatcher takes a slot, then a prompt, and starts its request; once the run is
open, a request that ends carries on with the next prompt on its slot, so the dispatcher only fills slots that
free up or are added; retries wait for slots before new prompts. Failure is bounded: an endpoint that keeps
failing is backed off (one warning when it goes down, one when it recovers), and the run gives up, keeping what it
finished, once no endpoint is left or none has succeeded for `server.give_up_after_s`. Stage verdicts are
UserErrors, never retried by Prefect.

Cancel means stop: once the `stop` event is set (from another thread: the flow run got SIGTERM or Ctrl-C, or was
cancelled), no request is sent any more, those in flight are abandoned (their prompts stay unanswered, asked by the
next run), every partial log is flushed and closed, and `run` raises `GenerationCancelled`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from eagle3_datagen.artifacts import MANIFEST, ShardRef
from eagle3_datagen.config import ServerConfig, ValidationConfig
from eagle3_datagen.conversations import answer_of
from eagle3_datagen.errors import Log
from eagle3_datagen.images import as_sent, image_names
from eagle3_datagen.profiles import ModeSpec
from eagle3_datagen.protocol import Completion, OpenAIClient, RequestFailed, api_key, build_chat_request
from eagle3_datagen.storage import RunStore
from tasks.generation.budget import AUTO_CAP, AUTO_START, follow_load
from tasks.generation.pool import Endpoint, EndpointPool, HeldRefusals, refused_all, repeated_refusal
from tasks.generation.probation import MIN_WINDOW, Outcome, Probation
from tasks.generation.records import (
    SETTINGS_FILE,
    GenerationError,
    GenerationSettings,
    Prompt,
    ShardState,
    answer_pool,
    answers_beyond,
    drop_other_spools,
    finalize_shard,
    marked_finished,
    new_records,
    pin_settings,
    resume_shard,
    retire_generations_beyond,
    rollout_prompt,
)

# how often the event loop looks at the stop event (set from another thread, which cannot wake the loop): a stop
# acts within this; five wake-ups a second cost the client nothing it would notice
STOP_POLL_S = 0.2
MALFORMED = "malformed answer to each of"  # how the rejection of a prompt answered malformed on every try begins


class GenerationCancelled(GenerationError):
    """Generation was stopped from outside (a termination signal, Ctrl-C, a cancel): what was logged is kept."""

    def __init__(self) -> None:
        super().__init__("cancelled: generation stopped by a termination signal or a cancel; run again to resume "
                         "(finished records are kept)")


class StallClock(selectors.DefaultSelector):
    """The stage's event-loop selector, which also times the loop's work between two polls: the longest such
    stretch is the longest time every request in flight waited on this process.

    Why not a ticker: every wake-up of an idle loop costs CPU the client needs; this costs two clock reads per
    loop turn and never wakes the loop.
    """

    def __init__(self) -> None:
        super().__init__()
        self.longest_s = 0.0
        self._polled_at: float | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self._polled_at is not None:
            self.longest_s = max(self.longest_s, time.monotonic() - self._polled_at)
        ready = super().select(timeout)
        self._polled_at = time.monotonic()
        return ready

    def restart(self) -> None:
        self.longest_s, self._polled_at = 0.0, None


def malformed_answer(error: RequestFailed, tries: int) -> str:
    """A prompt's rejection reason when every try was answered with a body that breaks the protocol: the error's
    one line (which names the endpoint and what broke)."""
    return f"{MALFORMED} {tries} tries: {' '.join(str(error).split())}"


def alike(refusal: str) -> str:
    """What a held refusal is compared by (`HeldRefusals`): its message, but every malformed answer alike, for the
    excerpt of the body in each names that response (its id): an endpoint broken for every prompt answers each
    differently, and must not pass for one that refuses each prompt for a reason of its own."""
    return MALFORMED if refusal.startswith(MALFORMED) else refusal


def reasons(held: list[tuple[str, tuple[str, Prompt]]]) -> list[tuple[str, Prompt]]:
    """Held refusals as (reason, prompt): the refusal as its prompt's rejection gives it."""
    return [item for _, item in held]


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
                await client.upsert_global_concurrency_limit_by_name(name, int(server.max_in_flight))
            except ObjectAlreadyExists:  # another run created it between the look-up and the create
                await client.upsert_global_concurrency_limit_by_name(name, int(server.max_in_flight))
    return lambda url: concurrency(budget_limit_name(url), occupy=1, strict=True)


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
    returns the generation ShardRefs in shard order, or raises a UserError that says what to do next.
    """

    def __init__(self, store: RunStore, settings: GenerationSettings, server: ServerConfig,
                 validation: ValidationConfig, log: Log, progress_every_s: float = 5.0,
                 on_progress: Callable[[float], None] | None = None, sequence_source: str = "auto",
                 stop: threading.Event | None = None) -> None:
        self.store = store
        # set from another thread (the flow run stops): send nothing more, and end cancelled
        self.stop = stop if stop is not None else threading.Event()
        self._stopped = False  # the stop was seen: the run is ending
        self.sequence_source = sequence_source  # sequences.source: whether servers without token ids are refused
        self.settings = settings
        # each mode's spec, resolved once (a profile without `modes` derives its specs on every look-up)
        self._mode_specs: dict[str | None, ModeSpec] = {None: settings.profile.mode(None),
                                                         **settings.profile.mode_specs}
        self.server = server
        self.validation = validation
        self.log = log
        self.progress_every_s = progress_every_s
        self.on_progress = on_progress
        self.finished: dict[int, ShardRef] = {}
        self.states: dict[int, ShardState] = {}
        self.queue: deque[Prompt] = deque()  # prompts to ask, filled a few shards ahead (`_refill`)
        self._unqueued: deque[ShardRef] = deque()  # unfinished shards whose prompts are not queued yet
        self._lookahead = 0
        self._reading: asyncio.Future[list[Prompt]] | None = None  # the next shard's prompts, read in a thread
        self.counts = _Counts()
        self.total = 0
        self._window: list[Prompt] = []
        # refusals not yet known to be their prompts' own, each held under what it is compared by (`alike`)
        self._held: HeldRefusals[tuple[str, Prompt]] = HeldRefusals()
        self._cleared: list[tuple[str, Prompt]] = []  # known to be, and written once the run's refusals are in line
        self._requests: set[asyncio.Task[None]] = set()
        self._crash: BaseException | None = None  # what a request's task raised: the run stops with it
        self._writes: dict[int, asyncio.Future[ShardRef]] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="generation-writer")
        self._swept = False  # shards completed inside the window were finalized once it passed
        self._pinned_here = False  # this attempt pinned the settings (a fresh run): unpinned if it keeps nothing
        self._run_budget: Callable[[str], AbstractAsyncContextManager[Any]] | None = None  # shared across runs
        # a run in object storage keeps its partial logs there too, in segments written by the writer thread
        self._spill = None if store.local_path("generations") else self._spill_segment
        self._spills: list[Future[None]] = []  # segment writes: awaited, and their errors reported, at shutdown
        self._writing = True
        # built once the run starts (`_run`), from what `plan` found left to ask
        self.pool: EndpointPool | None = None
        self.probation: Probation | None = None
        self.started_at: float | None = None  # time.monotonic() when the first request could start
        self._dispatcher: asyncio.Future[None] | None = None

    def run(self, prompt_shards: list[ShardRef]) -> list[ShardRef]:
        """Generate on an event loop of the stage's own, whose selector is the stall clock."""
        clock = StallClock()
        with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(clock)) as runner:
            return runner.run(self._run(prompt_shards, clock))

    def plan(self, prompt_shards: list[ShardRef]) -> None:
        """What is left to ask, shard by shard; the prompts themselves are queued later, a few shards ahead."""
        run_id, self._pinned_here = pin_settings(self.store, self.settings)
        if self._spill is not None:
            for spool in drop_other_spools(self.store, run_id):
                self.log.warning("removed %s: the local spool of another run that had this run's name", spool)
        for ref in prompt_shards:
            if (marked := marked_finished(self.store, ref)) is not None:
                self.finished[ref.index] = marked
                continue
            self.states[ref.index] = resume_shard(self.store, ref, run_id, self._spill, self.log)
        self._adopt(run_id)
        for ref in prompt_shards:
            if (state := self.states.get(ref.index)) is not None and not state.complete:
                self._unqueued.append(ref)
                self.total += ref.num_records - len(state.entries)
        for index in [i for i, state in self.states.items() if state.complete]:
            self.finished[index] = finalize_shard(self.store, self.states.pop(index))
        retire_generations_beyond(self.store, len(prompt_shards), run_id)

    def _adopt(self, run_id: str) -> None:
        """After a re-cut (a dataset edit, another `shard_size`, `limit` or `split`), a prompt's answer may sit in
        another shard's files or logs: each unanswered prompt takes what the run holds for it, wherever that is,
        before anything is asked. Runs whose shards kept their prompts read nothing more."""
        count = len(self.states) + len(self.finished)
        if not any(state.recut for state in self.states.values()) and not answers_beyond(self.store, count):
            return
        missing = {pid: (index, at) for index, state in self.states.items() if not state.complete
                   for pid, at in state.positions().items() if at not in state.entries and at not in state.turns}
        entries, turns = answer_pool(self.store, run_id, set(missing)) if missing else ({}, {})
        for pid in entries.keys() | turns.keys():
            index, at = missing[pid]
            self.states[index].adopt(pid, at, entries.get(pid), turns.get(pid, []))
        if entries or turns:
            self.log.info("%d answers logged in other shards of an earlier layout kept where their prompts are now",
                          len(entries) + len(turns))

    def _read_ahead(self) -> None:
        """Queue the next shards' unanswered prompts while fewer than a budget's worth wait: memory holds a few
        shards' prompts, whatever the run's size. A shard is read in a thread while the queue still feeds the
        requests (a read from object storage takes tens of ms).
        """
        if self._reading is not None and self._reading.done():
            self.queue.extend(self._reading.result())
            self._reading = None
        if self._reading is None and len(self.queue) < self._lookahead and self._unqueued:
            self._reading = asyncio.ensure_future(asyncio.to_thread(self._unanswered, self._unqueued.popleft()))

    async def _refill(self) -> None:
        """Read ahead; on an empty queue, wait for the shard being read."""
        self._read_ahead()
        while not self.queue and self._reading is not None:
            await asyncio.wait([self._reading])
            self._read_ahead()

    def _unanswered(self, ref: ShardRef) -> list[Prompt]:
        """A shard's prompts not yet answered; a rollout goes on at its next turn, on the answers it has."""
        seed_base, state = self.settings.generation.seed, self.states[ref.index]
        prompts = []
        for position, prompt in enumerate(self.store.read_shard_records(ref)):
            if position in state.entries:
                continue
            seed = None if seed_base is None else seed_base + prompt["row"]
            mode = self.settings.mode_of(prompt["id"])
            if "turns" not in prompt:
                prompts.append(Prompt(ref.index, position, prompt["id"], prompt["messages"], seed, mode,
                                      tools=prompt.get("tools")))
                continue
            outputs = tuple(answer_of(json.loads(line)) for line in state.turns.get(position, []))
            prompts.append(rollout_prompt(ref.index, position, prompt, outputs, seed, mode))
            self.total += prompts[-1].rollout.user_turns_left  # `plan` counted one prompt per conversation
        return prompts

    async def _run(self, prompt_shards: list[ShardRef], clock: StallClock) -> list[ShardRef]:
        self.plan(prompt_shards)
        if self.total == 0:
            return [self.finished[r.index] for r in prompt_shards]
        if self.stop.is_set():
            raise GenerationCancelled()
        if self.server.share_budget_across_runs:
            self._run_budget = await shared_budget(self.server)
        gc.freeze()  # what start-up built lives for the whole run: keep full collections from walking it
        auto = self.server.max_in_flight == "auto"
        limit = AUTO_START if auto else int(self.server.max_in_flight)
        most = AUTO_CAP if auto else limit  # the most an endpoint may have in flight
        self._lookahead = 2 * most * len(self.server.endpoints)
        key = api_key(self.server)
        clients = [OpenAIClient(url, key, self.server.request_timeout_s) for url in self.server.endpoints]
        self.pool = EndpointPool([Endpoint(c.base_url, c, limit) for c in clients], self.server, self.log,
                                 on_dead=self._endpoint_dead)
        modes = [entry.mode for entry in self.settings.generation.mode_mix(self.settings.profile) if entry.weight]
        # by default the window is the budget the run starts with (under auto, not the most it may grow to: a run
        # whose first answers are wrong spends at most that many requests)
        window = self.validation.early_abort_after or max(MIN_WINDOW, limit * len(self.server.endpoints))
        self.probation = Probation(min(window, self.total), self.server.endpoints,
                                   self.settings.model, self.settings.profile, self.validation,
                                   self.sequence_source, modes)
        self.started_at, cpu_at_start = time.monotonic(), time.process_time()
        clock.restart()  # start-up (imports, the first shard's read) is not the steady state
        helpers = [asyncio.create_task(self._report()), asyncio.create_task(self._watch_stop())]
        if auto:
            helpers += [asyncio.create_task(follow_load(self.pool, e, self.log)) for e in self.pool.endpoints]
        for helper in helpers:
            helper.add_done_callback(self._ended)  # a helper that raised stops the run, as a request would
        self._dispatcher = asyncio.ensure_future(self._dispatch())
        try:
            try:
                await self._dispatcher
            except asyncio.CancelledError:
                if self._crash is None and not self._stopped:  # not stopped by a request that raised (`_ended`)
                    raise  # or by the stop event (`_watch_stop`), but from outside
            longest_stall_s = clock.longest_s  # before the shutdown's waits for the last writes
        finally:
            for pending in [*self._requests, *helpers, *([self._reading] if self._reading else [])]:
                pending.cancel()
            await asyncio.gather(*self._requests, *helpers, return_exceptions=True)
            self.pool.close()
            for client in clients:
                client.close()
            gc.unfreeze()
            await self._shut_down()
        if self._crash is not None:
            raise self._crash
        if self._stopped:
            raise GenerationCancelled()
        cpu_per_request = (time.process_time() - cpu_at_start) / self.total
        self._raise_if_short()
        self.log.info("generation done: %d prompts, %d retries, %.1fs; longest event-loop stall %.0f ms, client CPU "
                      "%.2f ms/request", self.total, self.counts.retries, time.monotonic() - self.started_at,
                      longest_stall_s * 1e3, cpu_per_request * 1e3)
        return [self.finished[r.index] for r in prompt_shards]

    async def _dispatch(self) -> None:
        """Start requests until no prompt is left, then wait for the last; prompts sent back meanwhile by an
        endpoint that was dropped start another round. Once every prompt has ended, the refusals still held are
        their prompts' own: no endpoint refused them all."""
        while await self._start_requests():
            while self._requests and not self.queue:  # a rollout's next turn starts as soon as it is queued
                await asyncio.wait(set(self._requests), return_when=asyncio.FIRST_COMPLETED)
            if self.probation.error is not None or self.pool.gave_up is not None:
                return
            if not self.queue:
                self._cleared += reasons(self._held.take_all())
                self._reject_cleared()
                return
        while self._requests:
            await asyncio.wait(set(self._requests))

    async def _start_requests(self) -> bool:
        """Take an admission and a slot, then the next prompt, and start its request; True once no prompt is left,
        False when the run stops."""
        while True:
            await self._refill()
            if not self.queue:
                return True
            admission = await self.probation.admit()
            if admission == "aborted":
                return False
            slot = await self.pool.acquire()
            if slot is None:
                self.probation.abandon()
                return False
            if self.probation.error is not None:  # judged while this slot was awaited
                self.pool.give_back(*slot)
                return False
            if not self.queue:  # emptied by requests carrying on while this slot was awaited
                self.pool.give_back(*slot)
                continue
            prompt = self.queue.popleft()
            if admission == "window":
                self._window.append(prompt)
            request = asyncio.create_task(self._request(prompt, slot))
            self._requests.add(request)
            request.add_done_callback(self._ended)

    async def _request(self, prompt: Prompt, slot: tuple[Endpoint, bool]) -> None:
        """Ask `prompt`, then the next ones on the same slot while the pool lets it carry on: a request carrying
        on costs no new task and no turn of the dispatcher."""
        while True:
            outcome, kept = await self._send(prompt, slot)
            self._keep(prompt, outcome)
            if kept is None:
                return
            self._read_ahead()
            if not self.queue or self.probation.error is not None:
                self.pool.give_back(*kept)
                return
            prompt, slot = self.queue.popleft(), kept

    def _keep(self, prompt: Prompt, outcome: Outcome) -> None:
        """Log how `prompt` ended in its shard's state and judge it in the probation.

        A refusal is held until it is known to be the prompt's own (`HeldRefusals`), and written once the run's
        refusals are within `validation.min_accepted_rate`: one that proves to be its endpoint's is asked again.
        """
        if outcome.abandoned:
            self.probation.abandon()
            return
        keep = self.probation.observe(outcome)
        if outcome.completions and keep:
            self._keep_answer(prompt, outcome.completions)
            self.counts.accepted += 1
            self.counts.tokens += int(outcome.completions[0].usage.get("completion_tokens") or 0)
            self._cleared += reasons(self._held.answered(outcome.endpoint, outcome.sent))
        elif outcome.refusal is not None:
            self._cleared += reasons(self._held.refused(outcome.endpoint, outcome.sent, alike(outcome.refusal),
                                                        (outcome.refusal, prompt)))
            if self._held.repeated(outcome.endpoint, outcome.sent):
                self._drop(outcome.endpoint, repeated_refusal(outcome.refusal))
        elif not outcome.completions:
            self.counts.failed += 1
            self._not_going_on(prompt)
        if self.probation.refusals_in_line:
            self._reject_cleared()
        if self.probation.error is not None:
            self._stop_requests()
        elif self.probation.passed:
            self._after_pass(prompt)

    def _keep_answer(self, prompt: Prompt, completions: list[Completion]) -> None:
        """Log an answer; a rollout's next generation is queued first in line, so conversations under way end
        before new ones start."""
        state = self.states[prompt.shard]
        step = None if prompt.rollout is None else prompt.rollout.after(completions[0])
        if isinstance(step, list):
            state.append(prompt, records=new_records(prompt, completions))
            self.queue.appendleft(prompt.followed_by(completions[0], step))
            self.total += bool(completions[0].tool_calls)  # the results are asked about in the same user turn
            return
        ended = None if step is None else step.reason
        state.append(prompt, records=new_records(prompt, completions, ended), **({"ended": ended} if ended else {}))
        if ended is not None and ended != "complete":
            self._not_going_on(prompt)

    def _reject_cleared(self) -> None:
        """Write the refusals known to be their prompts' own."""
        for reason, prompt in self._cleared:
            where = {} if prompt.rollout is None else {"user_turn": prompt.rollout.user_turn}
            self.states[prompt.shard].append(prompt, rejected={"id": prompt.record_id, "stage": "generations",
                                                               "reason": reason, **where})
            self.counts.rejected += 1
            self._not_going_on(prompt)
            if self.probation.passed and self.probation.error is None:
                self._after_pass(prompt)
        self._cleared = []

    def _not_going_on(self, prompt: Prompt) -> None:
        """A rollout's turn ended its conversation (refused) or stopped it in this attempt (failed): its later
        turns are not asked."""
        if prompt.rollout is not None:
            self.total -= prompt.rollout.user_turns_left

    def _drop(self, endpoint: str, cause: str) -> None:
        """Send nothing more to an endpoint that refuses every request (`_endpoint_dead` follows)."""
        self.pool.drop(endpoint, cause)

    def _endpoint_dead(self, endpoint: str) -> None:
        """The pool gave an endpoint up (it refuses every request, or answers every request with an error): the
        prompts whose refusals or malformed answers it holds are asked again, first; that failure was not theirs."""
        self.probation.endpoint_dropped(endpoint)
        for reason, prompt in reasons(self._held.take(endpoint)):
            self.probation.retract(reason)
            self.queue.appendleft(prompt)

    def _ended(self, request: asyncio.Task[None]) -> None:
        """A request's task (or a helper's) ended. One that raised (a bug, a full disk) stops the run with its
        error, instead of leaving a gap that would read as unreachable servers, or a budget that no longer moves."""
        self._requests.discard(request)
        if request.cancelled() or request.exception() is None or self._crash is not None:
            return
        self._crash = request.exception()
        self._dispatcher.cancel()
        self._stop_requests()

    async def _watch_stop(self) -> None:
        """Stop the run once the stop event is set: the dispatcher sends nothing more, and the requests in flight
        are abandoned (cancelled: their connections close, and their prompts are asked by the next run)."""
        while not self.stop.is_set():
            await asyncio.sleep(STOP_POLL_S)
        self._stopped = True
        self.log.warning("generation stopped (a termination signal or a cancel): %d requests in flight abandoned, "
                         "their prompts are asked again by the next run", len(self._requests))
        self._dispatcher.cancel()
        self._stop_requests()

    def _stop_requests(self) -> None:
        """The run is stopped: cancel what is in flight (a closed connection makes vLLM drop the request)."""
        current = asyncio.current_task()
        for request in self._requests:
            if request is not current:
                request.cancel()

    def _after_pass(self, prompt: Prompt) -> None:
        """Finalize shards as they complete; the first time, also those completed inside the window."""
        if not self._swept:
            self._swept = True
            for index in [i for i, state in self.states.items() if state.complete]:
                self._finalize(index)
        elif prompt.shard in self.states and self.states[prompt.shard].complete:
            self._finalize(prompt.shard)

    def _spill_segment(self, rel: str, lines: list[str]) -> None:
        """Write a partial-log segment from the writer thread (in order, before its shard is finalized); once the
        writer is shut down, here."""
        text = "".join(line + "\n" for line in lines)
        if self._writing:
            self._spills = [write for write in self._spills if not write.done() or write.exception()]
            self._spills.append(self._writer.submit(self.store.write_text, rel, text))
        else:
            self.store.write_text(rel, text)

    def _finalize(self, index: int) -> None:
        """Write a finished shard from a thread: the event loop goes on sending while it is written."""
        state = self.states.pop(index)
        self._writes[index] = asyncio.get_running_loop().run_in_executor(
            self._writer, finalize_shard, self.store, state)

    async def _send(self, prompt: Prompt, slot: tuple[Endpoint, bool] | None
                    ) -> tuple[Outcome, tuple[Endpoint, bool] | None]:
        """How `prompt` ended, and the slot when the pool let this request keep it for the next prompt.

        An endpoint that refuses every request (the key, the model, the route) is dropped and the prompt asked
        elsewhere: that refusal is not the prompt's, and costs it no try; so is a failure from an endpoint the pool
        has given up on (it answered `max_consecutive_errors` requests in a row with an error).

        A prompt answered with a malformed answer (a 200 that breaks the protocol) on every try ends refused with
        that answer's error, as a refusal of its own: held like one (`HeldRefusals`) until a later request to the
        same endpoint is answered, so an endpoint that answers every prompt so is given up on (and its prompts
        asked again) rather than every prompt rejected. Any other failure on the last try (a 5xx, a timeout, a
        dropped connection) leaves the prompt failed: asked again by the next run, as the server may be down.
        """
        settings = self.settings
        messages = prompt.messages
        if image_names(messages):  # read from the run's storage off the event loop
            messages = await asyncio.to_thread(as_sent, messages, self.store.read_bytes)
        body = build_chat_request(settings.model, messages, self._mode_specs[prompt.mode], settings.generation,
                                  seed=prompt.seed, tools=prompt.tools)
        attempt = 0
        malformed = True  # every try so far was answered with a body that breaks the protocol
        while True:
            if slot is None:
                slot = await self.pool.acquire(retry=True)
                if slot is None:
                    return Outcome(abandoned=True), None
            endpoint, trial = slot
            sent, endpoint.sent = endpoint.sent, endpoint.sent + 1
            try:
                if self._run_budget is None:
                    completions = await endpoint.client.chat(body, settings.profile)
                else:
                    async with self._run_budget(endpoint.url):
                        completions = await endpoint.client.chat(body, settings.profile)
            except RequestFailed as error:
                if error.refused_request:
                    self.pool.release(endpoint, trial, None)
                    return Outcome(endpoint.url, refusal=str(error), mode=prompt.mode, sent=sent), None
                slot = None
                if not error.retryable:
                    self.pool.give_back(endpoint, trial)
                    self._drop(endpoint.url, refused_all(error, self.server))
                    continue
                self.pool.release(endpoint, trial, error)
                if endpoint.dead:  # given up on: its failures say nothing about the prompt, asked elsewhere
                    continue
                malformed = malformed and error.status == 200
                if attempt == self.server.max_retries:
                    if malformed:
                        reason = malformed_answer(error, attempt + 1)
                        self.log.info("record %s: %s", prompt.record_id, reason)
                        return Outcome(endpoint.url, refusal=reason, mode=prompt.mode, sent=sent), None
                    self.log.debug("record %s not generated after %d tries: %s", prompt.record_id, attempt + 1, error)
                    return Outcome(endpoint.url, mode=prompt.mode, sent=sent), None
                self.counts.retries += 1
                await asyncio.sleep(self.server.retry_backoff_s * 2**attempt * random.uniform(0.5, 1.5))
                attempt += 1
                continue
            except BaseException:  # cancelled: the slot goes back without a verdict on the endpoint
                self.pool.give_back(endpoint, trial)
                raise
            carry_on = self.probation.passed and self.probation.error is None and (bool(self.queue) or
                                                                                   prompt.rollout is not None)
            kept = self.pool.release(endpoint, trial, None, carry_on)
            return Outcome(endpoint.url, completions=completions, mode=prompt.mode, sent=sent), slot if kept else None

    def _remaining(self) -> int:
        return self.total - self.counts.accepted - self.counts.rejected - self.counts.failed

    async def _report(self) -> None:
        """Every `progress_every_s`: counts, rates and in flight; an ETA only while requests complete."""
        done_before = 0
        while True:
            await asyncio.sleep(self.progress_every_s)
            self.pool.check(time.monotonic())
            counts, elapsed = self.counts, time.monotonic() - self.started_at
            done = self.total - self._remaining()
            recent = (done - done_before) / self.progress_every_s
            done_before = done
            eta = f"ETA {self._remaining() / recent:.0f}s" if recent else "ETA unknown (no request completed lately)"
            flights = " ".join(f"{e.url}={e.in_flight}/{e.limit}" for e in self.pool.endpoints)
            self.log.info("generation: %d accepted, %d rejected, %d failed, %d remaining  %.1f req/s  %.0f tok/s  "
                          "in flight %s  %s", counts.accepted, counts.rejected, counts.failed, self._remaining(),
                          done / elapsed, counts.tokens / elapsed, flights, eta)
            if self.on_progress is not None:
                self.on_progress(100.0 * done / self.total)

    def _record_findings(self) -> None:
        """Add what each endpoint's first answers showed to the manifest's probe entries."""
        findings = self.probation.findings
        for endpoint, facts in findings.items():
            how = "the server's token ids" if facts["sequence_source"] == "server" else \
                "text, each checked against the server's token counts"
            where = f"sends reasoning in `{facts['reasoning_field']}`" if facts["reasoning_field"] else \
                "answered first in modes without reasoning"
            self.log.info("probe: %s %s; sequences are built from %s", endpoint, where, how)
        if not findings or not self.store.exists(MANIFEST):
            return
        manifest = self.store.read_json(MANIFEST)
        for entry in manifest.get("probe", []):
            entry.update(findings.get(entry["endpoint"], {}))
        self.store.write_json(MANIFEST, manifest)

    def _raise_if_short(self) -> None:
        """Turn an unfinished generation into one error that says what was kept and what to do."""
        if self.probation.error is not None:
            raise self.probation.error
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
        """Void the answers of a window that was never judged (aborted, given up, stopped), so they are asked
        again and judged: an answer is kept only once the window passed."""
        for prompt in self._window:
            state = self.states.get(prompt.shard)
            if state is not None and (prompt.position in state.entries or prompt.position in state.turns):
                state.append(prompt, discard="early abort window")

    async def _shut_down(self) -> None:
        """Void an unjudged window, await every shard write, close every shard's log and flush its last segment,
        whatever fails first; then unpin the settings of a fresh run that kept nothing. The first error is
        raised, the others logged."""
        errors: list[Exception] = []
        if not self.probation.passed:
            try:
                self._discard_window()
            except Exception as error:
                errors.append(error)
        for index, write in self._writes.items():
            try:
                self.finished[index] = await write
            except Exception as error:
                errors.append(error)
        for state in self.states.values():
            try:
                state.close()  # what is pending goes to run storage: a re-run anywhere resumes from it
            except Exception as error:
                errors.append(error)
        self._writer.shutdown()
        self._writing = False
        errors += [error for write in self._spills if (error := write.exception()) is not None]
        try:
            self._record_findings()
            kept = self._writes or self.finished or any(state.entries for state in self.states.values())
            if self._pinned_here and not kept:
                self.store.remove(SETTINGS_FILE)
        except Exception as error:
            errors.append(error)
        for error in errors[1:]:
            self.log.error("generation shutdown: also %s: %s", type(error).__name__, error)
        if errors:
            raise errors[0]

    def shard_counts(self) -> dict[int, dict[str, int]]:
        """Per shard: `answered` and `refused` prompts while open, `records` once written; `{}` while being written.

        Read by the progress thread while the run goes on: it only copies (each copy is atomic under the GIL).
        """
        counts: dict[int, dict[str, int]] = {index: {} for index in list(self._writes)}
        counts.update({index: {"records": ref.num_records} for index, ref in list(self.finished.items())})
        for index, state in list(self.states.items()):
            entries = list(state.entries.values())
            refused = sum("rejected" in entry for entry in entries)
            counts[index] = {"answered": len(entries) - refused, "refused": refused}
        return counts


def generate_shards(
    store: RunStore,
    prompt_shards: list[ShardRef],
    settings: GenerationSettings,
    server: ServerConfig,
    validation: ValidationConfig,
    log: Log,
    progress_every_s: float = 5.0,
    on_progress: Callable[[float], None] | None = None,
    sequence_source: str = "auto",
    stop: threading.Event | None = None,
) -> list[ShardRef]:
    """Generate every unfinished shard; returns the generation ShardRefs in shard order. Setting `stop` (from
    another thread) ends it with `GenerationCancelled` within STOP_POLL_S."""
    scheduler = GenerationScheduler(store, settings, server, validation, log, progress_every_s, on_progress,
                                    sequence_source, stop)
    return scheduler.run(prompt_shards)
