"""Stage 1: wait for every vLLM endpoint, check the served model, then probe reasoning with real requests.

The probe exists because the costliest failure is quiet: thinking off, no reasoning parser, or reasoning in a
field nobody reads. Each of these stops the run here, before the first shard, with the fix in the message.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import MANIFEST, ShardRef
from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion, OpenAIClient, RequestFailed, api_key, build_chat_request
from eagle3_datagen.storage import RunStore

PROBE_MAX_TOKENS = 256
PROBE_CANDIDATES = 16  # prompts the probe may try, in order, until probe_requests are answered


class ServerCheckFailed(UserError):
    """The servers are not fit for this run; the message says what to fix."""


@dataclass(frozen=True)
class ProbeFinding:
    """What the probe saw on one endpoint, recorded in the manifest."""

    endpoint: str
    served_models: list[str]
    reasoning_field: str
    thinking_on: bool
    parser_split_tags: bool
    token_ids_returned: bool
    reasoning_chars: int


async def wait_until_healthy(client: OpenAIClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.healthy():
        if time.monotonic() > deadline:
            raise ServerCheckFailed(
                f"vLLM at {client.base_url} did not answer /health within {timeout_s:.0f}s: "
                "start the server or fix server.endpoints"
            )
        await asyncio.sleep(1.0)


def check_served_model(endpoint: str, served: list[str], model: str) -> None:
    if model not in served:
        raise ServerCheckFailed(
            f"{endpoint} serves {served}, not model.name {model!r}: set model.name to the served name "
            f"or start vLLM with --served-model-name {model}"
        )


def diagnose(
    endpoint: str,
    served: list[str],
    completions: list[Completion],
    profile: ModelProfile,
    allow_inline: bool,
) -> ProbeFinding:
    """Turn the probe's completions into a finding, or a ServerCheckFailed that names the fix."""
    parser_hint = f"restart vLLM with --reasoning-parser {profile.reasoning_parser}"
    for done in completions:
        if done.model and done.model not in served:
            raise ServerCheckFailed(f"{endpoint} answered as model {done.model!r}, not one of {served}")
        if done.prompt_token_ids is None or done.completion_token_ids is None:
            raise ServerCheckFailed(
                f"{endpoint} returned no token ids for `return_token_ids`: use vLLM >= 0.10.2 "
                "(exact sequences need the server's own ids)"
            )
        tags_in_content = profile.think_start in done.content or profile.think_end in done.content
        if done.reasoning_source == "inline" and not allow_inline:
            raise ServerCheckFailed(
                f"{endpoint} sends reasoning inline in content (`...{profile.think_end}`): the server has no "
                f"reasoning parser: {parser_hint}, or set validation.allow_inline_reasoning: true"
            )
        if done.reasoning_source == "none" and tags_in_content:
            raise ServerCheckFailed(
                f"{endpoint} sends think tags inside content: the server has no reasoning parser: {parser_hint}"
            )
        if done.reasoning_source == "none" and done.unread_fields:
            names = ", ".join(sorted(done.unread_fields))
            raise ServerCheckFailed(
                f"{endpoint} put text in message field(s) {names} that this run does not read as reasoning "
                "(it reads `reasoning`, `reasoning_content`, or inline tags): use a vLLM server with "
                f"--reasoning-parser {profile.reasoning_parser}"
            )
        if not done.reasoning.strip():
            switch = profile.chat_template_kwargs or {"reasoning_effort": profile.reasoning_effort}
            raise ServerCheckFailed(
                f"{endpoint} returned no reasoning with thinking switched on ({switch}): thinking is off or "
                f"the switch is ignored: check model.profile matches the served model and {parser_hint}"
            )
    first = completions[0]
    return ProbeFinding(
        endpoint=endpoint,
        served_models=served,
        reasoning_field=first.reasoning_source,
        thinking_on=True,
        parser_split_tags=first.reasoning_source != "inline",
        token_ids_returned=True,
        reasoning_chars=min(len(c.reasoning) for c in completions),
    )


async def check_endpoint(
    endpoint: str,
    model: str,
    profile: ModelProfile,
    server: ServerConfig,
    generation: GenerationConfig,
    validation: ValidationConfig,
    probe_prompts: list[list[dict[str, str]]],
) -> ProbeFinding:
    """Health, served model, then the reasoning probe on one endpoint."""
    async with OpenAIClient(endpoint, api_key(server), server.request_timeout_s) as client:
        await wait_until_healthy(client, server.startup_timeout_s)
        served = await client.served_models()
        check_served_model(endpoint, served, model)
        max_tokens = min(generation.max_tokens, PROBE_MAX_TOKENS)
        completions: list[Completion] = []
        refused: list[str] = []
        for messages in probe_prompts:  # a prompt the server refuses (too long, say) is not a server fault
            body = build_chat_request(model, messages, profile, generation, max_tokens=max_tokens)
            try:
                completions.append((await client.chat(body, profile))[0])
            except RequestFailed as error:
                if error.retryable:
                    raise ServerCheckFailed(f"probe request to {endpoint} failed: {error}") from None
                refused.append(str(error))
            if len(completions) == validation.probe_requests:
                break
        if not completions:
            raise ServerCheckFailed(f"{endpoint} refused every probe request: {refused[-1] if refused else 'none'}")
        return diagnose(endpoint, served, completions, profile, validation.allow_inline_reasoning)


async def check_servers_async(
    model: str,
    profile: ModelProfile,
    server: ServerConfig,
    generation: GenerationConfig,
    validation: ValidationConfig,
    probe_prompts: list[list[dict[str, str]]],
) -> list[ProbeFinding]:
    return list(
        await asyncio.gather(
            *(
                check_endpoint(url, model, profile, server, generation, validation, probe_prompts)
                for url in server.endpoints
            )
        )
    )


@task(name="check-servers", cache_policy=NO_CACHE, retries=0)
def check_servers(
    model: str,
    profile: ModelProfile,
    server: ServerConfig,
    generation: GenerationConfig,
    validation: ValidationConfig,
    probe_shard: ShardRef,
    output_uri: str,
    run_name: str,
) -> list[ProbeFinding]:
    """Fail the run before generation unless every endpoint is up, serves the model, and reasons visibly.

    The probe sends the run's first prompts with the run's own settings, so it tests what generation will do.
    """
    store = RunStore(output_uri, run_name)
    prompts = [record["messages"] for record in store.read_jsonl(probe_shard.path)[:PROBE_CANDIDATES]]
    findings = asyncio.run(check_servers_async(model, profile, server, generation, validation, prompts))
    manifest = store.read_json(MANIFEST)
    manifest["probe"] = [asdict(finding) for finding in findings]
    store.write_json(MANIFEST, manifest)
    return findings
