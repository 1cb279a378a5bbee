"""Resume property: random cases of the `run` command killed (SIGKILL) or stopped (SIGTERM), faulted (401 bursts,
500s, malformed 200s, a server that dies or comes back on another checkpoint), started twice at once, and resumed
after dataset edits and settings changes, each ending with a clean run; prints each case and the totals (cases,
attempts, kill points, refusals, each kind's count, violations: must be 0). Cases are drawn from their seed alone:
`--seed N --cases 1` plays case N again. Loopback only; everything in a temporary folder, removed. Usage:

    .venv/bin/python benchmarks/resume_property.py [--cases 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from prefect.settings import PREFECT_API_URL
from prefect.testing.utilities import prefect_test_harness

from cli.demo import DEMO_MODEL_NAME, tiny_model_dir
from cli.main import main as command
from eagle3_datagen.testing.resume_cases import draw_case, run_case, verify_at_both_depths
from eagle3_datagen.think_tokens import load_tokenizer

verify = verify_at_both_depths(command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed; the others follow")
    args = parser.parse_args()
    model = tiny_model_dir()
    tokenizer = load_tokenizer(str(model))
    totals = {"attempts": 0, "kill points": 0, "refused": 0, "violations": 0}
    kinds = {"SIGTERM stops": 0, "malformed 200s": 0, "other checkpoints": 0, "second starts": 0}
    started = time.monotonic()
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # its first write races the harness's own
    with prefect_test_harness(server_startup_timeout=120):
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or ""}
        for seed in range(args.seed, args.seed + args.cases):
            folder = Path(tempfile.mkdtemp(prefix="eagle3-resume-"))
            case = draw_case(seed)
            for attempt in case.attempts:
                kinds["SIGTERM stops"] += attempt.stop_signal == "SIGTERM" and (
                    attempt.kill_after_requests is not None or attempt.kill_after_s is not None)
                kinds["malformed 200s"] += attempt.fault == "malformed"
                kinds["other checkpoints"] += attempt.checkpoint != case.attempts[0].checkpoint
                kinds["second starts"] += attempt.second_start
            try:
                outcome = run_case(case, folder, model, DEMO_MODEL_NAME, tokenizer, env, verify)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            totals["attempts"] += outcome.attempts
            totals["kill points"] += len(outcome.kill_points)
            totals["refused"] += outcome.refused is not None
            totals["violations"] += len(outcome.violations)
            end = f"refused: {outcome.refused}" if outcome.refused else "clean run complete"
            print(f"case {seed}: {outcome.attempts} attempts, kills at [{'; '.join(outcome.kill_points)}], {end}",
                  flush=True)
            for violation in outcome.violations:
                print(f"  VIOLATION: {violation}", flush=True)
    print(f"{args.cases} cases, {totals['attempts']} attempts, {totals['kill points']} kill points, "
          f"{totals['refused']} refused in one line, {', '.join(f'{n} {kind}' for kind, n in kinds.items())}, "
          f"{totals['violations']} violations "
          f"in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
