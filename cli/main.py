"""The `eagle3-datagen` command: run the pipeline or the demo, verify or export a run, judge a draft on it, probe a
tokenizer, print the configuration reference.

Every failure a user can fix prints as one line naming the fix, with exit status 2 (config) or 1 (run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_LISTED = 20  # missing artifacts listed by `verify` before it summarizes
PROGRESS_S = 5.0  # between `evaluate`'s progress lines
RUNS_A_FLOW = ("run", "demo", "rerun-failed")


def _run(config: Any) -> dict[str, Any]:
    from cli.runner import run_pipeline

    return run_pipeline(config)


def cmd_run(args: argparse.Namespace) -> int:
    from eagle3_datagen.config import load_config

    return _print_summary(_run(load_config(args.config, args.set)))


def cmd_demo(args: argparse.Namespace) -> int:
    from cli.demo import run_demo

    return _print_summary(run_demo(Path(args.output_uri), images=args.images))


def cmd_rerun_failed(args: argparse.Namespace) -> int:
    from eagle3_datagen.storage import RunStore
    from tasks.run.lifecycle import recorded_config
    from tasks.validation import reopen_quarantined
    from tasks.verify import rerun_plan, verify_run

    config = recorded_config(args.run, args.set)
    store = RunStore.at(args.run)
    print(rerun_plan(verify_run(store), args.redo_quarantined), flush=True)
    if args.redo_quarantined:
        reopen_quarantined(store)
    return _print_summary(_run(config))


def cmd_verify(args: argparse.Namespace) -> int:
    import time

    from eagle3_datagen.storage import RunStore
    from tasks.verify import PROGRESS_EVERY_S, progress_line, recorded_execution, verify_run

    store = RunStore.at(args.run)
    if args.deep and recorded_execution(store).task_runner == "ray":
        return _verify_on_ray(args.run)
    started, shown = time.monotonic(), [time.monotonic()]

    def progress(done: int, total: int, bytes_read: int) -> None:  # a line every few seconds, and the last
        if args.deep and (time.monotonic() - shown[0] > PROGRESS_EVERY_S or done == total):
            shown[0] = time.monotonic()
            print(progress_line(done, total, bytes_read, shown[0] - started), flush=True)

    result = verify_run(store, deep=args.deep, progress=progress)
    print(f"rows {result.rows}: {result.rows - result.rejected_rows} gave prompts, {result.rejected_rows} rejected")
    print(f"prompts {result.prompts} = accepted {result.accepted} + rejected {result.rejected} + quarantined "
          f"{result.quarantined} + pending {result.pending}; {result.samples} training samples")
    for missing in result.missing[:MAX_LISTED]:
        print(f"missing: {missing}")
    if len(result.missing) > MAX_LISTED:
        print(f"missing: … and {len(result.missing) - MAX_LISTED} more")
    for problem in result.problems:
        print(f"problem: {problem}")
    print(result.verdict())
    return 0 if result.complete else 1


def _verify_on_ray(run: str) -> int:
    """A deep check of a run recorded on Ray: its shards as Ray tasks, through the verify flow."""
    from cli.local_api import start_local_api, wait_for_local_api

    start_local_api()
    wait_for_local_api()
    from flows.pipeline import verify_for

    verify_for(run)(run, deep=True)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tasks.export import export_run

    summary = export_run(args.run, args.format, args.out, args.split)
    layers = summary["aux_layers"]["input_to_layer"]
    print(f"{summary['num_samples']} {args.split} samples for {args.format} in {summary['out']} (aux layers {layers} "
          f"as inputs to layer i, final state {summary['final_state'].replace('_', ' ')}, {summary['dtype']})")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    import time

    import torch

    from tasks.evaluate.acceptance import table
    from tasks.evaluate.evaluation import evaluate_draft

    shown = [time.monotonic()]

    def progress(done: int, total: int) -> None:
        if time.monotonic() - shown[0] > PROGRESS_S or done == total:
            shown[0] = time.monotonic()
            print(f"judged {done} of {total} held-out samples", flush=True)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    summary = evaluate_draft(args.run, args.draft, args.steps, device, progress)
    print("\n".join(table(summary["rows"])))
    print(f"draft {summary['name']}: expected acceptance length {summary['acceptance_length']:.3f} over "
          f"{summary['samples']} held-out samples; written to {summary['run']}/evaluations/{summary['name']}/")
    return 0


def cmd_probe_tokenizer(args: argparse.Namespace) -> int:
    from eagle3_datagen.profiles import BUILTIN_PROFILES
    from eagle3_datagen.think_tokens import discover_think_tokens, load_tokenizer

    spec = discover_think_tokens(load_tokenizer(args.tokenizer), BUILTIN_PROFILES[args.profile])
    print(json.dumps(spec.as_dict(), indent=2, ensure_ascii=False))
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from eagle3_datagen.config_reference import render

    if args.out:
        Path(args.out).write_text(render(), encoding="utf-8")
    else:
        print(render(), end="")
    return 0


def _print_summary(summary: dict[str, Any]) -> int:
    print(summary["report"])
    for line in summary.get("stages", []):
        print(line)
    print(f"artifacts: {summary['run_uri']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from eagle3_datagen.profiles import BUILTIN_PROFILES

    parser = argparse.ArgumentParser(prog="eagle3-datagen", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the pipeline from a YAML config")
    run.add_argument("--config", required=True, help="path to the run's YAML config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set data.limit=100 (repeatable)")
    run.set_defaults(func=cmd_run)
    demo = commands.add_parser("demo", help="run everything on the embedded tiny model and demo questions")
    demo.add_argument("--output-uri", default="runs", help="where the demo run is written (default ./runs)")
    demo.add_argument("--images", action="store_true",
                      help="the image variant: a tiny vision-language model asked about drawn shapes "
                           "(runs/demo-images)")
    demo.set_defaults(func=cmd_demo)
    rerun = commands.add_parser("rerun-failed", help="run a run again from its manifest: only unfinished shards work")
    rerun.add_argument("run", help="the run folder, e.g. runs/demo or s3://bucket/prefix/run")
    rerun.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of the recorded config (e.g. server.endpoints=[...])")
    rerun.add_argument("--redo-quarantined", action="store_true",
                       help="generate quarantined shards again (once their cause is fixed); old records are kept aside")
    rerun.set_defaults(func=cmd_rerun_failed)
    verify = commands.add_parser("verify", help="check a run's invariant: every row accepted once or rejected")
    verify.add_argument("run", help="the run folder")
    verify.add_argument("--deep", action="store_true",
                        help="read every byte (checksums, ids, every hidden-state part) instead of the structure alone")
    verify.set_defaults(func=cmd_verify)
    export = commands.add_parser("export", help="write a run's hidden states as SpecForge or speculators files")
    export.add_argument("run", help="the run folder")
    export.add_argument("--format", required=True, choices=["specforge", "speculators"])
    export.add_argument("--out", help="where to write (any fsspec URI); default RUN/exports/FORMAT, and "
                        "RUN/exports/FORMAT-holdout for --split holdout")
    export.add_argument("--split", choices=["train", "holdout"], default="train",
                        help="the training samples (default), or the held-out ones `evaluate` judges drafts on")
    export.set_defaults(func=cmd_export)
    evaluate = commands.add_parser("evaluate", help="judge a draft on the run's held-out split: its expected "
                                   "acceptance length by mode, turn, source and tool call")
    evaluate.add_argument("run", help="the run folder")
    evaluate.add_argument("--draft", required=True, help="a speculators EAGLE-3 checkpoint folder")
    evaluate.add_argument("--steps", type=int, help="tokens drafted per step (default: what the draft was trained for)")
    evaluate.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda where there is one")
    evaluate.set_defaults(func=cmd_evaluate)
    probe = commands.add_parser("probe-tokenizer", help="find and prove a tokenizer's think-token ids")
    probe.add_argument("tokenizer", help="tokenizer folder or hub id")
    probe.add_argument("--profile", default="kimi-k2.5", choices=sorted(BUILTIN_PROFILES))
    probe.set_defaults(func=cmd_probe_tokenizer)
    reference = commands.add_parser("config-reference", help="every config key with its type, default and "
                                    "description, as markdown (docs/config-reference.md)")
    reference.add_argument("--out", help="write it to this file instead of printing it")
    reference.set_defaults(func=cmd_config_reference)
    return parser


def _prefect_defaults() -> None:
    """Local mode on a busy 2-core machine: give the temporary API time to start, and keep telemetry off."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def main(argv: Sequence[str] | None = None) -> int:
    _prefect_defaults()
    args = build_parser().parse_args(argv)
    if args.command in RUNS_A_FLOW:
        from cli.local_api import import_uncollected, start_local_api

        start_local_api()  # Prefect's temporary API boots while the rest imports
        import_uncollected("cli.runner", "eagle3_datagen.config", "flows.pipeline")
    from eagle3_datagen.errors import UserError
    from eagle3_datagen.run_log import silence_prefect_console

    try:
        status = args.func(args)
    except UserError as error:
        silence_prefect_console()
        print(f"error: {error.one_line()}", file=sys.stderr)
        return error.exit_status
    except KeyboardInterrupt:
        silence_prefect_console()
        print("cancelled: stopped by Ctrl-C; run again to resume (finished work is kept)", file=sys.stderr)
        return 130
    silence_prefect_console()
    return status


if __name__ == "__main__":
    sys.exit(main())
