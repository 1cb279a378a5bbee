"""Random resume cases: attempts of the `eagle3-datagen run` command killed, faulted and edited in between, then
one clean run, and the property it must leave behind.

A case is drawn from a seed alone. Each attempt runs the real command in its own process against a scripted
server (`sign_settings`: every answer names the temperature and max_tokens it was asked under) and may be
SIGKILLed after some requests or seconds; before an attempt the dataset may gain rows at the top, lose rows, or be
cut into other shard sizes, and the sampling settings or the held-out share may change. An attempt may also be
stopped with SIGTERM instead, meet malformed 200 answers, find its server restarted on another checkpoint, or
have a second start of the same run beside it. After the last, clean attempt, either every prompt of the final
dataset is answered exactly once, under the final settings, in its own shard, in the split the final held-out
share chooses, with `verify` clean and nothing rejected, or the run was refused with one line and lost nothing
already written. Throughout, no answer logged under an attempt's settings is asked again (the server's requests
are counted), and a start refused for its settings or for another writer leaves the manifest byte for byte.

The newer kinds are drawn from a stream of their own (`kinds:SEED`), so a seed's older case stays what it was.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from eagle3_datagen.artifacts import prompt_id_of
from eagle3_datagen.config import DataConfig
from eagle3_datagen.holdout import HoldoutChooser
from eagle3_datagen.modes import DEFAULT_MODE
from eagle3_datagen.testing.processes import as_from_a_terminal
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, questions, signed_settings

QUESTIONS = 60  # the pool the datasets draw their rows from
FAULTS = ("none", "none", "401-burst", "500s", "death")
CHECKPOINTS = ("/models/resume-a", "/models/resume-b")  # what the scripted server serves under the model's name
RUN_NAME = "resume"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Attempt:
    """One run of the command: its dataset, shard size and settings, what the server does, when it is killed."""

    rows: tuple[int, ...]  # indexes into the question pool, in dataset order
    shard_size: int
    temperature: float
    max_tokens: int
    fault: str  # one of FAULTS
    fault_after: int  # requests answered before the fault starts
    kill_after_requests: int | None = None  # SIGKILL once the server has seen this many requests
    kill_after_s: float | None = None  # or this long after the start (the imports, the prompt stage, ...)
    holdout: float = 0.01  # data.holdout: which prompts are held out follows the final share
    stop_signal: str = "SIGKILL"  # SIGTERM: stopped as a user or a UI cancel stops it, which must stop it in seconds
    checkpoint: str = CHECKPOINTS[0]  # the other one: a server restarted on other weights under the same name
    second_start: bool = False  # a second `run` of the same run once the first has sent a request: refused

    @property
    def settings(self) -> str:
        return f"temperature {self.temperature}, max_tokens {self.max_tokens}"


@dataclass(frozen=True)
class Case:
    seed: int
    attempts: tuple[Attempt, ...]  # the last one is clean: no fault, no kill


@dataclass
class Outcome:
    """What a case did and what it broke (nothing, if `violations` is empty)."""

    seed: int
    attempts: int
    kill_points: list[str] = field(default_factory=list)  # where each SIGKILL landed
    refused: str | None = None  # the final run's one-line refusal, if it was refused
    violations: list[str] = field(default_factory=list)


def question(index: int) -> str:
    return f"Resume question {index}: what is {index} plus {index + 1}?"


def draw_case(seed: int, max_attempts: int = 4) -> Case:
    """A case from a seed alone: so a failing case is re-run by its seed."""
    rng = random.Random(seed)
    rows = tuple(rng.sample(range(QUESTIONS // 2), rng.randint(8, 20)))
    fresh = iter(range(QUESTIONS // 2, QUESTIONS))
    shard_size, temperature, max_tokens, holdout = rng.choice((4, 6, 10, 25)), 0.7, 64, 0.01
    attempts = []
    for number in range(rng.randint(2, max_attempts)):
        if number:
            if rng.random() < 0.3:
                rows = tuple(next(fresh) for _ in range(rng.randint(1, 3))) + rows  # rows added at the top
            if rng.random() < 0.3 and len(rows) > 4:
                dropped = set(rng.sample(rows, rng.randint(1, 2)))
                rows = tuple(r for r in rows if r not in dropped)
            if rng.random() < 0.3:
                shard_size = rng.choice((4, 6, 10, 25))
            if rng.random() < 0.08:
                temperature, max_tokens = rng.choice(((0.7, 64), (0.6, 64), (0.7, 48)))
            if rng.random() < 0.2:
                holdout = rng.choice((0.0, 0.01, 0.3))
        attempts.append(Attempt(rows, shard_size, temperature, max_tokens, rng.choice(FAULTS),
                                fault_after=rng.randint(0, len(rows)),
                                kill_after_requests=rng.randint(0, len(rows)) if rng.random() < 0.5 else None,
                                kill_after_s=round(rng.uniform(0.5, 12.0), 2) if rng.random() < 0.4 else None,
                                holdout=holdout))
    attempts[-1] = Attempt(rows, shard_size, temperature, max_tokens, "none", 0, holdout=holdout)
    kinds = random.Random(f"kinds:{seed}")
    for number, attempt in enumerate(attempts[:-1]):
        attempts[number] = replace(
            attempt, fault="malformed" if kinds.random() < 0.15 else attempt.fault,
            stop_signal="SIGTERM" if kinds.random() < 0.25 else "SIGKILL",
            checkpoint=CHECKPOINTS[1] if number and kinds.random() < 0.1 else CHECKPOINTS[0],
            second_start=kinds.random() < 0.15)
    return Case(seed, tuple(attempts))


def _script(attempt: Attempt, model: str, tokenizer: Any) -> Script:
    faults = {"401-burst": ["ok"] * attempt.fault_after + ["http-401"] * 20,
              "500s": ["ok"] * attempt.fault_after + ["http-500"] * 6,
              # fewer than a prompt's tries (max_retries 2): retried as the endpoint's failure, never rejected
              "malformed": ["ok"] * attempt.fault_after + ["broken-choice"] * 2}.get(attempt.fault, [])
    return Script(model=model, tokenizer=tokenizer, latency_s=0.05, faults=faults, sign_settings=True,
                  checkpoint=attempt.checkpoint)


def _config(attempt: Attempt, folder: Path, url: str, model: Path, model_name: str) -> Path:
    dataset = folder / "dataset.jsonl"
    dataset.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": question(r)}]}) + "\n"
                               for r in attempt.rows))
    tree = {
        "run_name": RUN_NAME, "output_uri": str(folder / "runs"),
        "data": {"source": str(dataset), "shard_size": attempt.shard_size, "holdout": attempt.holdout},
        "model": {"name": model_name, "profile": "qwen3", "tokenizer": str(model)},
        "server": {"endpoints": [url], "max_in_flight": 4, "startup_timeout_s": 5, "give_up_after_s": 3,
                   "max_retries": 2},
        "generation": {"temperature": attempt.temperature, "max_tokens": attempt.max_tokens},
        "hidden_states": {"backend": "none"},
        "validation": {"early_abort_after": 4},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@dataclass
class Ran:
    """One attempt as it went: its exit status (None if killed), stderr, where a kill landed, how long a SIGTERM
    took to end it, and the second start's exit status and last line (if one was made)."""

    status: int | None
    stderr: str
    kill_point: str | None = None
    stop_took_s: float | None = None
    second: tuple[int, str] | None = None


STOP_WITHIN_S = 20.0  # a SIGTERM must end the command within this


def _command(config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--config", str(config)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_from_a_terminal)


def _attempt(attempt: Attempt, config: Path, server: ScriptedServer, env: dict[str, str]) -> Ran:
    """Run the command once, stopping it where the attempt says."""
    started = time.monotonic()
    child = _command(config, env)
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(child.stderr or []), daemon=True)
    reader.start()
    if attempt.fault == "death":
        threading.Thread(target=_kill_server_after, args=(server, attempt.fault_after, child), daemon=True).start()
    ran = Ran(None, "")
    second = None
    while child.poll() is None:
        elapsed = time.monotonic() - started
        if attempt.second_start and second is None and server.log.requests >= 1:
            second = _command(config, env)
        by_requests = attempt.kill_after_requests is not None and server.log.requests >= attempt.kill_after_requests
        by_time = attempt.kill_after_s is not None and elapsed >= attempt.kill_after_s
        if by_requests or by_time:
            ran.kill_point = f"{server.log.requests} requests, {elapsed:.1f} s, {attempt.stop_signal}"
            ran.stop_took_s = _stop(child, attempt.stop_signal)
            break
        if elapsed > 300:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            reader.join(timeout=10)
            ran.status, ran.stderr = -1, "".join(stderr) + "\n(attempt did not end in 300 s)"
            return ran
        time.sleep(0.02)
    child.wait()
    reader.join(timeout=30)
    ran.status, ran.stderr = (None if ran.kill_point else child.returncode), "".join(stderr)
    if second is not None:
        _, second_err = second.communicate(timeout=300)
        ran.second = (second.returncode, (second_err.strip().splitlines() or [""])[-1])
    return ran


def _stop(child: subprocess.Popen[str], how: str) -> float:
    """Stop the command with `how`; the seconds it took to end (a SIGTERM not obeyed in STOP_WITHIN_S is followed
    by a SIGKILL, and the time says so)."""
    sent = time.monotonic()
    os.killpg(child.pid, getattr(signal, how))
    try:
        child.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    return time.monotonic() - sent


def _kill_server_after(server: ScriptedServer, requests: int, child: subprocess.Popen[str]) -> None:
    while server.log.requests < requests and child.poll() is None:
        time.sleep(0.02)
    server.__exit__(None, None, None)


def _one_line_failure(stderr: str) -> str | None:
    """Why a failed attempt's output is not one clean line of cause, or None if it is."""
    lines = stderr.strip().splitlines()
    if "Traceback" in stderr:
        return "a traceback reached the console"
    if not lines or not (lines[-1].startswith("error: ") or lines[-1].startswith("cancelled: ")):
        return f"the output does not end with one line of cause: {lines[-1:]}"
    return None


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} \
        if folder.is_dir() else {}


DEPTHS_DISAGREE = -1  # what `verify_at_both_depths` returns when the structure and the bytes disagree


def verify_at_both_depths(command: Callable[[list[str]], int]) -> Callable[[Path], int]:
    """`verify RUN` and `verify --deep RUN` through `command` (the CLI's main), quietly: the deep check's exit
    status, or DEPTHS_DISAGREE when the structural check alone said otherwise."""

    def verify(run: Path) -> int:
        with contextlib.redirect_stdout(io.StringIO()):
            structure, deep = (command(["verify", *depth, str(run)]) for depth in ([], ["--deep"]))
        return deep if structure == deep else DEPTHS_DISAGREE

    return verify


def _final_violations(attempt: Attempt, run: Path, verified: int) -> list[str]:
    """What the final, completed run broke of the property."""
    violations = []
    manifest = json.loads((run / "manifest.json").read_text())
    if manifest["status"] != "completed":
        violations.append(f"final status {manifest['status']}: {manifest.get('cause')}")
    if verified == DEPTHS_DISAGREE:
        violations.append("verify and verify --deep disagree")
    elif verified != 0:
        violations.append(f"verify --deep exited {verified}")
    shard_of = {}
    for path in sorted((run / "prompts").glob("shard-*.jsonl")):
        for line in path.read_text().splitlines():
            shard_of[json.loads(line)["id"]] = path.name
    wanted = {question(r) for r in attempt.rows}
    asked = {json.loads(line)["messages"][-1]["content"] for f in (run / "prompts").glob("shard-*.jsonl")
             for line in f.read_text().splitlines()}
    if asked != wanted:
        violations.append(f"the prompt shards hold {len(asked)} questions, the dataset {len(wanted)}")
    answered: dict[str, int] = {}
    for path in sorted((run / "generations").glob("shard-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            text = record["messages"][-1]["content"]
            answered[text] = answered.get(text, 0) + 1
            if shard_of.get(prompt_id_of(record["id"])) != path.name:
                violations.append(f"{record['id']} is in {path.name}, its prompt in "
                                  f"{shard_of.get(prompt_id_of(record['id']))}")
            if record["content"] is None or text[:40] not in record["content"]:
                violations.append(f"{record['id']}: the answer is to another question")
            elif signed_settings(record["content"]) != attempt.settings:
                violations.append(f"{record['id']}: answered under {signed_settings(record['content'])}, "
                                  f"not the final {attempt.settings}")
    if missing := wanted - set(answered):
        violations.append(f"{len(missing)} prompts never answered, e.g. {sorted(missing)[0]!r}")
    if twice := [t for t, n in answered.items() if n > 1]:
        violations.append(f"{len(twice)} prompts answered more than once, e.g. {twice[0]!r}")
    if extra := set(answered) - wanted:
        violations.append(f"{len(extra)} answers to prompts no longer in the dataset")
    if stale := _stale_splits(attempt, run, shard_of):
        violations.append(f"{len(stale)} samples kept another split than the final data.holdout's, e.g. {stale[0]}")
    rejected = [line for f in (run / "rejected").glob("*.jsonl") for line in f.read_text().splitlines()]
    if rejected:
        violations.append(f"{len(rejected)} rejected entries, e.g. {rejected[0][:200]}")
    return violations


def _stale_splits(attempt: Attempt, run: Path, shard_of: dict[str, str]) -> list[str]:
    """Samples whose held-out split is not the one the final dataset and data.holdout choose."""
    chooser = HoldoutChooser(attempt.holdout, DataConfig.model_fields["holdout_min_per_mode"].default)
    for prompt in shard_of:
        chooser.add(prompt, DEFAULT_MODE)
    split = chooser.split()
    rows = [row for path in sorted((run / "sequences").glob("shard-*.parquet"))
            for row in pq.read_table(path, columns=["id", "split"]).to_pylist()]
    return [row["id"] for row in rows if row["split"] != split.split_of(prompt_id_of(row["id"]), DEFAULT_MODE)]


def _logged_answers(run: Path, settings: str) -> set[str]:
    """The questions whose answers the run holds under `settings`: in finished shards, or in partial logs and not
    voided by a later `discard` (an aborted window's answers, asked again on purpose)."""
    logged: dict[str, str] = {}  # prompt id -> its question
    for path in sorted((run / "generations").glob("shard-*.jsonl")):
        partial = path.name.endswith(".partial.jsonl")
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if partial and "discard" in entry:
                logged.pop(prompt_id_of(entry["id"]), None)
            for record in entry.get("records", []) if partial else [entry]:
                if signed_settings(record.get("content") or "") == settings:
                    logged[prompt_id_of(record["id"])] = record["messages"][-1]["content"]
    return set(logged.values())


def _manifest(run: Path) -> bytes | None:
    path = run / "manifest.json"
    return path.read_bytes() if path.exists() else None


def run_case(case: Case, folder: Path, model: Path, model_name: str, tokenizer: Any, env: dict[str, str],
             verify: Any) -> Outcome:
    """Play a case in `folder`; `verify(run_folder) -> exit status` is the `verify` command."""
    outcome = Outcome(case.seed, len(case.attempts))
    run = folder / "runs" / RUN_NAME
    for number, attempt in enumerate(case.attempts):
        final = number == len(case.attempts) - 1
        served = run / "generations" / "served.json"
        if final and served.exists():  # the clean run is served what the run's answers came from
            attempt = replace(attempt, checkpoint=json.loads(served.read_text())["checkpoint"])
        before, manifest = _files(run / "generations"), _manifest(run)
        logged = _logged_answers(run, attempt.settings) & {question(r) for r in attempt.rows}
        server = ScriptedServer(_script(attempt, model_name, tokenizer)).__enter__()
        try:
            ran = _attempt(attempt, _config(attempt, folder, server.url, model, model_name), server, env)
        finally:
            server.__exit__(None, None, None)
        label = f"attempt {number + 1} ({attempt.fault}, {attempt.stop_signal}, {attempt.checkpoint})"
        outcome.violations += _attempt_violations(label, ran, logged, questions(server.log.bodies or []), manifest, run)
        if ran.kill_point:
            outcome.kill_points.append(ran.kill_point)
            continue
        if ran.status != 0 and (why := _one_line_failure(ran.stderr)):
            outcome.violations.append(f"{label}: {why}: {ran.stderr[-1500:]}")
        if not final:
            continue
        if ran.status == 0:
            outcome.violations += _final_violations(attempt, run, verify(run))
        elif "was generated with other settings" in ran.stderr:
            outcome.refused = ran.stderr.strip().splitlines()[-1]
            if _files(run / "generations") != before:
                outcome.violations.append("the refused run changed what was already written")
            outcome.violations += _restored(attempt, folder, model, model_name, tokenizer, env, verify)
        else:
            outcome.violations.append(f"the clean final run failed: {ran.stderr.strip().splitlines()[-1:]}")
    return outcome


def _attempt_violations(label: str, ran: Ran, logged: set[str], asked: list[str], manifest: bytes | None,
                        run: Path) -> list[str]:
    """What one attempt broke: an answer paid for asked again, a SIGTERM not obeyed, a second writer let in, a
    refused start that touched the manifest."""
    violations = []
    if again := sorted(logged & set(asked)):
        violations.append(f"{label}: {len(again)} answers logged under its settings asked again, e.g. {again[0]!r}")
    if ran.stop_took_s is not None and ran.kill_point and ran.kill_point.endswith("SIGTERM"):
        if ran.stop_took_s >= STOP_WITHIN_S:
            violations.append(f"{label}: SIGTERM did not end the command in {STOP_WITHIN_S:.0f} s")
        elif _manifest(run) != manifest and json.loads(_manifest(run) or b"{}").get("status") != "cancelled":
            violations.append(f"{label}: stopped by SIGTERM, the manifest does not say cancelled")
    if ran.second is not None and ran.second[0] != 0 and "is being written by" not in ran.second[1]:
        violations.append(f"{label}: the second start failed otherwise than refused: {ran.second[1]}")
    refused = ran.status == 1 and ("was generated with other settings" in ran.stderr
                                   or "is being written by" in ran.stderr)
    if refused and _manifest(run) != manifest:
        violations.append(f"{label}: refused, yet it changed the manifest")
    return violations


def _restored(attempt: Attempt, folder: Path, model: Path, model_name: str, tokenizer: Any, env: dict[str, str],
              verify: Any) -> list[str]:
    """The refusal's fix followed: one more clean run under the settings recorded in the run, which must complete."""
    run = folder / "runs" / RUN_NAME
    pinned = json.loads((run / "generations" / "settings.json").read_text())["generation"]
    restored = replace(attempt, temperature=pinned["temperature"], max_tokens=pinned["max_tokens"])
    with ScriptedServer(_script(restored, model_name, tokenizer)) as server:
        ran = _attempt(restored, _config(restored, folder, server.url, model, model_name), server, env)
    if ran.status != 0:
        return [f"the run under its recorded settings failed: {ran.stderr.strip().splitlines()[-1:]}"]
    return _final_violations(restored, run, verify(run))
