"""The early-abort test: a run is judged on its first answers before it may spend more than
`validation.early_abort_after` requests (by default one in-flight budget, so no slot waits for the verdict), and
released to its full budget the moment the verdict is in.

Two checks, both on real prompts whose answers are kept:
- each endpoint's first `validation.probe_requests` answers are checked for form (reasoning in a field this run
  reads, token ids, the served model); one bad answer stops the run with the fix;
- the share of answers without reasoning is judged by Wald's sequential probability ratio test between a healthy
  run (`validation.max_empty_reasoning_rate`) and a broken one (half the answers or more without reasoning):
  about seven good answers let the run go on, three empty ones in a row stop it, and a run still undecided when
  the window is spent is judged on the window's rates as a whole. A run that mixes in a mode answered without
  reasoning (instant) judges those answers the same way, the other way round: reasoning in them means the mode's
  switch is ignored (`validation.max_unexpected_reasoning_rate`).

The window is counted in evidence, answers and refusals: a request that failed every try proves nothing, so it
gives its seat back and the window stays open until answers judge it (or the servers are given up on). Refusals
are watched for the whole run: a share that jumps above `validation.min_accepted_rate` after the window stops it.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from eagle3_datagen.config import ValidationConfig
from eagle3_datagen.diagnosis import ServerCheckFailed, check_form, reasoning_facts, why_empty, why_unswitched
from eagle3_datagen.errors import UserError
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion
from tasks.generation.records import GenerationError

FALSE_ABORT = 0.001  # chance that the test stops a healthy run
FALSE_PASS = 0.01  # chance that it lets a broken run through the window
FALSE_STOP = 1e-9  # per request, chance that the watch over the whole run stops a healthy run
BROKEN_EMPTY_RATE = 0.5  # the broken run the test looks for: at least half the answers without reasoning
MIN_WINDOW = 32  # the smallest default window: room for the 7-8 answers a verdict takes, with slots to spare

Admission = Literal["window", "open", "aborted"]


@dataclass(frozen=True)
class Outcome:
    """How one prompt ended: answered, refused by the server (with its reason), failed every try, or abandoned."""

    endpoint: str = ""
    completions: list[Completion] = field(default_factory=list)
    refusal: str | None = None
    abandoned: bool = False  # the run gave up before this prompt was answered; it stays pending
    mode: str | None = None  # the mode the prompt was asked in; None: the profile's default mode
    sent: int = 0  # its request's number among those sent to its endpoint


@dataclass
class ShareTest:
    """Wald's SPRT on the share of outcomes that count against a run (answers out of their mode: thinking without
    reasoning, or instant with it; refusals): `healthy` share against `broken` share.

    With `floor` 0 it is a change detector (CUSUM): however long a run was healthy, the evidence it gathered
    cannot hide a later jump; it then stops a healthy run about once in 1 / `false_abort` outcomes, or fewer.
    """

    healthy: float
    broken: float
    evidence: float = 0.0  # log-likelihood ratio, broken over healthy
    false_abort: float = FALSE_ABORT
    floor: float = -math.inf

    @classmethod
    def allowing(cls, healthy: float, false_abort: float = FALSE_ABORT, floor: float = -math.inf) -> ShareTest:
        """The test for a run allowed a `healthy` share of bad outcomes: broken means at least half of them bad,
        and halfway from the allowed share to all of them, so a run just above a high allowance is not judged
        against an all-bad one (and let through)."""
        return cls(healthy, max(BROKEN_EMPTY_RATE, healthy + (1 - healthy) / 2), false_abort=false_abort,
                   floor=floor)

    def _step(self, bad: bool) -> float:
        if bad:
            return math.inf if self.healthy == 0 else math.log(self.broken / self.healthy)
        return math.log((1 - self.broken) / (1 - self.healthy))

    def add(self, bad: bool) -> None:
        if self.broken > self.healthy:
            self.evidence = max(self.floor, self.evidence + self._step(bad))

    def retract(self, bad: bool) -> None:
        """Take back an outcome that turned out not to count (a refusal that was its endpoint's); a verdict
        already given stands."""
        if self.broken > self.healthy and self.verdict != "abort":
            self.evidence = max(self.floor, self.evidence - self._step(bad))

    @property
    def verdict(self) -> Literal["pass", "abort"] | None:
        if self.broken <= self.healthy:  # as many bad outcomes allowed as a broken run gives: nothing to test
            return "pass"
        if self.evidence >= math.log((1 - FALSE_PASS) / self.false_abort):
            return "abort"
        if self.evidence <= math.log(FALSE_PASS / (1 - FALSE_ABORT)):
            return "pass"
        return None


class Probation:
    """Lets the first `size` requests of a run out, judges their answers as they come, then opens or aborts."""

    def __init__(self, size: int, endpoints: list[str], model: str, profile: ModelProfile,
                 validation: ValidationConfig, sequence_source: str = "auto", modes: Sequence[str] = ()) -> None:
        self.size = size
        self._sequence_source = sequence_source
        self._endpoints = endpoints
        self._model = model
        self._profile = profile
        self._validation = validation
        asked = [profile.mode(name) for name in modes or [profile.default_mode]]
        self._instant_modes = [name for name in modes if not profile.mode(name).thinks]
        # a test per kind of mode the run asks in; a kind it never asks in has nothing to prove
        self._empty_test = ShareTest.allowing(
            validation.max_empty_reasoning_rate if any(spec.thinks for spec in asked) else 1.0)
        self._unswitched_test = ShareTest.allowing(
            validation.max_unexpected_reasoning_rate if self._instant_modes else 1.0)
        self._refusal_watch = ShareTest.allowing(1 - validation.min_accepted_rate, FALSE_STOP, floor=0.0)
        self._recent: deque[str | None] = deque(maxlen=MIN_WINDOW)  # the latest refusals (None: an answer)
        self._seated = self._answers = self._empty = 0  # seated: window requests not ended without evidence
        self._instant_answers = self._unswitched = 0
        self._refusals: list[str] = []
        self._probes: dict[str, list[Completion]] = {}
        self.findings: dict[str, dict[str, object]] = {}  # reasoning facts per endpoint, for the manifest
        self._open = asyncio.Event()
        self._window_changed = asyncio.Event()  # a seat was given back, or the window is over
        self.error: UserError | None = None
        self.passed = False
        if size == 0:
            self._decide(None)

    def _decide(self, error: UserError | None) -> None:
        if self._open.is_set():
            if error is not None and self.error is None:
                self.error = error  # an endpoint probed after the window passed: stop the run
            return
        self.error = error
        self.passed = error is None
        self._open.set()
        self._window_changed.set()

    def abandon(self) -> None:
        """The run gave up before the window was judged: let the dispatcher go and stop."""
        self._open.set()
        self._window_changed.set()

    async def admit(self) -> Admission:
        """A seat in the window while it has one free, else wait for the verdict (or a seat given back)."""
        while not self._open.is_set():
            if self._seated < self.size:
                self._seated += 1
                return "window"
            self._window_changed.clear()
            await self._window_changed.wait()
        return "open" if self.error is None else "aborted"

    def _unseat(self) -> None:
        if not self._open.is_set():
            self._seated -= 1
            self._window_changed.set()

    @property
    def refusals_in_line(self) -> bool:
        """Whether the refusals so far are within what `validation.min_accepted_rate` allows: held refusals are
        written only then, so those of a jump that stops the run are asked again after the fix."""
        return self._refusal_watch.evidence <= 0

    def endpoint_dropped(self, endpoint: str) -> None:
        """An endpoint no request goes to any more: the window no longer waits for its first answers."""
        if endpoint in self._endpoints:
            self._endpoints = [e for e in self._endpoints if e != endpoint]
            if not self._open.is_set():
                self._judge()

    def retract(self, refusal: str) -> None:
        """A refusal that turned out to be its endpoint's, not its prompt's: it is no evidence, and its prompt is
        asked again (in a seat of its own)."""
        self._refusal_watch.retract(True)
        if refusal in self._recent:
            self._recent.remove(refusal)
        if not self._open.is_set() and refusal in self._refusals:
            self._refusals.remove(refusal)
            self._unseat()

    def observe(self, outcome: Outcome) -> bool:
        """Count a finished request as evidence; False when its answer must not be kept (it shows a broken server).

        A request that ended with neither an answer nor a refusal (it failed every try) is no evidence.
        """
        if outcome.completions and not self._probe(outcome.endpoint, outcome.completions):
            return False
        if outcome.refusal is None and not outcome.completions:
            self._unseat()
            return True
        self._recent.append(outcome.refusal)
        self._refusal_watch.add(outcome.refusal is not None)
        if self._open.is_set():  # the window judges its own refusals; the watch, those after it
            if self._refusal_watch.verdict == "abort":
                self._decide(self._refusals_jumped())
            return True
        if outcome.refusal is not None:
            self._refusals.append(outcome.refusal)
        elif outcome.completions:
            reasoned = bool(outcome.completions[0].reasoning.strip())
            if self._profile.mode(outcome.mode).thinks:
                self._answers += 1
                self._empty += not reasoned
                self._empty_test.add(not reasoned)
            else:
                self._instant_answers += 1
                self._unswitched += reasoned
                self._unswitched_test.add(reasoned)
        self._judge()
        return True

    def _probe(self, endpoint: str, completions: list[Completion]) -> bool:
        """Check the form of an endpoint's first answers; False (and the run stopped) when one is broken."""
        seen = self._probes.setdefault(endpoint, [])
        if len(seen) >= self._validation.probe_requests:
            return True
        try:
            for done in completions:
                check_form(endpoint, [self._model], done, self._profile, self._validation.allow_inline_reasoning,
                           self._sequence_source)
        except ServerCheckFailed as failure:
            self._decide(failure)
            return False
        seen.append(completions[0])
        if len(seen) == self._validation.probe_requests:
            self.findings[endpoint] = reasoning_facts(seen, self._sequence_source)
        return True

    def _judge(self) -> None:
        refused = len(self._refusals)
        answered = refused + self._answers + self._instant_answers
        allowed_refusals = 1 - self._validation.min_accepted_rate
        if refused > allowed_refusals * self.size:  # the window's refusal rate is already too high
            self._decide(self._too_many_refusals())
        elif self._empty_test.verdict == "abort":
            self._decide(self._too_many_empty())
        elif self._unswitched_test.verdict == "abort":
            self._decide(self._too_many_unswitched())
        elif answered >= self.size:
            if refused / max(1, answered) > allowed_refusals:
                self._decide(self._too_many_refusals())
            elif self._empty / max(1, self._answers) > self._validation.max_empty_reasoning_rate:
                self._decide(self._too_many_empty())
            elif self._unswitched / max(1, self._instant_answers) > self._validation.max_unexpected_reasoning_rate:
                self._decide(self._too_many_unswitched())
            else:
                self._decide(None)
        elif (self._empty_test.verdict == "pass" and self._unswitched_test.verdict == "pass"
              and refused <= allowed_refusals * answered
              and all(endpoint in self.findings for endpoint in self._endpoints)):
            self._decide(None)

    def _too_many_refusals(self) -> GenerationError:
        refused = len(self._refusals)
        answered = refused + self._answers + self._instant_answers
        reason, _ = Counter(self._refusals).most_common(1)[0]
        return GenerationError(
            f"early abort: the server refused {refused} of the first {answered} requests "
            f"({refused / answered:.0%}; validation.min_accepted_rate {self._validation.min_accepted_rate:.0%} "
            f"cannot be met): {reason}"
        )

    def _refusals_jumped(self) -> GenerationError:
        refusals = [reason for reason in self._recent if reason is not None]
        reason, _ = Counter(refusals).most_common(1)[0]
        return GenerationError(
            f"stopped: the server refused {len(refusals)} of the last {len(self._recent)} requests, more than "
            f"validation.min_accepted_rate {self._validation.min_accepted_rate:.0%} allows: {reason}. Fix the "
            "cause, then run again: the records kept so far stay, the refused prompts are asked again"
        )

    def _too_many_empty(self) -> GenerationError:
        rate = self._empty / max(1, self._answers)
        return GenerationError(
            f"early abort: {self._empty} of the first {self._answers} records have empty reasoning ({rate:.0%} > "
            f"validation.max_empty_reasoning_rate {self._validation.max_empty_reasoning_rate:.0%}); "
            f"{why_empty(self._profile)}"
        )

    def _too_many_unswitched(self) -> GenerationError:
        rate = self._unswitched / max(1, self._instant_answers)
        return GenerationError(
            f"early abort: {self._unswitched} of the first {self._instant_answers} records asked in mode "
            f"{' or '.join(self._instant_modes)} carry reasoning ({rate:.0%} > "
            f"validation.max_unexpected_reasoning_rate {self._validation.max_unexpected_reasoning_rate:.0%}); "
            f"{why_unswitched(self._profile, self._instant_modes)}"
        )
