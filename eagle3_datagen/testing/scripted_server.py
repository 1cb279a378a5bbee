"""A small OpenAI-protocol server with scripted behaviour, for fault injection and for response shapes that
current vLLM no longer sends (`reasoning_content` only, both fields, inline tags, gpt-oss channels).

Not a model: the answer text is derived from the question so tests can check it byte for byte. It keeps its
own log of requests and of the number in flight, which tests assert against, and serves its own measurements at
`GET /stats` so a benchmark in another process can read them. Latencies can follow a log-normal law with a heavy
tail, drawn per request from the seed by `scripted_latency` so a benchmark can recompute them exactly.

    python -m eagle3_datagen.testing.scripted_server --port 8001 --latency-s 0.5 --latency-sigma 0.5 --tail-rate 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from eagle3_datagen.testing.vllm_server import free_port

FAULTS = (
    "ok",
    "http-500", "http-502", "http-503", "http-429", "http-408", "http-400",  # an HTTP status with an error body
    "reset",  # the connection drops in the middle of the response body
    "malformed",  # 200 with a body that is not JSON
    "missing",  # 200 with JSON that lacks `choices`
    "broken-choice",  # 200 with JSON whose one choice is not an object
    "slow",  # answers after Script.slow_s (longer than the client's timeout)
    "refuse",  # HTTP 400 naming the question: a refusal of this one request, like vLLM's context-length one
)
RANDOM_FAULTS = ("http-500", "http-503", "http-429", "reset", "malformed", "missing")

SHAPES = (
    "reasoning",  # vLLM >= 0.16
    "reasoning_content",  # older vLLM
    "both",  # the transition releases
    "inline",  # no reasoning parser: "...</think>answer"
    "inline_with_start",  # no reasoning parser: "<think>...</think>answer"
    "gpt_oss",  # harmony channels inline in content
    "other_field",  # reasoning under a name no client reads
    "none",  # thinking off or ignored
)


THINKING_SWITCHES = ("enable_thinking", "thinking")  # Qwen3's and Kimi-K2.5's: false answers without reasoning


def expected_reasoning(question: str) -> str:
    """What the scripted server reasons about a question (non-ASCII on purpose)."""
    return f"\nThe user asks: «{question}». Let me think step by step… 🤔\n"


def expected_content(question: str) -> str:
    return f"\n\nAnswer to «{question[:40]}»: 42 ✅"


def signed_settings(content: str) -> str | None:
    """The sampling settings an answer of a `sign_settings` script was asked under, as it names them."""
    found = re.search(r" \[(temperature [^,]+, max_tokens [^\]]+)\]$", content)
    return found.group(1) if found else None


@dataclass
class Script:
    """What the server does; tests change it between runs."""

    model: str = "scripted-model"
    shape: str = "reasoning"
    return_token_ids: bool = True
    latency_s: float = 0.0  # every request's latency, or the median when latency_sigma or tail_rate is set
    latency_sigma: float = 0.0  # log-normal sigma around latency_s (0: fixed)
    tail_rate: float = 0.0  # fraction of requests that take tail_factor × latency_s (the heavy tail)
    tail_factor: float = 50.0
    slow_s: float = 30.0
    faults: list[str] = field(default_factory=list)  # what the next requests get, in order (see FAULTS)
    fault_rate: float = 0.0  # chance that any other request gets a fault drawn from random_faults
    random_faults: tuple[str, ...] = RANDOM_FAULTS
    unavailable_for: str | None = None  # questions containing this text get HTTP 503 (a shard that fails)
    refused_for: str | None = None  # questions containing this text get HTTP 400 (the prompt's own refusal)
    broken_for: str | None = None  # questions containing this text get a "broken-choice" 200 (a broken answer)
    # a user question containing a key, asked with `tools`, is answered with calls: (function name, arguments)
    tool_calls: dict[str, list[tuple[str, dict[str, Any]]]] = field(default_factory=dict)
    tool_parser: bool = True  # False: a request with tool_choice auto gets vLLM's 400, as without the flags
    seed: int = 0
    think_start: str = "<think>"
    think_end: str = "</think>"
    end_of_turn: str = "<|im_end|>"
    tokenizer: Any = None  # a HF tokenizer: token ids become real encodings of the prompt and the completion
    max_model_len: int | None = None  # a longer prompt + max_tokens is refused with HTTP 400, as vLLM does
    report_max_model_len: bool = True  # in /v1/models (servers other than vLLM may not)
    strip_reasoning_whitespace: bool = False  # as vLLM's kimi_k2 parser: the text loses what the ids kept
    max_running: int | None = None  # like vLLM's max_num_seqs: more requests wait in a queue before they run
    serve_metrics: bool = True  # vLLM's load gauges at /metrics (running, waiting, KV-cache usage)
    reasoning_chars: int = 0  # every reasoning padded to this length: the long traces of real reasoning models
    ignore_thinking_switch: bool = False  # answer with reasoning even when the request switches thinking off
    check_model: bool = False  # a request for a model other than `model` gets vLLM's 404, as after a rename
    sign_settings: bool = False  # the answer names the request's temperature and max_tokens (`signed_settings`)
    starting_for_s: float = 0.0  # /health answers 503 this long after the server starts, as vLLM loading a model
    checkpoint: str = "/models/scripted-checkpoint"  # `root` in /v1/models: what vLLM serves under the name
    version: str = "0.32.0"  # /version, as vLLM reports its own


def scripted_latency(script: Script, index: int) -> float:
    """The latency of the index-th request (0-based, in arrival order): a pure function of the script and index.

    Each draw is seeded by (seed, index) alone, so a benchmark recomputes the exact latencies the server slept
    for (and the ideal run time they allow) from the request count the server reports.
    """
    if not script.latency_sigma and not script.tail_rate:
        return script.latency_s
    draw = random.Random(f"{script.seed}:{index}")  # str seeds are hashed with SHA-512: stable across processes
    if draw.random() < script.tail_rate:
        return script.latency_s * script.tail_factor
    return script.latency_s * math.exp(draw.gauss(0.0, script.latency_sigma))


def questions(bodies: list[dict[str, Any]]) -> list[str]:
    """The question each request asked (its last message), in arrival order: what a test counts asked again."""
    return [body["messages"][-1]["content"] for body in bodies]


@dataclass
class Log:
    """What the server saw. `bodies` and `in_flight_samples` grow with every request: None stops keeping them."""

    requests: int = 0
    faults: int = 0
    in_flight: int = 0
    running: int = 0  # in flight and past the queue (all of them unless Script.max_running is set)
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] | None = field(default_factory=list)
    authorizations: list[str] = field(default_factory=list)  # the Authorization header of each kept body
    in_flight_samples: list[tuple[float, int]] | None = field(default_factory=list)
    first_request_at: float | None = None  # time.monotonic(): one clock for every process on the machine
    last_request_at: float | None = None
    last_response_at: float | None = None
    scripted_latency_s: float = 0.0  # sum of the latencies slept (fault "slow" excluded)
    in_flight_area: float = 0.0  # integral of in_flight over time, in request-seconds
    area_at_last_request: float = 0.0
    _changed_at: float = field(default=0.0, init=False, repr=False)

    def change(self, now: float, delta: int) -> None:
        """Account the in-flight count since the last change, then apply delta (+1 arrival, -1 response)."""
        self.in_flight_area += self.in_flight * (now - self._changed_at)
        self._changed_at = now
        self.in_flight += delta
        if delta > 0:
            self.first_request_at = now if self.first_request_at is None else self.first_request_at
            self.last_request_at = now
            self.area_at_last_request = self.in_flight_area
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        else:
            self.last_response_at = now
        if self.in_flight_samples is not None:
            self.in_flight_samples.append((now, self.in_flight))

    def stats(self) -> dict[str, Any]:
        """Counts and time-weighted mean in flight, from the first request to the last response and to the last
        request (after it the client has nothing left to send, so only the slowest requests remain)."""
        def mean(area: float, end: float | None) -> float:
            if self.first_request_at is None or end is None or end <= self.first_request_at:
                return 0.0
            return area / (end - self.first_request_at)

        return {
            "requests": self.requests, "faults": self.faults, "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight, "first_request_at": self.first_request_at,
            "last_request_at": self.last_request_at, "last_response_at": self.last_response_at,
            "scripted_latency_s": self.scripted_latency_s, "in_flight_area": self.in_flight_area,
            "mean_in_flight": mean(self.in_flight_area, self.last_response_at),
            "mean_in_flight_to_last_request": mean(self.area_at_last_request, self.last_request_at),
        }


def padded(reasoning: str, chars: int) -> str:
    """The reasoning grown to `chars` characters with numbered steps (distinct, so no tokenizer collapses them)."""
    steps = (f" Step {i}: check the previous step again." for i in itertools.count())
    while len(reasoning) < chars:
        reasoning += next(steps)
    return reasoning[:chars] if chars else reasoning


def _message(question: str, body: dict[str, Any], script: Script) -> dict[str, Any]:
    reasoning, content = padded(expected_reasoning(question), script.reasoning_chars), expected_content(question)
    if script.sign_settings:
        content += f" [temperature {body.get('temperature')}, max_tokens {body.get('max_tokens')}]"
    switches = body.get("chat_template_kwargs") or {}
    thinking = script.ignore_thinking_switch or all(switches.get(name, True) for name in THINKING_SWITCHES)
    if script.shape == "none" or not thinking:
        return {"role": "assistant", "content": content.strip()}
    shapes: dict[str, dict[str, Any]] = {
        "reasoning": {"reasoning": reasoning, "content": content},
        "reasoning_content": {"reasoning_content": reasoning, "content": content},
        "both": {"reasoning": reasoning, "reasoning_content": reasoning, "content": content},
        "inline": {"content": f"{reasoning}{script.think_end}{content}"},
        "inline_with_start": {"content": f"{script.think_start}{reasoning}{script.think_end}{content}"},
        "gpt_oss": {"content": f"{script.think_start}{reasoning}{script.think_end}{content}"},
        "other_field": {"thinking": reasoning, "content": content},
    }
    return {"role": "assistant", **shapes[script.shape]}


def _with_calls(message: dict[str, Any], question: str, script: Script) -> dict[str, Any]:
    """The answer as calls, where the script says the question calls tools."""
    calls = next((calls for key, calls in script.tool_calls.items() if key in question), None)
    if calls is None:
        return message
    return {**message, "content": None, "tool_calls": [
        {"id": f"chatcmpl-tool-{k}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}} for k, (name, arguments) in enumerate(calls)]}


class ScriptedServer:
    """Runs the app with uvicorn in a background thread on a free loopback port.

    keep_log=False keeps no bodies or in-flight samples, so a long benchmark run stays at constant memory.
    """

    def __init__(self, script: Script | None = None, port: int | None = None, keep_log: bool = True) -> None:
        self.script = script or Script()
        self.log = Log() if keep_log else Log(bodies=None, in_flight_samples=None)
        self._lock = threading.Lock()
        self._run_slots: asyncio.Semaphore | None = None  # created in the server's own event loop
        self._random = random.Random(self.script.seed)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[
            Route("/health", self._health),
            Route("/v1/models", self._models),
            Route("/version", self._version),
            Route("/stats", self._stats),
            Route("/metrics", self._metrics),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._ready_at = 0.0

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("scripted server did not start")
            time.sleep(0.01)
        self._ready_at = time.monotonic() + self.script.starting_for_s
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def _health(self, request: Request) -> Response:
        return Response(status_code=503 if time.monotonic() < self._ready_at else 200)

    async def _models(self, request: Request) -> Response:
        card = {"id": self.script.model, "object": "model", "root": self.script.checkpoint}
        if self.script.max_model_len is not None and self.script.report_max_model_len:
            card["max_model_len"] = self.script.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def _version(self, request: Request) -> Response:
        return JSONResponse({"version": self.script.version})

    async def _stats(self, request: Request) -> Response:
        """The log's measurements, and this process's CPU time: a benchmark tells a saturated server from a slow
        client with it."""
        with self._lock:
            return JSONResponse({**self.log.stats(), "process_cpu_s": time.process_time()})

    async def _metrics(self, request: Request) -> Response:
        """vLLM's load gauges. The KV cache is half full when max_running requests run: the request limit binds
        first, as with short requests on a large cache."""
        if not self.script.serve_metrics:
            return Response(status_code=404)
        with self._lock:
            running, waiting = self.log.running, self.log.in_flight - self.log.running
        usage = 0.5 * running / self.script.max_running if self.script.max_running else 0.0
        labels = f'{{engine="0",model_name="{self.script.model}"}}'
        return Response(f"vllm:num_requests_running{labels} {running:.1f}\nvllm:num_requests_waiting{labels} "
                        f"{waiting:.1f}\nvllm:kv_cache_usage_perc{labels} {usage:.4f}\n", media_type="text/plain")

    def _next_fault(self) -> str:
        if self.script.faults:
            return self.script.faults.pop(0)
        if self.script.fault_rate and self._random.random() < self.script.fault_rate:
            return self._random.choice(self.script.random_faults)
        return "ok"

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            latency = scripted_latency(self.script, self.log.requests)
            self.log.requests += 1
            if self.log.bodies is not None:
                self.log.bodies.append(body)
                self.log.authorizations.append(request.headers.get("authorization", ""))
            question = body["messages"][-1]["content"]
            down = self.script.unavailable_for is not None and self.script.unavailable_for in question
            refused = self.script.refused_for is not None and self.script.refused_for in question
            broken = self.script.broken_for is not None and self.script.broken_for in question
            fault = "http-503" if down else "http-400" if refused else "broken-choice" if broken else self._next_fault()
            self.log.faults += fault != "ok"
            self.log.scripted_latency_s += latency if fault != "slow" else 0.0
            self.log.change(time.monotonic(), +1)
        try:
            if self.script.max_running:
                self._run_slots = self._run_slots or asyncio.Semaphore(self.script.max_running)
                await self._run_slots.acquire()
            with self._lock:
                self.log.running += 1
            try:
                await asyncio.sleep(self.script.slow_s if fault == "slow" else latency)
            finally:
                with self._lock:
                    self.log.running -= 1
                if self._run_slots is not None:
                    self._run_slots.release()
            if self.script.check_model and body.get("model") != self.script.model:
                return JSONResponse({"object": "error", "message": f"The model `{body.get('model')}` does not exist.",
                                     "type": "NotFoundError", "param": None, "code": 404}, status_code=404)
            if fault == "refuse":
                return JSONResponse({"error": {"message": f"scripted refusal of «{question}»", "code": 400}},
                                    status_code=400)
            if fault.startswith("http-"):
                status = int(fault.removeprefix("http-"))
                return JSONResponse({"error": {"message": f"scripted failure {status}", "code": status}},
                                    status_code=status)
            if body.get("tool_choice") == "auto" and not self.script.tool_parser:
                return JSONResponse({"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                               "--tool-call-parser to be set", "code": 400}}, status_code=400)
            if fault == "malformed":
                return Response('{"choices": [', media_type="application/json")
            if fault == "missing":
                return JSONResponse({"id": "chatcmpl-scripted", "object": "chat.completion"})
            if fault == "broken-choice":
                return JSONResponse({"id": "chatcmpl-scripted", "object": "chat.completion", "choices": [None]})
            message = _message(question, body, self.script)
            if body.get("tools") and body["messages"][-1]["role"] == "user":
                message = _with_calls(message, question, self.script)
            too_long = self._context_refusal(body, message)
            if too_long:
                return JSONResponse({"error": {"message": too_long, "code": 400}}, status_code=400)
            payload = self._completion(body, message)
            if fault == "reset":
                return StreamingResponse(_torn(json.dumps(payload)), media_type="application/json")
            return JSONResponse(payload)
        finally:
            with self._lock:
                self.log.change(time.monotonic(), -1)

    def _context_refusal(self, body: dict[str, Any], message: dict[str, Any]) -> str | None:
        """vLLM's refusal when the prompt plus max_tokens exceeds the served context."""
        limit = self.script.max_model_len
        if limit is None:
            return None
        prompt = len(self._token_ids(body, message)[0])
        if prompt + body["max_tokens"] <= limit:
            return None
        return (f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt + body['max_tokens']} tokens ({prompt} in the messages, {body['max_tokens']} in the "
                "completion). Please reduce the length of the messages or completion.")

    def _token_ids(self, body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
        """Real ids when a tokenizer is scripted (the start tag is generated unless the prompt ends with it)."""
        tok = self.script.tokenizer
        if tok is None:
            return list(range(8)), list(range(100, 116))
        prompt = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True,
                                         **(body.get("chat_template_kwargs") or {}))
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        start = "" if prompt.rstrip().endswith(self.script.think_start) else self.script.think_start
        content = message["content"] or ""
        completion = content if reasoning is None else f"{start}{reasoning}{self.script.think_end}{content}"
        encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        return encode(prompt), encode(completion + self.script.end_of_turn)

    def _completion(self, body: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
        prompt_ids, completion_ids = self._token_ids(body, message)
        if self.script.strip_reasoning_whitespace and message.get("reasoning"):
            message = {**message, "reasoning": message["reasoning"].rstrip()}
        payload: dict[str, Any] = {
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "model": self.script.model,
            "choices": [{"index": k, "message": message, "finish_reason": "stop"} for k in range(body.get("n", 1))],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                      "total_tokens": len(prompt_ids) + len(completion_ids)},
        }
        if self.script.return_token_ids:
            payload["prompt_token_ids"] = prompt_ids
            for choice in payload["choices"]:
                choice["token_ids"] = completion_ids
        return payload


async def _torn(text: str):  # type: ignore[no-untyped-def]
    """Half a body, then the connection is dropped."""
    yield text[: len(text) // 2]
    raise ConnectionResetError("scripted connection reset")


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, in its own process so a client's CPU time excludes the server's."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="loopback port (0: a free one)")
    parser.add_argument("--latency-s", type=float, default=0.0, help="median latency")
    parser.add_argument("--latency-sigma", type=float, default=0.0, help="log-normal sigma (0: fixed latency)")
    parser.add_argument("--tail-rate", type=float, default=0.0, help="fraction of requests in the heavy tail")
    parser.add_argument("--tail-factor", type=float, default=50.0, help="tail latency ÷ median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=None, help="requests run at once; more wait in a queue")
    parser.add_argument("--model", default=Script.model, help="the served model name")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder: real token ids in every answer")
    parser.add_argument("--reasoning-chars", type=int, default=0, help="pad every reasoning to this length")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from eagle3_datagen.think_tokens import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    script = Script(latency_s=args.latency_s, latency_sigma=args.latency_sigma, tail_rate=args.tail_rate,
                    tail_factor=args.tail_factor, seed=args.seed, max_running=args.max_running, model=args.model,
                    tokenizer=tokenizer, reasoning_chars=args.reasoning_chars)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with ScriptedServer(script, port=args.port or None, keep_log=False) as server:
        print(server.url, flush=True)  # the line a parent process waits for: the server is accepting
        stop.wait()


if __name__ == "__main__":
    main()
