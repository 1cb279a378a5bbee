"""Failure cost: what a run spends before it ends when its server breaks, with the default settings.

Two cases against the scripted OpenAI-protocol server, through the real generation stage:
  broken  every request answers HTTP 500 (a server up but broken)
  killed  the only server dies after `--kill-after` of `--prompts` requests (a server gone)
For each: requests sent, seconds until the stage ended, warnings logged, how it ended. Usage:

    .venv/bin/python benchmarks/failure_cost.py [--prompts 600] [--kill-after 250] [--give-up-after-s 300]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time

from eagle3_datagen.config import GenerationConfig, ServerConfig, ValidationConfig
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from tasks.generation import GenerationError, GenerationSettings, generate_shards


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(prompts: int, script: Script, server_config: dict[str, object], kill_after: int | None) -> None:
    with tempfile.TemporaryDirectory(prefix="eagle3-failure-cost-") as folder:
        store = RunStore(folder, "run")
        rows = [{"id": f"p{i}", "row": i, "messages": [{"role": "user", "content": f"question {i}"}]}
                for i in range(prompts)]
        refs = [store.write_shard("prompts", 0, rows)]
        log = logging.getLogger("failure-cost")
        log.propagate = False
        counter = _Count()
        log.handlers = [counter]
        server = ScriptedServer(script).__enter__()
        if kill_after is not None:
            def kill() -> None:
                while server.log.requests < kill_after:
                    time.sleep(0.005)
                server.__exit__(None, None, None)
            threading.Thread(target=kill, daemon=True).start()
        config = ServerConfig(endpoints=[server.url], **server_config)
        settings = GenerationSettings("scripted-model", BUILTIN_PROFILES["qwen3"], GenerationConfig(max_tokens=64), "b")
        started = time.monotonic()
        try:
            generate_shards(store, refs, settings, config, ValidationConfig(), log)
            ended = "completed"
        except GenerationError as error:
            ended = str(error)[:150]
        seconds = time.monotonic() - started
        sent = server.log.requests
        if kill_after is None:
            server.__exit__(None, None, None)
    print(f"  requests {sent}, {seconds:.1f}s, {len(counter.lines)} warnings; ended: {ended}")
    for line in counter.lines[:6]:
        print(f"  warning: {line[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=600)
    parser.add_argument("--broken-prompts", type=int, default=32)
    parser.add_argument("--kill-after", type=int, default=250)
    parser.add_argument("--give-up-after-s", type=float, default=ServerConfig().give_up_after_s)
    args = parser.parse_args()
    defaults = {"max_in_flight": 64, "give_up_after_s": args.give_up_after_s}
    print(f"broken: {args.broken_prompts} prompts, every request answered HTTP 500 (defaults, 64 in flight)")
    _run(args.broken_prompts, Script(faults=["http-500"] * 1_000_000), defaults, None)
    print(f"killed: {args.prompts} prompts, the server dies after {args.kill_after} requests "
          f"(give_up_after_s {args.give_up_after_s:.0f})")
    _run(args.prompts, Script(latency_s=0.05), defaults, args.kill_after)


if __name__ == "__main__":
    main()
