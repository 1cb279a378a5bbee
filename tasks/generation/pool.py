"""The in-flight budget of a run's endpoints: who gets the next slot, and when a failing endpoint is given up on.

An endpoint that refuses every request (a rejected key, a model it does not serve, a route it lacks, the same
refusal to many prompts in a row) is dropped at once: its refusals say nothing about the prompts, which are asked
again elsewhere, or after the fix. So is one that keeps answering with errors (`max_consecutive_errors` in a row:
HTTP 500, or answers that break the protocol): a prompt it answered malformed on every try is its prompt's own
failure only while the endpoint answers other prompts, so the pool says when it gives an endpoint up (`on_dead`).

Everything here runs on one event loop with no await between reading and changing state, so there is no lock:
a request waits on a future of its own, woken one at a time as slots free up (FIFO, like asyncio.Semaphore),
retries before new prompts: a prompt already started is finished first, so its shard is finalized sooner.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from eagle3_datagen.config import ServerConfig
from eagle3_datagen.errors import Log
from eagle3_datagen.protocol import SERVER_SETUP, UNKNOWN_MODEL, OpenAIClient, RequestFailed

ENDPOINT_FAILURES_BEFORE_BACKOFF = 3
ENDPOINT_MAX_COOLDOWN_S = 30.0
# requests sent in a row to one endpoint and refused with the same message: the endpoint's refusal, not theirs.
# Enough that prompts refused alike for their own reason (a malformed conversation) almost never line up so
REPEATED_REFUSALS = 16


@dataclass
class Endpoint:
    url: str
    client: OpenAIClient
    limit: int  # requests allowed in flight now (fixed, or moved by the adaptive budget)
    in_flight: int = 0
    peak_in_flight: int = 0  # the most in flight since the adaptive budget last looked
    failures: int = 0  # in a row, while up
    trips: int = 0
    down_since: float | None = None
    available_at: float = 0.0
    trial_in_flight: bool = False
    broken_answers: int = 0  # HTTP 500 or protocol-breaking answers in a row
    dead: bool = False  # given up on: no more requests go to it
    refused_all: str | None = None  # why it was dropped when it refused every request, with the fix
    sent: int = 0  # requests sent to it so far: each request's number in sending order


class EndpointPool:
    """Picks the endpoint with the most free slots and backs off failing ones.

    A failing endpoint is marked down after three failures in a row and then gets one trial request per
    cool-down (1, 2, 4… up to 30 s) until one succeeds: a server that is away or busy (refused connections,
    timeouts, 429/502/503/504) is waited for, up to `give_up_after_s` without any success anywhere. A server
    that answers, but with errors (HTTP 500, a response that breaks the protocol), is given up on after
    `max_consecutive_errors` such answers in a row. The run gives up when no endpoint is left or the wait is over.
    """

    def __init__(self, endpoints: list[Endpoint], server: ServerConfig, log: Log,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.endpoints = endpoints
        self._server = server
        self._log = log
        self._on_dead = on_dead  # called with an endpoint's URL when it is given up on, whatever the cause
        self._waiters: deque[asyncio.Future[None]] = deque()  # new prompts
        self._retries: deque[asyncio.Future[None]] = deque()  # prompts that failed once and wait to try again
        self._timers: list[asyncio.TimerHandle] = []
        # requests in flight on all endpoints, and their integral over time (request-seconds) up to a moment:
        # replaced whole, so the progress thread reads a consistent one
        self._tally: tuple[int, float, float] = (0, 0.0, time.monotonic())
        self.last_success = time.monotonic()
        self.last_error = ""
        self.gave_up: str | None = None

    def _take(self, now: float) -> tuple[Endpoint, bool] | None:
        best, best_free = None, 0
        for endpoint in self.endpoints:
            if endpoint.dead:
                continue
            if endpoint.down_since is not None:
                if now < endpoint.available_at or endpoint.trial_in_flight:
                    continue
                free = max(1, endpoint.limit - endpoint.in_flight)
            else:
                free = endpoint.limit - endpoint.in_flight
            if free > best_free:
                best, best_free = endpoint, free
        if best is None:
            return None
        trial = best.down_since is not None
        best.trial_in_flight |= trial
        best.in_flight += 1
        best.peak_in_flight = max(best.peak_in_flight, best.in_flight)
        self._count(1, now)
        return best, trial

    def _count(self, change: int, now: float) -> None:
        count, area, at = self._tally
        self._tally = (count + change, area + count * (now - at), now)

    def in_flight_integral(self) -> tuple[float, float]:
        """Requests in flight integrated over time since the pool was made (request-seconds), and the monotonic
        time it is counted to: the mean in flight between two readings, exactly (safe from any thread)."""
        count, area, at = self._tally
        now = time.monotonic()
        return area + count * (now - at), now

    async def acquire(self, retry: bool = False) -> tuple[Endpoint, bool] | None:
        """(endpoint, is a trial of a down endpoint) with a slot taken; None once the pool has given up. A `retry`
        is woken before any new prompt."""
        while self.gave_up is None:
            slot = self._take(time.monotonic())
            if slot is not None:
                return slot
            waiter = asyncio.get_running_loop().create_future()
            (self._retries if retry else self._waiters).append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.wake(1)  # woken, then cancelled: hand the wake-up on
                raise
        return None

    def wake(self, count: int | None = None) -> None:
        """Let `count` waiting requests (all when None) look for a slot again."""
        for waiters in (self._retries, self._waiters):
            while waiters and (count is None or count > 0):
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    count = None if count is None else count - 1

    def release(self, endpoint: Endpoint, trial: bool, error: RequestFailed | None, carry_on: bool = False) -> bool:
        """Return a slot; `error` is a server or transport failure (a refusal is a healthy answer).

        With `carry_on` (the caller has another prompt to send at once) the slot is kept instead, and True returned,
        when the request succeeded on an endpoint that is up and within its limit and no retry waits for a slot.
        """
        endpoint.trial_in_flight &= not trial
        now = time.monotonic()
        changed = False
        if error is None:
            changed = self._succeeded(endpoint, trial, now)  # a success never makes the run give up: no check
        else:
            self._answered_broken(endpoint, error)
            if not endpoint.dead and (endpoint.down_since is None or trial):
                self._failed(endpoint, trial, error, now)
            self.check(now)
        if (carry_on and error is None and not changed and self.gave_up is None and not self._retries
                and endpoint.down_since is None and not endpoint.dead and endpoint.in_flight <= endpoint.limit):
            return True
        endpoint.in_flight -= 1
        self._count(-1, now)
        self.wake(None if changed or self.gave_up is not None else 1)
        return False

    def give_back(self, endpoint: Endpoint, trial: bool) -> None:
        """Return a slot without a verdict on the endpoint (its request was cancelled, or never sent)."""
        endpoint.in_flight -= 1
        endpoint.trial_in_flight &= not trial
        self._count(-1, time.monotonic())
        self.wake(1)

    def _succeeded(self, endpoint: Endpoint, trial: bool, now: float) -> bool:
        """A success; only a trial's brings a down endpoint back (one sent before it went down proves nothing)."""
        self.last_success = now
        if endpoint.down_since is not None and not trial:
            return False
        endpoint.failures = endpoint.trips = endpoint.broken_answers = 0
        if endpoint.down_since is None:
            return False
        self._log.warning("endpoint %s recovered after %.0fs down", endpoint.url, now - endpoint.down_since)
        endpoint.down_since = None
        return True

    def _answered_broken(self, endpoint: Endpoint, error: RequestFailed) -> None:
        self.last_error = str(error)
        endpoint.broken_answers += error.broken_answer
        limit = self._server.max_consecutive_errors
        if endpoint.broken_answers < limit or endpoint.dead:
            return
        endpoint.dead = True
        if any(not e.dead for e in self.endpoints):
            self._log.warning("endpoint %s answered %d requests in a row with an error (server.max_consecutive_errors"
                              "): no more requests go to it; last: %s", endpoint.url, limit, error)
        if self._on_dead is not None:
            self._on_dead(endpoint.url)

    def drop(self, url: str, cause: str) -> None:
        """No more requests go to the endpoint at `url`: it refuses every request, for `cause` (with its fix)."""
        endpoint = next(e for e in self.endpoints if e.url == url)
        if endpoint.refused_all is not None:
            return
        endpoint.dead, endpoint.refused_all = True, cause
        if any(not e.dead for e in self.endpoints):
            self._log.warning("endpoint %s refuses every request: no more requests go to it; %s", url, cause)
        if self._on_dead is not None:
            self._on_dead(url)
        self.check(time.monotonic())

    def _failed(self, endpoint: Endpoint, trial: bool, error: RequestFailed, now: float) -> None:
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
        self._timers.append(asyncio.get_running_loop().call_later(cooldown, self.wake))

    def check(self, now: float) -> None:
        """Give up (and wake every waiting request) when the servers are judged gone."""
        if self.gave_up is not None:
            return
        limit = self._server.max_consecutive_errors
        silent = now - self.last_success
        alive = [e for e in self.endpoints if not e.dead]
        refused = sorted({e.refused_all for e in self.endpoints if e.refused_all})
        if not alive and refused:
            self.gave_up = f"no endpoint is left that accepts requests: {'; '.join(refused)}"
            self.wake()
            return
        if not alive:
            self.gave_up = (f"every endpoint answered {limit} requests in a row with an error "
                            f"(server.max_consecutive_errors {limit})")
        elif all(e.down_since is not None for e in alive) and silent >= self._server.give_up_after_s:
            self.gave_up = (f"no endpoint answered successfully for {silent:.0f}s "
                            f"(server.give_up_after_s {self._server.give_up_after_s:.0f})")
        else:
            return
        self.gave_up += f"; last error: {self.last_error}"
        self.wake()

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()


def refused_all(error: RequestFailed, server: ServerConfig) -> str:
    """Why an endpoint refused a request for a reason of its own, not the prompt's, and how to fix it."""
    if error.status in (401, 403):
        fix = (f"the server refuses the API key: set the right key in ${server.api_key_env} (server.api_key_env) "
               "or the Secret block named by server.api_key_secret")
    elif UNKNOWN_MODEL.search(str(error)):
        fix = "the server does not serve this model: set model.name to a model in its /v1/models"
    elif SERVER_SETUP.search(str(error)):
        fix = ("the dataset offers tools but the server parses no tool calls: start vLLM with "
               "--enable-auto-tool-choice --tool-call-parser NAME (kimi_k2, hermes, openai...)")
    elif error.status in (404, 405):
        fix = "no chat completions at this URL: set server.endpoints to the server's base URL (http://host:port)"
    else:
        fix = "fix the server or drop it from server.endpoints"
    return f"{error} ({fix})"


def repeated_refusal(refusal: str) -> str:
    """The cause of an endpoint dropped for refusing many different prompts alike, with its fix."""
    return (f"{refusal} (the same refusal to {REPEATED_REFUSALS} different prompts in a row: it is the server's, "
            "not theirs; fix what it names: the server's flags, generation.extra_body or model.name)")


Item = TypeVar("Item")


class HeldRefusals(Generic[Item]):
    """Refusals not yet known to be their prompt's own, per endpoint, numbered by when their request was sent.

    A refusal is the prompt's own once a request sent later to the same endpoint ends otherwise (answered, or
    refused with another message): an endpoint that refuses everything refuses every later request alike, even
    while requests it took earlier are still being answered. It is the endpoint's when REPEATED_REFUSALS requests
    sent in a row to it are refused with the same message.
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[int, tuple[str, Item]]] = {}

    def answered(self, endpoint: str, sent: int) -> list[tuple[str, Item]]:
        """The refusals a request sent `sent`-th to `endpoint` and answered clears, with their messages."""
        return self._clear(endpoint, lambda number, message: number < sent)

    def refused(self, endpoint: str, sent: int, message: str, item: Item) -> list[tuple[str, Item]]:
        """Hold a refusal; returns the earlier refusals it clears (those with another message)."""
        cleared = self._clear(endpoint, lambda number, other: number < sent and other != message)
        self._held.setdefault(endpoint, {})[sent] = (message, item)
        return cleared

    def repeated(self, endpoint: str, sent: int) -> bool:
        """Whether the refusal of the request sent `sent`-th is one of REPEATED_REFUSALS alike in a row."""
        held = self._held.get(endpoint, {})
        message = held[sent][0]

        def alike(number: int) -> bool:
            return number in held and held[number][0] == message

        first = last = sent
        while alike(first - 1):
            first -= 1
        while alike(last + 1):
            last += 1
        return last - first + 1 >= REPEATED_REFUSALS

    def take(self, endpoint: str) -> list[tuple[str, Item]]:
        """Every refusal still held for `endpoint`, no longer held."""
        return self._clear(endpoint, lambda number, message: True)

    def take_all(self) -> list[tuple[str, Item]]:
        return [held for endpoint in list(self._held) for held in self.take(endpoint)]

    def _clear(self, endpoint: str, cleared: Callable[[int, str], bool]) -> list[tuple[str, Item]]:
        held = self._held.get(endpoint, {})
        numbers = [number for number, (message, _) in held.items() if cleared(number, message)]
        return [held.pop(number) for number in sorted(numbers)]
