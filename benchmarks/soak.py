"""Soak: the generation stage against a misbehaving OpenAI-protocol server, every fault on, plus a server
restart mid-run. Prints requests sent, faults injected, records accepted, rejected and lost (must be 0), and
retries per record. Bounded in count and time; loopback only. Usage:

    .venv/bin/python benchmarks/soak.py [--records 3000] [--fault-rate 0.2] [--budget 32]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time

from eagle3_datagen.artifacts import artifact_path, rejected_path
from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import RANDOM_FAULTS, Script, ScriptedServer
from tasks.generation import GenerationSettings, generate_shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--shard-size", type=int, default=250)
    parser.add_argument("--fault-rate", type=float, default=0.2)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--latency-s", type=float, default=0.01)
    args = parser.parse_args()

    store = RunStore(tempfile.mkdtemp(prefix="eagle3-soak-"), "soak")
    refs = []
    for index, start in enumerate(range(0, args.records, args.shard_size)):
        rows = [{"id": f"r{i}", "row": i, "messages": [{"role": "user", "content": f"soak question {i}"}]}
                for i in range(start, min(start + args.shard_size, args.records))]
        refs.append(store.write_shard("prompts", index, rows))
    # every transient fault, a few slow answers past the timeout, and a few refusals (HTTP 400) that must end
    # up rejected with the server's reason, never lost
    faults = (*RANDOM_FAULTS, *RANDOM_FAULTS, "slow", "http-400")

    def script(seed: int) -> Script:
        return Script(latency_s=args.latency_s, fault_rate=args.fault_rate, random_faults=faults, slow_s=2.0,
                      seed=seed)

    servers = [ScriptedServer(script(0)).__enter__()]
    settings = GenerationSettings("scripted-model", BUILTIN_PROFILES["qwen3"], GenerationConfig(max_tokens=64), "soak")
    config = ServerConfig(endpoints=[servers[0].url], max_in_flight=args.budget, retry_backoff_s=0.05,
                          max_retries=10, request_timeout_s=1.0)

    def restart_mid_run() -> None:
        while servers[0].log.requests < args.records // 2:
            time.sleep(0.05)
        first = servers[0]
        first.__exit__(None, None, None)
        time.sleep(1.0)
        servers.append(ScriptedServer(script(1), port=first.port).__enter__())

    chaos = threading.Thread(target=restart_mid_run, daemon=True)
    chaos.start()
    started = time.monotonic()
    try:
        generate_shards(store, refs, settings, config, ValidationConfig(early_abort_after=32),
                        logging.getLogger("soak"), progress_every_s=10)
    finally:
        chaos.join(timeout=5)
        for server in servers[1:]:
            server.__exit__(None, None, None)
    elapsed = time.monotonic() - started

    accepted = [r["id"] for ref in refs for r in store.read_jsonl(artifact_path("generations", ref.index))]
    rejected = [r["id"] for ref in refs if store.exists(rejected_path("generations", ref.index))
                for r in store.read_jsonl(rejected_path("generations", ref.index))]
    expected = {f"r{i}" for i in range(args.records)}
    lost = expected - set(accepted) - set(rejected)
    duplicated = len(accepted) + len(rejected) - len(set(accepted) | set(rejected))
    requests = sum(s.log.requests for s in servers)
    injected = sum(s.log.faults for s in servers)
    print(f"run time                 {elapsed:8.1f} s (server restarted once mid-run)")
    print(f"requests sent            {requests:8d}")
    print(f"faults injected          {injected:8d}  (5xx, 429, resets, malformed JSON, missing fields, timeouts, 400)")
    print(f"records accepted         {len(accepted):8d}")
    print(f"records rejected         {len(rejected):8d}  (HTTP 400, with the server's reason)")
    print(f"records lost             {len(lost):8d}")
    print(f"records duplicated       {duplicated:8d}")
    print(f"retries per record       {(requests - args.records) / args.records:8.3f}")
    if lost or duplicated:
        raise SystemExit("the invariant failed: a record was lost or duplicated")


if __name__ == "__main__":
    main()
