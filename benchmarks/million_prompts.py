"""Does a million-prompt run hold on this machine: flat memory, a cheap client, a free re-run, a quick verify?

`eagle3-datagen run` end to end, as a user starts it (local mode, hidden states off, local storage), against
--endpoints scripted servers, each in its own process (short answers, real token ids from the tiny model's
tokenizer), at each prompt count. Per count, with the same servers up for both runs:

  first run   wall seconds, the command's peak RSS (sampled every 0.1 s), the client's CPU per request while
              generating (the run log's `generation done: ...` line);
  re-run      the same command again: the chat requests the servers received meanwhile (their /stats, before
              and after) and its wall seconds, as a share of the first run's;
  verify      `eagle3-datagen verify` of the run folder (its structure: markers, indexes, sizes), then
              `verify --deep` (every byte, on threads): wall seconds and exit status of each.

    .venv/bin/python benchmarks/million_prompts.py [--prompts 50000,1000000] [--endpoints 4] [--shard-size 10000]

Goals, for the largest count: peak RSS <= 1.1x the smallest count's, client CPU <= 0.5 ms per request, a re-run
that sends nothing and takes < 2 % of the first run's time, verify < 60 s. Figures are printed, never asserted;
the exit status is non-zero only when a command failed. As in memory_scaling.py, the command's child (Prefect's
temporary API) is not counted in its RSS.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from generation_utilization import CLI_STATS, Servers
from memory_scaling import sample_rss, write_prompts

from eagle3_datagen.testing.scripted_server import Script

REPO = Path(__file__).resolve().parents[1]
RSS_GOAL = 1.1  # peak RSS ÷ the smallest count's
CPU_GOAL_MS = 0.5  # client CPU per request
RERUN_GOAL = 0.02  # re-run seconds ÷ first run's
VERIFY_GOAL_S = 60.0


@dataclass
class Command:
    """One command's exit status, wall seconds, peak RSS of its own process and what it printed."""

    status: int
    seconds: float
    peak_mib: float
    output: str


@dataclass
class Row:
    prompts: int
    first: Command
    cpu_ms: float = float("nan")  # client CPU per request while generating, from the first run's log
    sent: int = 0  # chat requests the servers received during the first run
    server_cpu_ms: float = float("nan")  # the servers' CPU per request during the first run, all together
    rerun: Command | None = None
    rerun_sent: int = -1
    verify: Command | None = None
    deep: Command | None = None

    @property
    def failed(self) -> bool:
        return any(c is not None and c.status != 0 for c in (self.first, self.rerun, self.verify, self.deep))


def run_command(args: list[str], timeout_s: float) -> Command:
    """Run a command from the repo root in local mode (no PREFECT_API_URL), sampling its RSS until it exits.

    A command past `timeout_s`, or left running by an interrupt, is killed: nothing outlives the benchmark.
    """
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    samples: list[tuple[float, float]] = []
    started = time.monotonic()
    command = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = threading.Thread(target=sample_rss, args=(command, samples), daemon=True)
    sampler.start()
    try:
        output, _ = command.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        command.kill()
        output, _ = command.communicate()
        output += f"\n(killed after {timeout_s:.0f} s)"
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    sampler.join()
    return Command(command.returncode, time.monotonic() - started, max((rss for _, rss in samples), default=0.0),
                   output)


def requests_received(stats: list[dict[str, Any]]) -> int:
    return sum(s["requests"] for s in stats)


def server_cpu_s(stats: list[dict[str, Any]]) -> float:
    return sum(s["process_cpu_s"] for s in stats)


def report_command(what: str, command: Command) -> None:
    """The command's own stage lines (task states and summed seconds per stage): where its time went."""
    print(f"  {what}: exit {command.status}, {command.seconds:.1f} s, peak RSS {command.peak_mib:.0f} MiB")
    lines = command.output.splitlines()
    for line in lines:
        if line.startswith(("stage ", "all ")) or (command.status != 0 and line in lines[-15:]):
            print(f"    {line}")


def measure(count: int, args: argparse.Namespace, work: Path) -> Row:
    """First run, re-run and verify of `count` prompts against fresh scripted servers."""
    data = work / f"prompts-{count}.jsonl"
    write_prompts(data, count)
    name = f"million-{count}"
    run_folder = work / "runs" / name
    scripts = [Script(latency_s=args.latency_s, latency_sigma=args.sigma, seed=k) for k in range(args.endpoints)]
    print(f"[{count} prompts] {args.endpoints} scripted endpoints, {args.latency_s * 1e3:g} ms median latency, "
          f"budget {args.budget} each, shards of {args.shard_size}", flush=True)
    with Servers(scripts, tokenizer=args.tokenizer) as servers:
        config = work / f"config-{count}.yaml"
        config.write_text(yaml.safe_dump({
            "run_name": name, "output_uri": str(work / "runs"),
            "data": {"source": str(data), "shard_size": args.shard_size},
            "model": {"name": Script.model, "profile": "qwen3", "tokenizer": args.tokenizer},
            "server": {"endpoints": servers.urls, "max_in_flight": args.budget},
            "generation": {"max_tokens": args.max_tokens},
            "hidden_states": {"backend": "none"},
        }))
        run = ["run", "--config", str(config)]
        before = servers.stats()
        row = Row(count, run_command(run, args.max_run_s))
        after = servers.stats()
        report_command("first run", row.first)
        logs = sorted((run_folder / "logs").glob("run-*.log"))
        found = CLI_STATS.search(logs[-1].read_text(encoding="utf-8")) if logs else None
        row.cpu_ms = float(found.group(2)) if found else float("nan")
        row.sent = requests_received(after) - requests_received(before)
        row.server_cpu_ms = (server_cpu_s(after) - server_cpu_s(before)) / max(row.sent, 1) * 1e3
        print(f"  servers: {row.sent} requests, {row.server_cpu_ms:.2f} ms of their CPU per request", flush=True)
        if row.first.status != 0:
            return row
        row.rerun = run_command(run, args.max_run_s)
        row.rerun_sent = requests_received(servers.stats()) - requests_received(after)
        report_command("re-run", row.rerun)
        print(f"  servers: {row.rerun_sent} requests during the re-run", flush=True)
    row.verify = run_command(["verify", str(run_folder)], args.max_run_s)
    report_command("verify", row.verify)
    row.deep = run_command(["verify", "--deep", str(run_folder)], args.max_run_s)
    report_command("verify --deep", row.deep)
    for command in (row.verify, row.deep):
        if command.status != 0:
            print("    " + "\n    ".join(command.output.strip().splitlines()[-5:]))
    return row


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else "ok" if ok else "FAIL"


def print_table(rows: list[Row]) -> None:
    """One line per count; each goal's column says ok or FAIL (- where the command did not get that far)."""
    base = rows[0].first.peak_mib or float("nan")
    print(f"\n`eagle3-datagen run` end to end, hidden states off; RSS ratio to {rows[0].prompts} prompts")
    print(f"{'prompts':>8} {'run s':>8} {'peak MiB':>9} {'ratio':>6} {'CPU ms/req':>10} {'re-run req':>10} "
          f"{'re-run s':>8} {'% of run':>8} {'verify s':>8} {'--deep s':>8} | {'RSS<=1.1x':>9} {'CPU<=0.5':>8} "
          f"{'re-run 0,<2%':>12} {'verify<60s':>10}")
    for row in rows:
        ratio = row.first.peak_mib / base
        rerun, verify = row.rerun, row.verify
        share = rerun.seconds / row.first.seconds if rerun else float("nan")
        rerun_ok = None if rerun is None else rerun.status == 0 and row.rerun_sent == 0 and share < RERUN_GOAL
        verify_ok = None if verify is None else verify.status == 0 and verify.seconds < VERIFY_GOAL_S
        cpu_ok = None if math.isnan(row.cpu_ms) else row.cpu_ms <= CPU_GOAL_MS  # nan: no `generation done` line
        print(f"{row.prompts:>8} {row.first.seconds:>8.1f} {row.first.peak_mib:>9.0f} {ratio:>5.2f}x "
              f"{row.cpu_ms:>10.2f} {row.rerun_sent if rerun else '-':>10} "
              f"{rerun.seconds if rerun else float('nan'):>8.1f} {share * 100:>7.1f}% "
              f"{verify.seconds if verify else float('nan'):>8.1f} "
              f"{row.deep.seconds if row.deep else float('nan'):>8.1f} | "
              f"{verdict(row.first.status == 0 and ratio <= RSS_GOAL):>9} {verdict(cpu_ok):>8} "
              f"{verdict(rerun_ok):>12} {verdict(verify_ok):>10}")
    print(f"goals (for the largest count): peak RSS <= {RSS_GOAL}x the smallest count's, client CPU <= {CPU_GOAL_MS} "
          f"ms/request, re-run sends 0 requests in < {RERUN_GOAL:.0%} of the first run's time, verify < "
          f"{VERIFY_GOAL_S:.0f} s; a smaller count's re-run is mostly the command's fixed start-up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="50000,1000000", help="prompt counts, comma-separated, smallest first")
    parser.add_argument("--endpoints", type=int, default=4, help="scripted servers, one process each")
    parser.add_argument("--shard-size", type=int, default=10_000, help="data.shard_size")
    parser.add_argument("--budget", type=int, default=64, help="server.max_in_flight per endpoint")
    parser.add_argument("--latency-s", type=float, default=0.02, help="median latency of each answer")
    parser.add_argument("--sigma", type=float, default=0.0, help="log-normal sigma of the latency (0: fixed)")
    parser.add_argument("--max-tokens", type=int, default=256, help="generation.max_tokens (answers are short)")
    parser.add_argument("--max-run-s", type=float, default=4 * 3600, help="a command running longer is killed")
    parser.add_argument("--tokenizer", default=os.environ.get("EAGLE3_TINY_MODEL", str(REPO / "build/tiny-model")))
    args = parser.parse_args()
    counts = [int(n) for n in args.prompts.split(",")]
    rows: list[Row] = []
    (REPO / "build").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagle3-million-", dir=REPO / "build") as work:
        os.environ["TMPDIR"] = work  # what the servers and commands write to temporary folders goes with the rest
        for count in counts:
            rows.append(measure(count, args, Path(work)))
            if rows[-1].failed:
                break
    print_table(rows)
    if any(row.failed for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
