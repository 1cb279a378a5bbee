"""The OpenAI-protocol client: request bodies, response shapes, and reading reasoning from every form servers send.

Plain HTTP (`http_client`), not the OpenAI SDK, and orjson (installed with Prefect), not the json module: both
for the client's CPU per request (figures in benchmarks/README.md).
Responses are read here in every form servers send: the reasoning field has had three names (`reasoning`,
`reasoning_content`, inline `<think>` tags).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from eagle3_datagen.config import GenerationConfig, ServerConfig
from eagle3_datagen.errors import Eagle3Error
from eagle3_datagen.http_client import HTTPConnections
from eagle3_datagen.modes import with_system_prompt
from eagle3_datagen.profiles import ModelProfile, ModeSpec
from eagle3_datagen.redaction import redact, register_secret

REASONING_FIELDS = ("reasoning", "reasoning_content")
RUNNING, WAITING, KV_CACHE_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
# Prometheus' text format: `name{labels} value [timestamp]`, labels optional
METRIC_SAMPLE = re.compile(r"(?P<name>vllm:[\w:]+)(\{.*\})?\s+(?P<value>\S+)")
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# the only refusals that can be about one request's own body (a prompt over the context, a field out of range);
# any other status that is not retryable (401, 403, 404, 405...) refuses every request the endpoint is sent
REQUEST_REFUSAL_STATUS = frozenset({400, 413, 422})
UNKNOWN_MODEL = re.compile(r"\bmodel\b[^.]*\b(does not exist|not found)|\b(unknown|invalid) model\b", re.IGNORECASE)
# a 400 about how the server was started, not about the request: every request with tools gets it
SERVER_SETUP = re.compile(r"enable-auto-tool-choice|tool-call-parser", re.IGNORECASE)
CHAT_PATH = "/v1/chat/completions"


class ProtocolError(Eagle3Error, RuntimeError):
    """A response that does not follow the protocol (missing choices, conflicting reasoning fields...)."""


class RequestFailed(Eagle3Error, RuntimeError):
    """A request the server refused; `retryable` says whether trying again can help."""

    def __init__(self, message: str, status: int | None, retryable: bool) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable

    @property
    def broken_answer(self) -> bool:
        """The server answered, and the answer says it is broken (HTTP 500, or a body that breaks the protocol),
        as opposed to busy or away (429, 502-504, timeouts, refused connections), which waiting can cure."""
        return self.status in (200, 500)

    @property
    def refused_request(self) -> bool:
        """The server refused this one request, not every request: the prompt is rejected, not the endpoint.

        A 401 or 403 (the key), a 404 or 405 (the route, or a model the server does not serve) refuses every
        request alike, and so does a 400 that names an unknown model.
        """
        return (self.status in REQUEST_REFUSAL_STATUS and not UNKNOWN_MODEL.search(str(self))
                and not SERVER_SETUP.search(str(self)))


@dataclass(frozen=True)
class Completion:
    """One choice of a chat completion, with its reasoning already separated from its answer."""

    reasoning: str
    content: str
    finish_reason: str | None
    reasoning_source: str  # a field name, "inline" (split here from content), or "none"
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    usage: dict[str, Any]
    model: str
    unread_fields: dict[str, str] = field(default_factory=dict)  # other long text fields of the message
    tool_calls: list[dict[str, Any]] | None = None  # as the served tool parser read them from the completion


@dataclass(frozen=True)
class ServerLoad:
    """What a vLLM server reports of its own load at /metrics."""

    running: float
    waiting: float
    kv_cache_usage: float | None  # 0..1; None when the server does not report it


def parse_metrics(text: str) -> ServerLoad | None:
    """Requests running and waiting and KV-cache usage, summed over engines; None without vLLM's gauges."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        sample = METRIC_SAMPLE.match(line)
        if sample is None or sample["name"] not in (RUNNING, WAITING, KV_CACHE_USAGE):
            continue
        try:
            value = float(sample["value"])
        except ValueError:
            continue
        if math.isfinite(value):  # a value unread (or NaN): as if the server had not reported it
            totals[sample["name"]] = totals.get(sample["name"], 0.0) + value
    if RUNNING not in totals or WAITING not in totals:
        return None
    return ServerLoad(totals[RUNNING], totals[WAITING], totals.get(KV_CACHE_USAGE))


def build_chat_request(
    model: str,
    messages: list[dict[str, str]],
    spec: ModeSpec,
    generation: GenerationConfig,
    *,
    seed: int | None = None,
    max_tokens: int | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON body of a chat completion in one of the model's modes (`profile.mode(name)`), switched on the way
    this model wants; with `tools`, the model may call them (the server's tool parser reads the calls)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": with_system_prompt(messages, spec),
        "max_tokens": max_tokens or generation.max_tokens,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "return_token_ids": True,
    }
    if spec.chat_template_kwargs:
        body["chat_template_kwargs"] = dict(spec.chat_template_kwargs)
    if spec.reasoning_effort:
        body["reasoning_effort"] = spec.reasoning_effort
    if tools:
        body["tools"] = tools
        body["tool_choice"] = "auto"
    if seed is not None:
        body["seed"] = seed
    if generation.n > 1:
        body["n"] = generation.n
    body.update(generation.extra_body)
    return body


def split_inline_reasoning(text: str, profile: ModelProfile) -> tuple[str, str] | None:
    """Split `[<think>]reasoning</think>answer` as sent by a server without a reasoning parser; None if no tags."""
    end = text.find(profile.think_end)
    if end < 0:
        return None
    reasoning = text[:end]
    start = reasoning.find(profile.think_start)
    if start >= 0 and not reasoning[:start].strip():
        reasoning = reasoning[start + len(profile.think_start) :]
    return reasoning, text[end + len(profile.think_end) :]


def read_message(message: Any, profile: ModelProfile) -> tuple[str, str, str]:
    """(reasoning, content, source) from a chat message; ProtocolError for a message that breaks the protocol."""
    if not isinstance(message, dict):
        raise _malformed("message is not an object", message)
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise _malformed("content is not a string", message)
    found = {name: message[name] for name in REASONING_FIELDS if message.get(name)}
    for name, text in found.items():
        if not isinstance(text, str):
            raise _malformed(f"{name} is not a string", message)
    if len(set(found.values())) > 1:
        raise ProtocolError("server sent different `reasoning` and `reasoning_content`; refusing to guess")
    if found:
        return next(iter(found.values())), content, "+".join(found)
    split = split_inline_reasoning(content, profile)
    if split is not None:
        return split[0], split[1], "inline"
    return "", content, "none"


def _malformed(what: str, part: Any) -> ProtocolError:
    """What broke the protocol, with the start of the part it is in: the error goes to logs and rejections."""
    return ProtocolError(f"{what}: {json.dumps(part)[:200]}")


def _unread_text_fields(message: Mapping[str, Any]) -> dict[str, str]:
    known = {"role", "content", "refusal", "tool_calls", "function_call", "annotations", "audio", "name"}
    known.update(REASONING_FIELDS)
    return {k: v for k, v in message.items() if k not in known and isinstance(v, str) and v.strip()}


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """The message's tool calls in the protocol's shape, without the fields a server adds beyond it."""
    if not calls:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise ProtocolError(f"tool_calls is not a list of {{id, function}} objects: {json.dumps(calls)[:200]}")
    return [{"id": call.get("id"), "type": "function", "function": {"name": call["function"].get("name"),
                                                                     "arguments": call["function"].get("arguments")}}
            for call in calls]


def parse_chat_response(body: Any, profile: ModelProfile) -> list[Completion]:
    """Every choice of a chat completion response. Any shape the protocol does not allow is a ProtocolError, so a
    broken answer is retried and counted against its endpoint like an HTTP 500, never a crash."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices:
        raise _malformed("response has no choices", body)
    usage = body.get("usage") or {}
    if not isinstance(usage, dict):
        raise _malformed("usage is not an object", body)
    prompt_token_ids = body.get("prompt_token_ids")
    if not isinstance(prompt_token_ids, list | None):
        raise _malformed("prompt_token_ids is not a list", body)
    completions = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise _malformed("a choice is not an object", body)
        completion_token_ids = choice.get("token_ids")
        if not isinstance(completion_token_ids, list | None):
            raise _malformed("a choice's token_ids is not a list", body)
        message = choice.get("message")
        message = {} if message is None else message
        reasoning, content, source = read_message(message, profile)
        completions.append(
            Completion(
                reasoning=reasoning,
                content=content,
                finish_reason=choice.get("finish_reason"),
                reasoning_source=source,
                prompt_token_ids=prompt_token_ids,
                completion_token_ids=completion_token_ids,
                usage=usage,
                model=body.get("model", ""),
                unread_fields=_unread_text_fields(message),
                tool_calls=_tool_calls(message.get("tool_calls")),
            )
        )
    return completions


def api_key(server: ServerConfig) -> str | None:
    """The endpoints' API key: from `server.api_key_env`, else the Prefect Secret block `server.api_key_secret`.

    The value is registered for redaction, so it never reaches a message, a log line or an artifact.
    """
    key = os.environ.get(server.api_key_env)
    if not key and server.api_key_secret:
        from prefect.blocks.system import Secret

        key = Secret.load(server.api_key_secret).get()
    if key:
        register_secret(key)
    return key or None


class OpenAIClient:
    """A small async client for one vLLM endpoint; the API key comes from the environment only.

    Not the openai SDK: its CPU per request is several times this client's, which would bound how many requests
    one process keeps in flight. The body is plain JSON: vLLM's extra fields need no `extra_body`.
    """

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url = base_url
        self._http = HTTPConnections(base_url, {"Authorization": f"Bearer {api_key}"} if api_key else {})
        self._timeout_s = timeout_s

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    async def health_status(self) -> int:
        """The HTTP status /health answers; OSError when nothing answers (refused, unknown host, no answer in 5 s)."""
        return (await self._http.request("GET", "/health", 5.0)).status

    async def served_models(self) -> dict[str, dict[str, Any]]:
        """Served model names and their cards: the context length (`max_model_len`) and the checkpoint behind the
        name (`root`), when the server reports them."""
        response = await self._http.request("GET", "/v1/models", 10.0)
        _raise_for_status(response.status, f"{self.base_url}/v1/models", response.body)
        return {entry["id"]: entry for entry in json.loads(response.body).get("data", [])}

    async def server_version(self) -> str | None:
        """vLLM's version from its /version; None where the server has no such route."""
        try:
            response = await self._http.request("GET", "/version", 10.0)
            return str(json.loads(response.body)["version"]) if response.status == 200 else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    async def load(self) -> ServerLoad | None:
        """The server's load from its /metrics; None when it reports none or does not answer."""
        try:
            response = await self._http.request("GET", "/metrics", 10.0)
        except OSError:
            return None
        return parse_metrics(response.body.decode("utf-8", "replace")) if response.status == 200 else None

    async def chat(self, body: dict[str, Any], profile: ModelProfile) -> list[Completion]:
        """One chat completion; transport failures and refusals become RequestFailed with `retryable` set."""
        try:
            response = await self._http.request("POST", CHAT_PATH, self._timeout_s, orjson.dumps(body))
        except TimeoutError:
            raise RequestFailed(f"timeout talking to {self.base_url}", None, True) from None
        except OSError as error:
            raise RequestFailed(f"connection to {self.base_url} failed: {error!r}", None, True) from None
        _raise_for_status(response.status, f"{self.base_url}{CHAT_PATH}", response.body)
        try:
            payload = orjson.loads(response.body)
        except ValueError as error:
            raise RequestFailed(f"malformed JSON from {self.base_url}: {error}", 200, True) from None
        try:
            return parse_chat_response(payload, profile)
        except ProtocolError as error:
            raise RequestFailed(f"{self.base_url}: {error}", 200, True) from None


def _raise_for_status(status: int, url: str, data: bytes) -> None:
    if status == 200:
        return
    try:
        detail = json.loads(data)
        detail = detail.get("error", detail) if isinstance(detail, dict) else detail
        message = detail.get("message", detail) if isinstance(detail, dict) else detail
    except ValueError:
        message = data[:300].decode("utf-8", "replace")
    # a gateway may echo the key it refused: the message goes to logs, rejected lists and the run's error
    raise RequestFailed(redact(f"HTTP {status} from {url}: {message}"), status, status in RETRYABLE_STATUS)
