"""Stage 1: wait for every vLLM endpoint, check the served model and that the prompts fit its context.

No chat request is sent here: reasoning is probed by generation's first requests (real prompts whose answers
are kept), judged before the run may spend more (tasks/generation/probation.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import MANIFEST, ShardRef
from eagle3_datagen.config import GenerationConfig, PipelineConfig, ServerConfig, ValidationConfig
from eagle3_datagen.diagnosis import ProbeFinding, ServerCheckFailed
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import OpenAIClient, api_key
from eagle3_datagen.storage import RunLocation, RunStore
from eagle3_datagen.think_tokens import load_tokenizer, render_generation_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
STARTUP_REPORT_EVERY_S = 15.0
REFUSED_FOR_S = 10.0  # refused this long by a port that never answered: nothing is starting there


async def wait_until_healthy(client: OpenAIClient, timeout_s: float, report: Callable[[str], None],
                             every_s: float = STARTUP_REPORT_EVERY_S) -> None:
    """Wait for /health while the server may be starting (503, no answer yet), saying what is awaited every
    `every_s`; fail in seconds where nothing can be starting: a host that does not resolve, or a port that keeps
    refusing and never answered (a dead server, a wrong port), rather than after `server.startup_timeout_s`."""
    started = time.monotonic()
    next_report, refused_since, answered = started, None, False
    while True:
        try:
            status = await client.health_status()
        except socket.gaierror as error:
            raise ServerCheckFailed(
                f"the host of {client.base_url} is not known ({error.strerror}): fix server.endpoints") from None
        except OSError as error:
            if not _refused(error):
                seen = "/health does not answer yet"
            elif answered:
                seen = "the port refuses connections (restarting?)"
            else:
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since >= min(REFUSED_FOR_S, timeout_s):
                    raise ServerCheckFailed(
                        f"nothing listens at {client.base_url} (connection refused for "
                        f"{time.monotonic() - refused_since:.0f} s): start vLLM there, or fix server.endpoints"
                    ) from None
                seen = "the port refuses connections"
        else:
            if status == 200:
                return
            answered, refused_since, seen = True, None, f"/health answers HTTP {status}"
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            raise ServerCheckFailed(
                f"vLLM at {client.base_url} did not answer /health within {timeout_s:.0f}s ({seen}): start the "
                "server or fix server.endpoints (server.startup_timeout_s is how long it may take to start)"
            )
        if time.monotonic() >= next_report:
            report(f"waiting for {client.base_url} to start: {seen}; {elapsed:.0f} s so far, "
                   f"{timeout_s - elapsed:.0f} s left (server.startup_timeout_s)")
            next_report += every_s
        await asyncio.sleep(1.0)


def _refused(error: OSError) -> bool:
    """Connection refused, also where the host has several addresses and asyncio joins their errors in one."""
    return error.errno == errno.ECONNREFUSED or f"[Errno {errno.ECONNREFUSED}]" in str(error)


def check_served_model(endpoint: str, served: list[str], model: str) -> None:
    if model not in served:
        raise ServerCheckFailed(
            f"{endpoint} serves {served}, not model.name {model!r}: set model.name to the served name "
            f"or start vLLM with --served-model-name {model}"
        )


SERVED_FILE = "generations/served.json"


def pin_served(store: RunStore, findings: list[ProbeFinding]) -> None:
    """Every endpoint serves what the run's answers came from: the checkpoint behind the served name and vLLM's
    version, pinned by the first check (a name says nothing of a server restarted on other weights)."""
    served = [{"checkpoint": f.checkpoint, "server_version": f.server_version} for f in findings]
    pinned = store.read_json(SERVED_FILE) if store.exists(SERVED_FILE) else served[0]
    for finding, build in zip(findings, served, strict=True):
        if build != pinned:
            raise ServerCheckFailed(
                f"{finding.endpoint} serves {build['checkpoint']} (vLLM {build['server_version']}), but the run's "
                f"answers come from {pinned['checkpoint']} (vLLM {pinned['server_version']}, {SERVED_FILE}): serve "
                "that there, or start a new run_name")
    if not store.exists(SERVED_FILE):
        store.write_json(SERVED_FILE, pinned)


class PromptLengths:
    """Rendered prompt lengths of a run, counted exactly only where a cheap bound says a prompt may not fit.

    A prompt has at most as many tokens as its UTF-8 bytes plus the template's tokens per message, so only the
    prompts above that bound are rendered and tokenized.
    """

    def __init__(self, store: RunStore, shards: list[ShardRef], tokenizer: PreTrainedTokenizerBase,
                 profile: ModelProfile) -> None:
        self._store, self._shards, self._tokenizer, self._profile = store, shards, tokenizer, profile
        empty = render_generation_prompt(tokenizer, [{"role": "user", "content": ""}], profile)
        self._per_message = len(tokenizer(empty, add_special_tokens=False)["input_ids"])
        self._counted: dict[int, tuple[int, int, int]] = {}  # by room: endpoints usually share one context

    def beyond(self, room: int) -> tuple[int, int, int]:
        """(prompts longer than `room` tokens, all prompts, tokens of the longest of those)."""
        if room not in self._counted:
            self._counted[room] = self._count_beyond(room)
        return self._counted[room]

    def _count_beyond(self, room: int) -> tuple[int, int, int]:
        over = total = longest = 0
        for ref in self._shards:
            for record in self._store.read_shard_records(ref):
                total += 1
                messages = record["messages"]
                if sum(_text_bytes(m["content"]) + self._per_message for m in messages) <= room:
                    continue
                text = render_generation_prompt(self._tokenizer, messages, self._profile)
                tokens = len(self._tokenizer(text, add_special_tokens=False)["input_ids"])
                if tokens > room:
                    over, longest = over + 1, max(longest, tokens)
        return over, total, longest


def _text_bytes(content: str | list[dict[str, Any]]) -> int:
    """A message's text in bytes, an upper bound of its text's tokens. Only the server counts an image's tokens,
    and it refuses the request of a prompt they make too long (rejected with the server's reason)."""
    if isinstance(content, str):
        return len(content.encode())
    return sum(len(part["text"].encode()) for part in content if part["type"] == "text")


def check_context_length(endpoint: str, max_model_len: int | None, max_tokens: int, lengths: PromptLengths,
                         min_accepted_rate: float) -> str | None:
    """Prompt plus max_tokens must fit the served context, or the server refuses the request.

    Refuses the run when too many prompts cannot fit for it to meet `min_accepted_rate` (a run that would end
    with nothing); otherwise returns a warning naming the prompts that will be rejected and the fix.
    """
    if max_model_len is None:
        return None
    over, total, longest = lengths.beyond(max_model_len - max_tokens)
    if not over:
        return None
    lower = f"set generation.max_tokens <= {max_model_len - longest} or " if longest < max_model_len else ""
    fix = f"{lower}serve with --max-model-len >= {max_tokens + longest}"
    found = (f"{endpoint} serves a context of {max_model_len} tokens (max_model_len): {over} of {total} prompts do "
             f"not fit with generation.max_tokens {max_tokens} (the longest needs {max_tokens + longest})")
    if over / total > 1 - min_accepted_rate:
        raise ServerCheckFailed(f"{found}: {fix}")
    return f"{found}; the server will refuse them and each is rejected with its reason; to keep them, {fix}"


async def check_endpoint(
    endpoint: str,
    model: str,
    server: ServerConfig,
    generation: GenerationConfig,
    validation: ValidationConfig,
    lengths: PromptLengths | None = None,
    report: Callable[[str], None] = logger.info,
) -> ProbeFinding:
    """Health, the served model, its context length, and its load report when the budget follows it."""
    async with OpenAIClient(endpoint, api_key(server), server.request_timeout_s) as client:
        await wait_until_healthy(client, server.startup_timeout_s, report)
        served = await client.served_models()
        check_served_model(endpoint, list(served), model)
        version = await client.server_version()
        if server.max_in_flight == "auto" and await client.load() is None:
            raise ServerCheckFailed(
                f"server.max_in_flight auto follows the load a vLLM server reports at /metrics, which {endpoint} "
                "does not report: set a number for server.max_in_flight"
            )
        warning = None if lengths is None else check_context_length(
            endpoint, served[model].get("max_model_len"), generation.max_tokens, lengths, validation.min_accepted_rate)
        return ProbeFinding(endpoint, list(served), max_model_len=served[model].get("max_model_len"),
                            context_warning=warning, checkpoint=served[model].get("root"), server_version=version)


async def check_servers_async(
    model: str,
    server: ServerConfig,
    generation: GenerationConfig,
    validation: ValidationConfig,
    lengths: PromptLengths | None = None,
    report: Callable[[str], None] = logger.info,
) -> list[ProbeFinding]:
    return list(await asyncio.gather(
        *(check_endpoint(url, model, server, generation, validation, lengths, report) for url in server.endpoints)
    ))


@dataclass(frozen=True)
class ServerCheck:
    """What the servers are checked against: the model they must serve, and the prompts' room under max_tokens
    (measured with the tokenizer and the profile's template)."""

    model: str
    profile: ModelProfile
    server: ServerConfig
    generation: GenerationConfig
    validation: ValidationConfig
    tokenizer: str

    @classmethod
    def from_config(cls, config: PipelineConfig) -> ServerCheck:
        return cls(config.model.name, config.profile, config.server, config.generation, config.validation,
                   config.model.tokenizer)


@task(name="check-servers", task_run_name="{run.run_name}/check-servers", cache_policy=NO_CACHE,
      retries=0)
def check_servers(prompt_shards: list[ShardRef], check: ServerCheck, run: RunLocation) -> list[ProbeFinding]:
    """Fail the run before generation unless every endpoint is up and serves the model with room for (enough
    of) the prompts plus max_tokens; the findings start the manifest's `probe` entries."""
    store = run.store()
    lengths = PromptLengths(store, prompt_shards, load_tokenizer(check.tokenizer), check.profile)
    log = get_run_logger()
    findings = asyncio.run(check_servers_async(check.model, check.server, check.generation, check.validation,
                                               lengths, log.warning))
    for finding in findings:
        if finding.context_warning:
            log.warning(finding.context_warning)
    pin_served(store, findings)
    manifest = store.read_json(MANIFEST)
    manifest["probe"] = [asdict(finding) for finding in findings]
    store.write_json(MANIFEST, manifest)
    return findings
