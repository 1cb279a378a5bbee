"""Does generation keep its in-flight budget full, from the command's start to its last request?

Scripted OpenAI-protocol servers, each in its own process, keep their own log of requests in flight (so every
request the client sends counts, probes too) and report it at /stats. Phases (see benchmarks/README.md):

  cli        `eagle3-datagen run` end to end at two latency settings: utilization, first request, stall, CPU;
  clients    the HTTP client's CPU per request: the project's against raw aiohttp and the openai SDK's two transports;
  auto       `server.max_in_flight: auto` against a sweep of fixed budgets on the real vLLM CPU server;
  shared     the stage alone, every shard at once on one budget per endpoint, against an ideal client;
  rollout    multi-turn conversations regenerated turn by turn (data.turns: rollout) against the same number of
             single-turn prompts, in one run: the budget stays full though each turn waits for the one before;
  per-shard  shards one after another, each with its own pool, extrapolated to all;
  cpu        the stage alone at zero server latency: the client's CPU time per request.

Figures are printed, never asserted: speed goals are checked by reading this output, not by timed tests.

    .venv/bin/python benchmarks/generation_utilization.py [--phases cli,clients,auto]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import glob
import heapq
import json
import logging
import os
import pstats
import re
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.protocol import OpenAIClient, build_chat_request, parse_chat_response
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, scripted_latency
from tasks.generation import GenerationSettings, generate_shards
from tasks.prompts import write_prompt_shards

PROBATION = 1  # ValidationConfig.early_abort_after: the smallest window (the first request runs alone)
SETTINGS = GenerationSettings("scripted-model", BUILTIN_PROFILES["qwen3"], GenerationConfig(max_tokens=64), "bench")
LOG = logging.getLogger("benchmark")


class Servers:
    """Scripted servers as subprocesses on free loopback ports; terminated on exit whatever happened.

    With a `tokenizer` folder their token ids are real encodings of the text, as the run's validation requires.
    """

    def __init__(self, scripts: list[Script], tokenizer: str | None = None) -> None:
        self.scripts = scripts
        self.tokenizer = tokenizer
        self.procs: list[subprocess.Popen[str]] = []
        self.urls: list[str] = []

    def __enter__(self) -> Servers:
        try:
            for script in self.scripts:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "eagle3_datagen.testing.scripted_server", "--port", "0",
                     "--latency-s", repr(script.latency_s), "--latency-sigma", repr(script.latency_sigma),
                     "--tail-rate", repr(script.tail_rate), "--tail-factor", repr(script.tail_factor),
                     "--seed", str(script.seed), "--model", script.model,
                     *(["--max-running", str(script.max_running)] if script.max_running else []),
                     *(["--tokenizer", self.tokenizer] if self.tokenizer else [])],
                    stdout=subprocess.PIPE, text=True))
            for proc in self.procs:
                assert proc.stdout is not None
                ready, _, _ = select.select([proc.stdout], [], [], 30)
                url = proc.stdout.readline().strip() if ready else ""
                if not url.startswith("http://127.0.0.1:"):
                    raise RuntimeError(f"scripted server did not start (said {url!r})")
                self.urls.append(url)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stats(self) -> list[dict[str, Any]]:
        return [httpx.get(f"{url}/stats", timeout=10, trust_env=False).json() for url in self.urls]


@dataclass
class Sim:
    makespan_s: float
    utilization: float  # first request -> last response
    dispatch_utilization: float  # first request -> last request sent


def simulate(draws: list[list[float]], budget: int, batches: list[int]) -> Sim:
    """The run time of a client with zero overhead that follows generate_shards' policy on the same latencies.

    Each batch (all shards when shared, one shard otherwise) starts with the probation request alone, then
    every free slot is refilled at once, to the endpoint with the most free slots (ties: the first), which is
    what `EndpointPool.acquire` picks. Endpoint e's k-th request takes draws[e][k], as on the server.
    """
    used = [0] * len(draws)
    free = [budget] * len(draws)  # every batch starts and ends with every slot free
    running: list[tuple[float, int]] = []  # (finish, endpoint)
    spans: list[tuple[float, float]] = []
    now = 0.0

    def start(at: float) -> None:
        e = max(range(len(free)), key=free.__getitem__)
        free[e] -= 1
        spans.append((at, at + draws[e][used[e]]))
        heapq.heappush(running, (spans[-1][1], e))
        used[e] += 1

    for size in batches:
        sent = min(PROBATION, size)
        for _ in range(sent):
            start(now)
        while running:  # the probation window: nothing else starts until it has finished
            now, e = heapq.heappop(running)
            free[e] += 1
        while sent < size or running:
            while sent < size and max(free) > 0:
                start(now)
                sent += 1
            now, e = heapq.heappop(running)
            free[e] += 1
    capacity = budget * len(draws)
    last_sent = max(began for began, _ in spans)
    to_last_sent = sum(min(finish, last_sent) - began for began, finish in spans)
    return Sim(now, sum(f - s for s, f in spans) / (capacity * now), to_last_sent / (capacity * last_sent or 1.0))


def lower_bound(latencies: list[float], capacity: int) -> float:
    """No schedule of these requests on `capacity` slots ends sooner: the work spread evenly, or the longest one."""
    return max(sum(latencies) / capacity, max(latencies))


def write_prompts(store: RunStore, requests: int, shard_size: int, topic: str = "question") -> list[ShardRef]:
    refs = []
    for index, first in enumerate(range(0, requests, shard_size)):
        rows = [{"id": f"p{row}", "row": row, "messages": [{"role": "user", "content": f"{topic} {row}"}]}
                for row in range(first, min(requests, first + shard_size))]
        refs.append(store.write_shard("prompts", index, rows))
    return refs


def cpu_s() -> float:
    """User + system CPU of this process only (the servers are other processes)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_generation(store: RunStore, refs: list[ShardRef], urls: list[str], budget: int) -> None:
    server = ServerConfig(endpoints=urls, max_in_flight=budget)
    generate_shards(store, refs, SETTINGS, server, ValidationConfig(early_abort_after=PROBATION), LOG)


def utilization(stats: list[dict[str, Any]], budget: int) -> tuple[list[float], float, list[float], float]:
    """Mean in flight ÷ budget per endpoint and overall, over first request -> last response and -> last request."""
    window = max(s["last_response_at"] for s in stats) - min(s["first_request_at"] for s in stats)
    full = sum(s["in_flight_area"] for s in stats) / (budget * len(stats) * window)
    spans = [s["last_request_at"] - s["first_request_at"] for s in stats]
    dispatch = sum(s["mean_in_flight_to_last_request"] * span for s, span in zip(stats, spans, strict=True))
    return ([s["mean_in_flight"] / budget for s in stats], full,
            [s["mean_in_flight_to_last_request"] / budget for s in stats], dispatch / (budget * sum(spans)))


def check_draws(stats: list[dict[str, Any]], draws: list[list[float]], expected: int) -> list[list[float]]:
    """The latencies each server slept for, recomputed from its request count and checked against its own sum."""
    served = [d[: s["requests"]] for s, d in zip(stats, draws, strict=True)]
    for s, latencies in zip(stats, served, strict=True):
        if s["faults"] or abs(sum(latencies) - s["scripted_latency_s"]) > 1e-6 * max(1.0, s["scripted_latency_s"]):
            raise RuntimeError(f"server stats disagree with the recomputed latencies: {s}")
    if sum(s["requests"] for s in stats) != expected:
        print(f"  note: {sum(s['requests'] for s in stats)} requests for {expected} prompts (retries)")
    return served


def server_cpu(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> float:
    """CPU seconds the server processes spent between two /stats readings."""
    return sum(a["process_cpu_s"] - b["process_cpu_s"] for b, a in zip(before, after, strict=True))


def fmt(values: list[float]) -> str:
    return " ".join(f"ep{i} {v:.3f}" for i, v in enumerate(values))


def shared_phase(args: argparse.Namespace, scripts: list[Script], draws: list[list[float]], tmp: str) -> float:
    """Every shard at once on one budget per endpoint; returns the run time."""
    print("\n[shared] one budget per endpoint for every shard")
    with Servers(scripts) as servers:
        store = RunStore(tmp, "shared")
        refs = write_prompts(store, args.requests, args.shard_size)
        t0, c0, idle = time.monotonic(), cpu_s(), servers.stats()
        run_generation(store, refs, servers.urls, args.budget)
        wall, client_cpu = time.monotonic() - t0, cpu_s() - c0
        stats = servers.stats()
    served = check_draws(stats, draws, args.requests)
    full_e, full, disp_e, disp = utilization(stats, args.budget)
    bound = lower_bound([x for lat in served for x in lat], args.budget * args.endpoints)
    ideal = simulate(draws, args.budget, [args.requests])
    print(f"  wall {wall:.1f}s, CPU per request: client {client_cpu / args.requests * 1e3:.2f} ms, servers "
          f"{server_cpu(idle, stats) / args.requests * 1e3:.2f} ms; max in flight "
          f"{[s['max_in_flight'] for s in stats]}")
    print(f"  utilization first request -> last response: {fmt(full_e)}  overall {full:.3f}  "
          f"(ideal client {ideal.utilization:.3f})")
    print(f"  utilization first request -> last request sent: {fmt(disp_e)}  overall {disp:.3f}  "
          f"(ideal client {ideal.dispatch_utilization:.3f}; target >= 0.95)")
    print(f"  run time ÷ lower bound {wall / bound:.2f} (bound {bound:.1f}s);  run time ÷ ideal client "
          f"{wall / ideal.makespan_s:.2f} (ideal client {ideal.makespan_s:.1f}s)")
    return wall


def rollout_phase(args: argparse.Namespace, tmp: str) -> None:
    """Conversations of `--rollout-turns` user turns, each turn asked the moment the one before it returns, against
    as many single-turn prompts, in one run on one server at the end-to-end runs' budget."""
    conversations, turns, budget = args.rollout_conversations, args.rollout_turns, CLI_BUDGET
    requests = conversations * turns
    print(f"\n[rollout] {conversations} conversations × {turns} user turns = {requests} requests against {requests} "
          f"single-turn prompts; budget {budget} on one endpoint, latency median "
          f"{args.rollout_median_s}s, log-normal sigma {args.sigma}")
    rows = [{"messages": [{"role": "user", "content": f"conversation {c} question {t}"} for t in range(turns)]}
            for c in range(conversations)]
    scripts = [Script(latency_s=args.rollout_median_s, latency_sigma=args.sigma, seed=args.seed)]
    figures = {}
    for name in ("single-turn", "rollout"):
        with Servers(scripts) as servers:
            store = RunStore(tmp, f"rollout-{name}")
            refs = (write_prompt_shards(rows, store, args.shard_size, turns="rollout").shards if name == "rollout"
                    else write_prompts(store, requests, args.shard_size, topic=name))
            t0 = time.monotonic()
            run_generation(store, refs, servers.urls, budget)
            wall, stats = time.monotonic() - t0, servers.stats()
        if sum(s["requests"] for s in stats) != requests:
            raise RuntimeError(f"{name}: {sum(s['requests'] for s in stats)} requests for {requests}")
        _, full, _, dispatch = utilization(stats, budget)
        figures[name] = dispatch
        print(f"  {name:>11}: wall {wall:.1f}s; utilization first request -> last request sent {dispatch:.3f} "
              f"(target >= 0.95), -> last response {full:.3f}")
    print(f"  rollout ÷ single-turn utilization {figures['rollout'] / figures['single-turn']:.3f}")


def per_shard_phase(args: argparse.Namespace, scripts: list[Script], draws: list[list[float]], sizes: list[int],
                    tmp: str) -> float:
    """Shards one after another, each with its own pool; returns the run time extrapolated to every shard."""
    count = min(len(sizes), args.per_shard_shards or len(sizes))
    print(f"\n[per-shard] shards one after another, each with its own pool: {count} of {len(sizes)} shards")
    with Servers(scripts) as servers:
        store = RunStore(tmp, "per-shard")
        refs = write_prompts(store, args.requests, args.shard_size)[:count]
        bounds, before = [], [0] * args.endpoints
        t0 = time.monotonic()
        for ref in refs:
            run_generation(store, [ref], servers.urls, args.budget)
            after = [s["requests"] for s in servers.stats()]
            served = [x for e, d in enumerate(draws) for x in d[before[e]:after[e]]]
            bounds.append(lower_bound(served, args.budget * args.endpoints))
            before = after
        wall = time.monotonic() - t0
        stats = servers.stats()
    check_draws(stats, draws, sum(sizes[:count]))
    full_e, full, _, _ = utilization(stats, args.budget)
    ideal = simulate(draws, args.budget, sizes[:count])
    print(f"  wall {wall:.1f}s for {count} shards -> {wall / count * len(sizes):.1f}s for {len(sizes)} (extrapolated)")
    print(f"  utilization first request -> last response: {fmt(full_e)}  overall {full:.3f}  "
          f"(ideal client {ideal.utilization:.3f})")
    print(f"  run time ÷ lower bound {wall / sum(bounds):.2f} (bound {sum(bounds):.1f}s);  run time ÷ ideal client "
          f"{wall / ideal.makespan_s:.2f} (ideal client {ideal.makespan_s:.1f}s)")
    return wall / count * len(sizes)


def cpu_phase(args: argparse.Namespace, tmp: str) -> None:
    """Zero server latency: what one request costs the client, in CPU time."""
    print(f"\n[cpu] zero server latency, {args.cpu_requests} requests, shared budget")
    with Servers([Script(seed=e) for e in range(args.endpoints)]) as servers:
        store = RunStore(tmp, "cpu")
        refs = write_prompts(store, args.cpu_requests, args.shard_size)
        t0, c0, idle = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF), servers.stats()
        run_generation(store, refs, servers.urls, args.budget)
        wall, c1, stats = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF), servers.stats()
    user, system, n = c1.ru_utime - c0.ru_utime, c1.ru_stime - c0.ru_stime, args.cpu_requests
    print(f"  client CPU {(user + system) / n * 1e3:.2f} ms/request (user {user / n * 1e3:.2f}, system "
          f"{system / n * 1e3:.2f}); servers {server_cpu(idle, stats) / n * 1e3:.2f} ms/request; {n / wall:.0f} "
          f"requests/s, wall {wall:.1f}s")


def profile_phase(args: argparse.Namespace, tmp: str) -> None:
    """The client's hottest functions by CPU time (wall-clock attribution on a shared machine would charge other
    processes' time to whatever happened to be running)."""
    print(f"\n[profile] zero server latency, {args.profile} requests under cProfile, in CPU seconds")
    with Servers([Script(seed=e) for e in range(args.endpoints)]) as servers:
        store = RunStore(tmp, "profile")
        refs = write_prompts(store, args.profile, args.shard_size)
        profiler = cProfile.Profile(time.process_time)
        profiler.runcall(run_generation, store, refs, servers.urls, args.budget)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(15)


CLI_BUDGET = 64
CLI_STATS = re.compile(r"longest event-loop stall (\d+) ms, client CPU ([\d.]+) ms/request")


@dataclass
class CliRun:
    utilization: float  # mean in flight ÷ budget, first request -> last request, from the server's own log
    first_request_s: float  # from starting the command to the server seeing its first request
    stall_ms: float
    cpu_ms: float  # client CPU per request while generating (the whole process: every thread)
    noise: int  # ERROR lines and tracebacks the command printed
    status: int
    wall_s: float  # from starting the command to its exit


def write_dataset(path: str, requests: int) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for row in range(requests):
            out.write(json.dumps({"messages": [{"role": "user", "content": f"question {row}"}]}) + "\n")


def cli_run(args: argparse.Namespace, median_s: float, seed: int, dataset: str, tmp: str) -> CliRun:
    """`eagle3-datagen run` as a user starts it, in local mode, against one scripted server."""
    name = f"cli-{median_s:g}-{seed}"
    config = {
        "run_name": name, "output_uri": f"{tmp}/runs",
        "data": {"source": dataset, "shard_size": args.shard_size},
        "model": {"name": "scripted-model", "profile": "qwen3", "tokenizer": args.tokenizer},
        "server": {"endpoints": [], "max_in_flight": CLI_BUDGET, "startup_timeout_s": 30},
        "generation": {"max_tokens": 64},
        "hidden_states": {"backend": "none"},
    }
    script = Script(latency_s=median_s, latency_sigma=args.cli_sigma, seed=seed)
    with Servers([script], tokenizer=args.tokenizer) as servers:
        config["server"]["endpoints"] = servers.urls  # type: ignore[index]
        path = f"{tmp}/{name}.yaml"
        with open(path, "w", encoding="utf-8") as out:
            yaml.safe_dump(config, out)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "cli.main", "run", "--config", path], env=env,
                              capture_output=True, text=True, timeout=args.max_run_s)
        wall = time.monotonic() - started
        [stats] = servers.stats()
    printed = done.stdout + done.stderr
    logs = sorted(glob.glob(f"{tmp}/runs/{name}/logs/run-*.log"))
    found = CLI_STATS.search(Path(logs[-1]).read_text(encoding="utf-8")) if logs else None
    if done.returncode != 0 or found is None:
        print(f"  run {name} exited {done.returncode}: {printed.strip().splitlines()[-1:]}")
    return CliRun(stats["mean_in_flight_to_last_request"] / CLI_BUDGET, stats["first_request_at"] - started,
                  float(found.group(1)) if found else float("nan"), float(found.group(2)) if found else float("nan"),
                  sum(("ERROR" in line) + ("Traceback" in line) for line in printed.splitlines()), done.returncode,
                  wall)


def cli_phase(args: argparse.Namespace, tmp: str) -> None:
    """The whole command, end to end, `--cli-runs` times per latency setting; every figure from one run each."""
    dataset = f"{tmp}/prompts.jsonl"
    write_dataset(dataset, args.cli_requests)
    print(f"\n[cli] `eagle3-datagen run`, {args.cli_requests} prompts, budget {CLI_BUDGET}, log-normal sigma "
          f"{args.cli_sigma}, local mode; utilization = mean in flight ÷ budget from the server's first to its last "
          "request, read from its own log (every request the command sent counts)")
    print(f"  {'median':>7} {'utilization min / median':>25} {'first request s':>22} {'stall ms':>9} "
          f"{'CPU ms/req':>10} {'ERROR+tb':>8} {'command s':>10}")
    for median_s in args.cli_medians:
        runs = [cli_run(args, median_s, seed, dataset, tmp) for seed in range(args.cli_runs)]
        util = sorted(r.utilization for r in runs)
        first = sorted(r.first_request_s for r in runs)
        print(f"  {median_s * 1e3:5.0f}ms {util[0]:12.3f} / {statistics.median(util):.3f}      "
              f"{first[0]:6.1f} / {statistics.median(first):.1f} / {first[-1]:.1f}  "
              f"{max(r.stall_ms for r in runs):8.0f} {statistics.median(r.cpu_ms for r in runs):10.2f} "
              f"{sum(r.noise for r in runs):8d} {statistics.median(r.wall_s for r in runs):10.1f}   exit "
              f"{[r.status for r in runs]}")
    print("  targets: utilization >= 0.97 (50 ms) and >= 0.995 (500 ms) in every run; first request <= 10 s; "
          "stall <= 50 ms; CPU <= 0.5 ms/request; no ERROR line or traceback")
    print(f"  an idle event loop's wake-up costs {wakeup_cpu_ms():.2f} ms of CPU on this machine: at a few "
          "hundred requests/s or fewer, each answer wakes the client's loop by itself")


def wakeup_cpu_ms(wakeups: int = 200) -> float:
    """CPU per wake-up of an otherwise idle asyncio loop (a 10 ms sleep, `wakeups` times)."""
    async def sleep_often() -> float:
        began = time.thread_time()
        for _ in range(wakeups):
            await asyncio.sleep(0.01)
        return (time.thread_time() - began) / wakeups * 1e3

    return asyncio.run(sleep_often())


async def _drive(call: Callable[[int], Awaitable[Any]], requests: int, concurrency: int) -> float:
    """CPU seconds of this process per request, `concurrency` requests in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(k: int) -> None:
        async with gate:
            await call(k)

    began = time.process_time()
    await asyncio.gather(*(one(k) for k in range(requests)))
    return (time.process_time() - began) / requests


PROJECT = "project (httptools)"


async def _client_costs(url: str, requests: int, concurrency: int) -> dict[str, float]:
    """One round of each client against the same server, reading reasoning and token ids as the stage does."""
    import aiohttp
    import openai

    profile = BUILTIN_PROFILES["qwen3"]
    body = lambda k: build_chat_request(  # noqa: E731
        "scripted-model", [{"role": "user", "content": f"q{k}"}], profile.mode(None), GenerationConfig(max_tokens=64))
    costs: dict[str, float] = {}
    async with OpenAIClient(url, None, 60) as ours:
        costs[PROJECT] = await _drive(lambda k: ours.chat(body(k), profile), requests, concurrency)
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def raw(k: int) -> None:  # the project's client before it parsed HTTP itself
            async with session.post("/v1/chat/completions", json=body(k)) as response:
                assert response.status == 200
                parse_chat_response(json.loads(await response.read()), profile)

        costs["raw aiohttp"] = await _drive(raw, requests, concurrency)
    for name, http in (("openai SDK, httpx transport", openai.DefaultAsyncHttpxClient()),
                       ("openai SDK, aiohttp transport", openai.DefaultAioHttpClient())):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=http) as sdk:
            async def call(k: int, sdk: openai.AsyncOpenAI = sdk) -> None:
                done = await sdk.chat.completions.create(
                    model="scripted-model", messages=[{"role": "user", "content": f"q{k}"}], max_tokens=64,
                    extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": True}})
                extra = done.choices[0].message.model_extra or {}
                assert extra.get("reasoning") and (done.choices[0].model_extra or {}).get("token_ids")

            costs[name] = await _drive(call, requests, concurrency)
    return costs


def clients_phase(args: argparse.Namespace) -> None:
    """The HTTP client's own cost: the project's client against raw aiohttp and the openai SDK on both its
    transports; at zero latency (answers back to back) and at 500 ms (each answer wakes the loop by itself)."""
    for median_s, requests in ((0.0, args.client_requests), (0.5, args.client_slow_requests)):
        print(f"\n[clients] client CPU per request, server latency {median_s * 1e3:.0f} ms median (log-normal sigma "
              f"{args.cli_sigma if median_s else 0:g}), {requests} requests at {CLI_BUDGET} in flight, "
              f"{args.client_rounds} interleaved rounds (median)")
        rounds: dict[str, list[float]] = {}
        with Servers([Script(latency_s=median_s, latency_sigma=args.cli_sigma if median_s else 0.0)]) as servers:
            for _ in range(args.client_rounds):
                for name, cost in asyncio.run(_client_costs(servers.urls[0], requests, CLI_BUDGET)).items():
                    rounds.setdefault(name, []).append(cost)
        ours = statistics.median(rounds[PROJECT])
        for name, costs in rounds.items():
            print(f"  {name:<32} {statistics.median(costs) * 1e3:6.2f} ms/request  "
                  f"({statistics.median(costs) / ours:.1f}× the project's)")


def auto_phase(args: argparse.Namespace, tmp: str) -> None:
    """`max_in_flight: auto` against fixed budgets on the real vLLM CPU server: throughput of each setting.

    After a warm-up, the settings run in turn, `--vllm-rounds` times over, each run on prompts of its own (no
    prefix-cache hit from an earlier run), each round starting one setting later (no setting always runs in the
    same place, right after the same one); a setting's figure is its median. Beside the ratio of medians it prints
    the median over rounds of auto's run ÷ the best fixed budget's run of the same round: this machine's speed
    moves between rounds by more than the settings differ, and a pair from one round shares it.
    """
    from cli.demo import DEMO_MODEL_NAME, tiny_model_dir
    from eagle3_datagen.testing.vllm_server import LocalVLLMServer

    settings = GenerationSettings(DEMO_MODEL_NAME, BUILTIN_PROFILES["qwen3"],
                                  GenerationConfig(max_tokens=args.vllm_max_tokens, temperature=0.7), "bench")
    print(f"\n[auto] real vLLM CPU server (tiny model), {args.vllm_requests} requests of up to "
          f"{args.vllm_max_tokens} tokens per run, {args.vllm_rounds} rounds over the settings; completion tokens/s")
    runs: dict[str, list[float]] = {}

    def measure(budget: int | str, name: str, requests: int) -> float:
        store = RunStore(tmp, name)
        refs = write_prompts(store, requests, args.shard_size, topic=name)
        config = ServerConfig(endpoints=[server.url], max_in_flight=budget)
        began = time.monotonic()
        out = generate_shards(store, refs, settings, config, ValidationConfig(), LOG)
        wall = time.monotonic() - began
        return sum(int(r["usage"]["completion_tokens"]) for ref in out for r in store.read_jsonl(ref.path)) / wall

    with LocalVLLMServer(tiny_model_dir(), served_name=DEMO_MODEL_NAME, reasoning_parser="qwen3",
                         log_path=Path(tmp) / "vllm.log") as server:
        measure(64, "warm-up", 200)
        settings_in_turn: list[int | str] = [*args.vllm_budgets, "auto"]
        for round_ in range(args.vllm_rounds):
            shift = round_ % len(settings_in_turn)  # each setting takes each place in a round in turn
            for budget in settings_in_turn[shift:] + settings_in_turn[:shift]:
                runs.setdefault(str(budget), []).append(measure(budget, f"round {round_} budget {budget}",
                                                                args.vllm_requests))
    for budget, rates in runs.items():
        print(f"  max_in_flight {budget:>5}: {statistics.median(rates):8.0f} tokens/s  (runs: "
              f"{', '.join(f'{r:.0f}' for r in rates)})")
    best = max((k for k in runs if k != "auto"), key=lambda k: statistics.median(runs[k]))
    ratio = statistics.median(runs["auto"]) / statistics.median(runs[best])
    paired = statistics.median(a / b for a, b in zip(runs["auto"], runs[best], strict=True))
    print(f"  auto ÷ best fixed ({best}): {ratio:.3f}  (target >= 0.95); median of the rounds' own ratios "
          f"{paired:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--budget", type=int, default=256, help="max_in_flight per endpoint")
    parser.add_argument("--endpoints", type=int, default=2)
    parser.add_argument("--median-s", type=float, default=1.5, help="median server latency")
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal sigma of the latency")
    parser.add_argument("--tail-rate", type=float, default=0.005, help="fraction taking tail-factor × median")
    parser.add_argument("--tail-factor", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0, help="endpoint e draws its latencies from seed + e")
    parser.add_argument("--per-shard-shards", type=int, default=2, help="shards run in the per-shard phase (0: all)")
    parser.add_argument("--cpu-requests", type=int, default=2000, help="requests of the zero-latency phase")
    parser.add_argument("--rollout-conversations", type=int, default=2000, help="conversations of the rollout phase")
    parser.add_argument("--rollout-turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument("--rollout-median-s", type=float, default=0.05, help="median latency of the rollout phase")
    parser.add_argument("--phases", default="cli,clients,auto",
                        help="comma-separated subset of cli, clients, auto, shared, rollout, per-shard, cpu")
    parser.add_argument("--client-requests", type=int, default=3000, help="requests per client per round")
    parser.add_argument("--client-slow-requests", type=int, default=640,
                        help="requests per client per round at 500 ms")
    parser.add_argument("--client-rounds", type=int, default=3)
    parser.add_argument("--vllm-requests", type=int, default=2000, help="requests per run on the vLLM server")
    parser.add_argument("--vllm-rounds", type=int, default=7,
                        help="runs of each setting, interleaved (one setting's runs spread by up to a quarter)")
    parser.add_argument("--vllm-max-tokens", type=int, default=128)
    parser.add_argument("--vllm-budgets", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="fixed budgets of the sweep (the tiny model's CPU server runs 128 at once)")
    parser.add_argument("--cli-requests", type=int, default=3000, help="prompts of each end-to-end run")
    parser.add_argument("--cli-medians", type=float, nargs="+", default=[0.05, 0.5], help="median latencies (s)")
    parser.add_argument("--cli-sigma", type=float, default=0.8, help="log-normal sigma of the end-to-end runs")
    parser.add_argument("--cli-runs", type=int, default=3, help="end-to-end runs per median latency")
    parser.add_argument("--tokenizer", default=os.environ.get("EAGLE3_TINY_MODEL", "build/tiny-model"),
                        help="tokenizer of the end-to-end runs (the tiny model's)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then N zero-latency requests under cProfile: the client's hottest functions")
    parser.add_argument("--max-run-s", type=float, default=900.0, help="abort an end-to-end run that takes longer")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # each figure as soon as measured
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the servers are terminated
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    phases = set(args.phases.split(","))
    scripts = [Script(latency_s=args.median_s, latency_sigma=args.sigma, tail_rate=args.tail_rate,
                      tail_factor=args.tail_factor, seed=args.seed + e) for e in range(args.endpoints)]
    draws = [[scripted_latency(script, k) for k in range(args.requests)] for script in scripts] if phases & {
        "shared", "per-shard"} else []
    sizes = [min(args.shard_size, args.requests - first) for first in range(0, args.requests, args.shard_size)]
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        if "cli" in phases:
            cli_phase(args, tmp)
        if phases & {"shared", "per-shard"}:
            print(f"\n{args.requests} requests in {len(sizes)} shards of {args.shard_size}, budget {args.budget} per "
                  f"endpoint × {args.endpoints} endpoints = {args.budget * args.endpoints} in flight; latency median "
                  f"{args.median_s}s, log-normal sigma {args.sigma}, {args.tail_rate:.2%} take {args.tail_factor:g}× "
                  "the median")
            print(f"probation: early_abort_after={PROBATION}: each generate_shards call sends its first request alone "
                  "and waits for it; included in every measured figure and in the simulated ideal client")
            print("ideal time: lower bound = max(sum of the latencies served ÷ slots, longest latency) (no schedule "
                  "beats it);\n  ideal client = zero-overhead simulation of the same policy on the same latencies (the "
                  "bound plus the\n  unavoidable drain: the slowest requests still running once nothing is left to "
                  "send)")
        shared_s = shared_phase(args, scripts, draws, tmp) if "shared" in phases else None
        if "rollout" in phases:
            rollout_phase(args, tmp)
        if "per-shard" in phases:
            per_shard_s = per_shard_phase(args, scripts, draws, sizes, tmp)
            if shared_s is not None:
                ideal_shared = simulate(draws, args.budget, [args.requests]).makespan_s
                ideal_per_shard = simulate(draws, args.budget, sizes).makespan_s
                print(f"\n[per-shard ÷ shared] run time ratio {per_shard_s / shared_s:.1f}× measured (per-shard "
                      f"extrapolated), {ideal_per_shard / ideal_shared:.1f}× for ideal clients "
                      f"({ideal_per_shard:.0f}s ÷ {ideal_shared:.0f}s, all {len(sizes)} shards simulated)")
        if "cpu" in phases:
            cpu_phase(args, tmp)
        if "clients" in phases:
            clients_phase(args)
        if "auto" in phases:
            auto_phase(args, tmp)
        if args.profile:
            profile_phase(args, tmp)
    print(f"\nbenchmark wall time {time.monotonic() - began:.0f}s")


if __name__ == "__main__":
    main()
