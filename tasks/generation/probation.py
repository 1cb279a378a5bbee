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
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
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


@dataclass
class EmptyReasoningTest:
    """Wald's SPRT on the share of answers out of their mode (thinking without reasoning, or instant with it):
    `healthy` rate against `broken` rate."""

    healthy: float
    broken: float
    evidence: float = 0.0  # log-likelihood ratio, broken over healthy

    @classmethod
    def allowing(cls, healthy: float) -> EmptyReasoningTest:
        """The test for a run allowed a `healthy` share of empty answers: broken means at least half of them
        empty, and halfway from the allowed share to all of them, so a run just above a high allowance is not
        judged against an all-empty one (and let through)."""
        return cls(healthy, max(BROKEN_EMPTY_RATE, healthy + (1 - healthy) / 2))

    def add(self, empty: bool) -> None:
        if self.broken <= self.healthy:
            return
        if empty:
            self.evidence += math.inf if self.healthy == 0 else math.log(self.broken / self.healthy)
        else:
            self.evidence += math.log((1 - self.broken) / (1 - self.healthy))

    @property
    def verdict(self) -> Literal["pass", "abort"] | None:
        if self.broken <= self.healthy:  # as many empty answers allowed as a broken run gives: nothing to test
            return "pass"
        if self.evidence >= math.log((1 - FALSE_PASS) / FALSE_ABORT):
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
        self._empty_test = EmptyReasoningTest.allowing(
            validation.max_empty_reasoning_rate if any(spec.thinks for spec in asked) else 1.0)
        self._unswitched_test = EmptyReasoningTest.allowing(
            validation.max_unexpected_reasoning_rate if self._instant_modes else 1.0)
        self._started = self._finished = self._answers = self._empty = 0
        self._instant_answers = self._unswitched = 0
        self._refusals: list[str] = []
        self._probes: dict[str, list[Completion]] = {}
        self.findings: dict[str, dict[str, object]] = {}  # reasoning facts per endpoint, for the manifest
        self._open = asyncio.Event()
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

    def abandon(self) -> None:
        """The run gave up before the window was judged: let the dispatcher go and stop."""
        self._open.set()

    async def admit(self) -> Admission:
        if not self._open.is_set() and self._started < self.size:
            self._started += 1
            return "window"
        await self._open.wait()
        return "open" if self.error is None else "aborted"

    def observe(self, outcome: Outcome) -> bool:
        """Count a finished request; False when its answer must not be kept (it shows a broken server)."""
        if outcome.completions and not self._probe(outcome.endpoint, outcome.completions):
            return False
        if self._open.is_set():
            return True
        self._finished += 1
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
        elif self._finished >= self.size:
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
