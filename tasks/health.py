"""Stage 1: wait for every vLLM endpoint, check the served model, then probe reasoning with real requests.

The probe exists because the costliest failure is quiet: thinking off, no reasoning parser, or reasoning in a
field nobody reads. Each of these stops the run here, before the first shard, with the fix in the message.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import asdict

from prefect import task
from prefect.cache_policies import NO_CACHE
from transformers import PreTrainedTokenizerBase

from eagle3_datagen.artifacts import MANIFEST, ShardRef
from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.diagnosis import ProbeFinding, ServerCheckFailed, diagnose
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion, OpenAIClient, RequestFailed, api_key, build_chat_request
from eagle3_datagen.storage import RunStore
from eagle3_datagen.think_tokens import load_tokenizer, render_generation_prompt

PROBE_MAX_TOKENS = 256
PROBE_CANDIDATES = 16  # prompts the probe may try, in order, until probe_requests are answered
LONGEST_CANDIDATES = 8  # the longest prompts by characters, rendered to find the longest in tokens


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


def check_context_length(endpoint: str, max_model_len: int | None, max_tokens: int, longest_prompt: int) -> None:
    """Every request must fit the served context: otherwise the server refuses it and the run produces nothing."""
    if max_model_len is None or max_tokens + longest_prompt <= max_model_len:
        return
    fits = max_model_len - longest_prompt
    lower = f"set generation.max_tokens <= {fits} or " if fits > 0 else ""
    raise ServerCheckFailed(
        f"{endpoint} serves a context of {max_model_len} tokens (max_model_len), but generation.max_tokens "
        f"{max_tokens} plus the longest prompt ({longest_prompt} tokens) needs {max_tokens + longest_prompt}: "
        f"{lower}serve with --max-model-len >= {max_tokens + longest_prompt}"
    )


def longest_prompt_tokens(
    store: RunStore, prompt_shards: list[ShardRef], tokenizer: PreTrainedTokenizerBase, profile: ModelProfile
) -> int:
    """Tokens of the longest rendered prompt: the longest few by characters are rendered and counted."""
    conversations = (record["messages"] for ref in prompt_shards for record in store.read_jsonl(ref.path))
    longest = heapq.nlargest(LONGEST_CANDIDATES, conversations, key=lambda ms: sum(len(m["content"]) for m in ms))
    rendered = [render_generation_prompt(tokenizer, messages, profile) for messages in longest]
    return max((len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]), default=0)


async def check_endpoint(
    endpoint: str,
    model: str,
    profile: ModelProfile,
    server: ServerConfig,
    generation: GenerationConfig,
    validation: ValidationConfig,
    probe_prompts: list[list[dict[str, str]]],
    longest_prompt: int = 0,
) -> ProbeFinding:
    """Health, served model and its context length, then the reasoning probe on one endpoint."""
    async with OpenAIClient(endpoint, api_key(server), server.request_timeout_s) as client:
        await wait_until_healthy(client, server.startup_timeout_s)
        served = await client.served_models()
        check_served_model(endpoint, list(served), model)
        check_context_length(endpoint, served[model], generation.max_tokens, longest_prompt)
        max_tokens = min(generation.max_tokens, PROBE_MAX_TOKENS)
        completions: list[Completion] = []
        refused: list[str] = []
        for messages in probe_prompts:  # a prompt the server refuses (too long, say) is not a server fault
            body = build_chat_request(model, messages, profile, generation, max_tokens=max_tokens)
            try:
                completions.append((await client.chat(body, profile))[0])
            except RequestFailed as error:
                if error.retryable:
                    raise ServerCheckFailed(
                        f"probe request to {endpoint} failed: {error}: the server answers /health but not a chat "
                        "request; see the server's log"
                    ) from None
                refused.append(str(error))
            if len(completions) == validation.probe_requests:
                break
        if not completions:
            raise ServerCheckFailed(f"{endpoint} refused every probe request: {refused[-1] if refused else 'none'}")
        return diagnose(endpoint, list(served), completions, profile, validation.allow_inline_reasoning)


async def check_servers_async(
    model: str,
    profile: ModelProfile,
    server: ServerConfig,
    generation: GenerationConfig,
    validation: ValidationConfig,
    probe_prompts: list[list[dict[str, str]]],
    longest_prompt: int = 0,
) -> list[ProbeFinding]:
    return list(
        await asyncio.gather(
            *(
                check_endpoint(url, model, profile, server, generation, validation, probe_prompts, longest_prompt)
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
    prompt_shards: list[ShardRef],
    tokenizer: str,
    output_uri: str,
    run_name: str,
) -> list[ProbeFinding]:
    """Fail the run before generation unless every endpoint is up, serves the model with room for the longest
    prompt plus max_tokens, and reasons visibly.

    The probe sends the run's first prompts with the run's own settings, so it tests what generation will do.
    """
    store = RunStore(output_uri, run_name)
    prompts = [record["messages"] for record in store.read_jsonl(prompt_shards[0].path)[:PROBE_CANDIDATES]]
    longest = longest_prompt_tokens(store, prompt_shards, load_tokenizer(tokenizer), profile)
    findings = asyncio.run(check_servers_async(model, profile, server, generation, validation, prompts, longest))
    manifest = store.read_json(MANIFEST)
    manifest["probe"] = [asdict(finding) for finding in findings]
    store.write_json(MANIFEST, manifest)
    return findings
