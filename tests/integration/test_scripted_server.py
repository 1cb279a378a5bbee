"""The scripted server's latency draws and its own measurements, which the utilization benchmark relies on.

The benchmark recomputes in its own process the latencies each server slept for, so a draw must depend on the
seed and the request index alone, and the time-weighted in-flight mean at /stats must match a known load.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import httpx

from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, scripted_latency

HEAVY = Script(latency_s=0.1, latency_sigma=0.5, tail_rate=0.05, tail_factor=50.0, seed=3)


def test_latency_draws_are_a_pure_function_of_seed_and_index() -> None:
    draws = [scripted_latency(HEAVY, k) for k in range(500)]
    assert draws == [scripted_latency(HEAVY, k) for k in range(500)]
    assert scripted_latency(HEAVY, 417) == draws[417], "a draw does not depend on the draws before it"
    assert draws != [scripted_latency(replace(HEAVY, seed=4), k) for k in range(500)]
    code = "from eagle3_datagen.testing.scripted_server import *; print([scripted_latency(Script(latency_s=0.1, " \
           "latency_sigma=0.5, tail_rate=0.05, seed=3), k) for k in range(5)])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.stdout.strip() == repr(draws[:5]), "another process (another hash seed) draws the same"


def test_latency_draws_have_the_promised_median_spread_and_tail() -> None:
    draws = [scripted_latency(HEAVY, k) for k in range(4000)]
    tail = [d for d in draws if d == HEAVY.latency_s * HEAVY.tail_factor]
    body = [math.log(d / HEAVY.latency_s) for d in draws if d != HEAVY.latency_s * HEAVY.tail_factor]
    assert 0.035 < len(tail) / len(draws) < 0.065  # 5% ± 4.5 standard deviations
    assert abs(statistics.median(body)) < 0.05, "the median is latency_s"
    assert abs(statistics.stdev(body) - HEAVY.latency_sigma) < 0.03, "log-normal with the scripted sigma"
    assert max(body) < math.log(HEAVY.tail_factor), "only the tail reaches tail_factor × the median"
    assert {scripted_latency(Script(latency_s=0.25), k) for k in range(50)} == {0.25}, "no spread: fixed"


def test_stats_report_the_time_weighted_mean_in_flight_of_a_known_load() -> None:
    async def load(url: str) -> tuple[dict[str, float], dict[str, float]]:
        body = {"messages": [{"role": "user", "content": "q"}]}
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client:
            await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(4)))
            burst = (await client.get("/stats")).json()
            await asyncio.sleep(0.5)  # idle: counts in the window with nothing in flight
            await client.post("/v1/chat/completions", json=body)
            return burst, (await client.get("/stats")).json()

    with ScriptedServer(Script(latency_s=0.5), keep_log=False) as server:
        burst, after = asyncio.run(load(server.url))
        assert server.log.bodies is None and server.log.in_flight_samples is None, "nothing kept per request"
    assert (burst["requests"], burst["max_in_flight"], burst["in_flight"]) == (4, 4, 0)
    assert 3.5 < burst["mean_in_flight"] <= 4.0, "4 concurrent requests of 0.5 s: 4 in flight on average"
    assert after["requests"] == 5 and after["max_in_flight"] == 4
    assert burst["scripted_latency_s"] == 2.0
    assert 2.49 < after["in_flight_area"] < 2.7, "4 × 0.5 + 1 × 0.5 request-seconds"
    window = after["last_response_at"] - after["first_request_at"]
    assert window >= 1.5 and math.isclose(after["mean_in_flight"], after["in_flight_area"] / window)
    to_last = after["last_request_at"] - after["first_request_at"]
    assert math.isclose(after["mean_in_flight_to_last_request"] * to_last, burst["in_flight_area"], rel_tol=0.02)


def test_the_cli_serves_until_sigterm() -> None:
    server = subprocess.Popen([sys.executable, "-m", "eagle3_datagen.testing.scripted_server", "--port", "0",
                               "--latency-s", "0.01", "--latency-sigma", "0.5", "--tail-rate", "0.1"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()  # printed once the server accepts connections
        reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]},
                           trust_env=False, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"]
        stats = httpx.get(f"{url}/stats", trust_env=False, timeout=10).json()
        assert stats["requests"] == 1
        assert stats["scripted_latency_s"] == scripted_latency(Script(latency_s=0.01, latency_sigma=0.5,
                                                                       tail_rate=0.1), 0)
        started = time.monotonic()
        server.terminate()
        assert server.wait(timeout=10) == 0, "SIGTERM is a clean exit"
        assert time.monotonic() - started < 5
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
