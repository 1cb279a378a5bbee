"""What generation writes: the settings a run is pinned to, per-shard partial logs, and finished shards.

A record is appended to its shard's partial log the moment it completes, so a killed run resumes without asking
a finished prompt again; a finished shard is written atomically, in prompt order, and its log removed.

Nothing kept can be attached to another prompt or other settings: the settings are pinned, with a fresh run id,
before the first answer is kept; every log entry carries its prompt's id, and every log (each attempt's part of
it, each segment) starts with a header naming the run id and the prompt shard's sha256. A resume places entries
by their logged position only under the current prompt shard's sha256, else by prompt id, and drops what belongs
to no prompt of the shard or to another run of the same name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any, TypeVar

import orjson

from eagle3_datagen.artifacts import (
    GenerationRecord,
    ShardRef,
    artifact_path,
    holds_answers,
    prompt_id_of,
    rejected_path,
    sample_id,
    sha256_hex,
    shard_index_of,
)
from eagle3_datagen.caching import StageOutput
from eagle3_datagen.config import GenerationConfig
from eagle3_datagen.conversations import Ended, answer_of, next_turn, turn_id, user_turns
from eagle3_datagen.errors import Log, UserError
from eagle3_datagen.modes import assign_mode
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion
from eagle3_datagen.storage import RunLocation, RunStore

SETTINGS_FILE = "generations/settings.json"
# A finished shard's marker records the key of the prompt shard it answers (its settings are pinned apart, in
# SETTINGS_FILE). Bump `version` when the records written for the same answers change.
GENERATIONS = StageOutput("generations", version=1, record=lambda prompts: artifact_path("generations",
                                                                                         prompts.index),
                          marked=True)
SEGMENT_RECORDS = 1000  # a partial-log segment in object storage holds at most this many entries...
SEGMENT_EVERY_S = 10.0  # ...or what came in this many seconds


class GenerationError(UserError):
    """Generation could not finish; finished records are kept and a re-run resumes from them."""


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that changes a generated record. A resume under different settings is refused."""

    model: str
    profile: ModelProfile
    generation: GenerationConfig
    prompt_source: str

    def fingerprint(self) -> str:
        payload = {
            "model": self.model,
            "profile": self.profile.model_dump(exclude={"image_token"}),  # read by sequences, never sent
            "generation": self.generation.model_dump(),
            "prompt_source": self.prompt_source,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def mode_of(self, prompt_id: str) -> str | None:
        """The mode a prompt is asked in; None without `generation.modes` (the default mode, not recorded, so
        records of a run without a mix carry no mode)."""
        if self.generation.modes is None:
            return None
        return assign_mode(prompt_id, self.generation.mode_mix(self.profile))


def refuse_other_settings(settings: GenerationSettings, run: RunLocation) -> None:
    """The one-line refusal of a run pinned to other settings. The flow asks before the prompt stage, which may
    re-cut the shards: a refused run changes nothing written."""
    _pinned_unless_other(run.store(), settings)


def _pinned_unless_other(store: RunStore, settings: GenerationSettings) -> dict[str, Any] | None:
    """The settings the run is pinned to (None: not yet), unless they are other ones (refused in one line)."""
    pinned = store.read_json(SETTINGS_FILE) if store.exists(SETTINGS_FILE) else None
    if pinned is not None and pinned["fingerprint"] != _as_pinned(settings, pinned).fingerprint():
        raise GenerationError(
            f"run {store.uri} was generated with other settings (model, sampling, modes, profile or prompt "
            f"source differ): use a new run_name, or restore the settings recorded in {SETTINGS_FILE}"
        )
    return pinned


def _as_pinned(settings: GenerationSettings, pinned: dict[str, Any]) -> GenerationSettings:
    """`settings` with the prompt source as the pin wrote it, where that names the same file: runs pinned before
    local sources were recorded absolute wrote the path relative to where they started."""
    written = str(pinned.get("prompt_source", ""))
    if written and not Path(written).is_absolute() and str(Path(written).resolve()) == settings.prompt_source:
        return replace(settings, prompt_source=written)
    return settings


def pin_settings(store: RunStore, settings: GenerationSettings) -> tuple[str, bool]:
    """The run id a run's generations are pinned to, and whether this call pinned them (a fresh run).

    Called before any request, so no answer is ever kept under settings other than the recorded ones; a run
    pinned to other settings is refused; one pinned without a run id gets one now.
    """
    pinned = _pinned_unless_other(store, settings)
    if pinned is not None and "run_id" in pinned:
        return pinned["run_id"], False
    fresh = pinned is None
    if pinned is None:
        payload = json.loads(json.dumps(asdict(settings), default=lambda o: o.model_dump()))
        pinned = {"fingerprint": settings.fingerprint(), **payload}
    run_id = uuid.uuid4().hex
    store.write_json(SETTINGS_FILE, {**pinned, "run_id": run_id})
    return run_id, fresh


@dataclass(frozen=True)
class Rollout:
    """Where a rollout's prompt stands in its conversation: the script (system and user messages, recorded tool
    results) and the target's own answers so far (`content`, `reasoning`, `tool_calls`)."""

    conversation: str
    script: list[dict[str, Any]]
    outputs: tuple[dict[str, Any], ...]

    @property
    def turn(self) -> int:
        """This generation's index in its conversation (a tool call and the answer after it are two)."""
        return len(self.outputs)

    @property
    def user_turn(self) -> int:
        return sum(not output.get("tool_calls") for output in self.outputs)

    @property
    def user_turns_left(self) -> int:
        """User turns after this one's."""
        return user_turns(self.script) - self.user_turn - 1

    def after(self, done: Completion) -> list[dict[str, Any]] | Ended:
        """The next generation's prompt once `done` answers this one, or why the conversation ends."""
        return next_turn(self.script, [*self.outputs, answer_of(vars(done))])


@dataclass
class Prompt:
    """One prompt to generate, with where its records go."""

    shard: int
    position: int
    record_id: str
    messages: list[dict[str, Any]]
    seed: int | None
    mode: str | None = None  # None: the profile's default mode, in a run without generation.modes
    rollout: Rollout | None = None  # a turn of a conversation asked on the target's own answers
    tools: list[dict[str, Any]] | None = None  # functions the model may call

    def followed_by(self, done: Completion, messages: list[dict[str, Any]]) -> Prompt:
        """The conversation's next generation, asked on `messages` once `done` answered this one."""
        assert self.rollout is not None
        rollout = Rollout(self.rollout.conversation, self.rollout.script,
                          (*self.rollout.outputs, answer_of(vars(done))))
        return Prompt(self.shard, self.position, turn_id(rollout.conversation, rollout.turn), messages, self.seed,
                      self.mode, rollout, self.tools)

    def turn_fields(self) -> dict[str, int]:
        """What a log entry of a rollout's turn carries besides its outcome."""
        return {} if self.rollout is None else {"turn": self.rollout.turn}


def rollout_prompt(shard: int, position: int, prompt: dict[str, Any], outputs: tuple[dict[str, Any], ...],
                   seed: int | None, mode: str | None) -> Prompt:
    """The next generation of a conversation (a prompt shard's row) after the answers it has."""
    rollout = Rollout(prompt["id"], prompt["messages"], outputs)
    messages = next_turn(rollout.script, list(outputs))
    assert not isinstance(messages, Ended), f"{prompt['id']} ended, yet is asked again"
    return Prompt(shard, position, turn_id(rollout.conversation, rollout.turn), messages, seed, mode, rollout,
                  prompt.get("tools"))


def new_records(prompt: Prompt, completions: list[Completion],
                ended: str | None = None) -> list[GenerationRecord]:
    """The records of one answered prompt; with `n` samples per prompt, each sample's id gets its own suffix. A
    rollout's turn records its place (`turn`, `user_turn`) and, on the last, how the conversation `ended`."""
    rollout = prompt.rollout
    return [
        {
            "id": sample_id(prompt.record_id, k, len(completions)),
            "messages": prompt.messages,
            "reasoning": done.reasoning,
            "content": done.content,
            "finish_reason": done.finish_reason,
            "reasoning_source": done.reasoning_source,
            "prompt_token_ids": done.prompt_token_ids,
            "completion_token_ids": done.completion_token_ids,
            "usage": done.usage,
            **({"mode": prompt.mode} if prompt.mode else {}),
            **({"tools": prompt.tools} if prompt.tools else {}),
            **({"tool_calls": done.tool_calls} if done.tool_calls else {}),
            **({"turn": rollout.turn, "user_turn": rollout.user_turn} if rollout else {}),
            **({"ended": ended} if ended else {}),
        }
        for k, done in enumerate(completions)
    ]


def spool_folder(store: RunStore) -> Path:
    """Where a run in object storage keeps its local partial logs: one folder per run folder, holding one folder
    per run id (a run deleted and started again under its name is another run)."""
    spool = Path(os.environ.get("EAGLE3_SPOOL_DIR", Path.home() / ".cache" / "eagle3-datagen" / "partials"))
    return spool / hashlib.sha256(store.uri.encode()).hexdigest()[:16]


def partial_log_path(store: RunStore, index: int, run_id: str) -> Path:
    """Where a shard's partial log lives: beside the shard on local disk, else in the run id's spool folder."""
    rel = artifact_path("generations", index).replace(".jsonl", ".partial.jsonl")
    local = store.local_path(rel)
    return Path(local) if local is not None else spool_folder(store) / run_id / rel


def drop_other_spools(store: RunStore, run_id: str) -> list[Path]:
    """Remove the local spools of other runs that had this run folder's name; returns them."""
    folder = spool_folder(store)
    others = [spool for spool in folder.iterdir() if spool.name != run_id] if folder.is_dir() else []
    for spool in others:
        shutil.rmtree(spool)
    return others


def segment_folder(index: int) -> str:
    """Where a shard's partial log is copied in segments when the run lives in object storage."""
    return artifact_path("generations", index).replace(".jsonl", ".partial")


def log_header(run_id: str, prompts: ShardRef) -> str:
    """The line each attempt's part of a partial log, and each segment, starts with: the run its entries belong
    to, and the prompt shard their positions refer to."""
    return json.dumps({"run_id": run_id, "prompts_sha256": prompts.sha256})


def kept_form(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as a shard in flight keeps it: its records as their JSON lines, the shard file's own bytes.

    Why: token ids as Python ints take several times their text, and a shard in flight holds long reasoning.
    """
    if "records" not in entry:
        return entry
    return {**{key: value for key, value in entry.items() if key != "records"},
            "lines": [orjson.dumps(r).decode() for r in entry["records"]]}


def log_line(entry: dict[str, Any]) -> str:
    """The partial-log line of an entry in its kept form (records serialized once, not twice)."""
    if "lines" not in entry:
        return json.dumps(entry, ensure_ascii=False)
    head = json.dumps({key: value for key, value in entry.items() if key != "lines"}, ensure_ascii=False)
    return f'{head[:-1]}, "records": [{", ".join(entry["lines"])}]}}'


K = TypeVar("K")  # where an entry is placed: a position in a shard, or a prompt id in the run's answer pool


def place(entries: dict[K, dict[str, Any]], turns: dict[K, list[str]], at: K, entry: dict[str, Any]) -> bool:
    """Apply one log entry (kept form) at position `at`: a prompt's outcome goes to `entries`; a rollout's turn
    (`turn` k) adds its records to the conversation's `turns` while it goes on, and the conversation moves to
    `entries` with every turn's records once it ends (`ended`, or a rejection). A `discard` voids the prompt, or
    a rollout's turns from k on. False for a turn past the one the conversation asks next (not applied).

    Idempotent: a run in object storage replays each entry twice, from its local log and from its segments. A
    prompt's outcome placed again is the same; a turn the conversation already holds, or a turn of a conversation
    that ended, changes nothing. A rollout asks one sample (`generation.n` is 1), so it holds one line per turn.
    """
    if "turn" not in entry:
        if "discard" in entry:
            entries.pop(at, None)
        else:
            entries[at] = entry
        return True
    turn = entry["turn"]
    if "discard" not in entry and (at in entries or turn < len(turns.get(at, ()))):
        return True
    kept = turns.pop(at, None)
    if kept is None:
        kept = entries.pop(at, {}).get("lines", [])
    if "discard" in entry:
        if kept[:turn]:
            turns[at] = kept[:turn]
        return True
    if turn != len(kept):
        turns[at] = kept
        return False
    kept = kept + entry.get("lines", [])
    if "ended" in entry or "rejected" in entry:
        outcome = {key: value for key, value in entry.items() if key not in ("turn", "lines", "ended")}
        entries[at] = {**outcome, "lines": kept}
    else:
        turns[at] = kept
    return True


def read_log_lines(path: Path) -> list[str]:
    """A local partial log's lines. A torn last line (killed mid-write) is cut from the file, so the next entry
    appended starts a line of its own instead of joining it (and being lost with it)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        with path.open("r+b") as log:
            log.truncate(whole)
    return data[:whole].decode("utf-8").splitlines()


@dataclass
class Replay:
    """Places a shard's partial-log entries at their prompt's current position.

    Under a header naming the current prompt shard, an entry goes where it was logged; under another (a dataset
    that gained or lost rows, another `data.limit`, `shard_size`, `split` or `turns`), where its prompt id is now,
    and nowhere if its prompt left the shard (it is asked again where it is now). A `discard` voids its prompt's
    entry (an aborted early-abort window's answers, asked again once the cause is fixed).
    """

    prompts: ShardRef
    run_id: str
    positions: Callable[[], dict[str, int]]  # prompt id to position, read only if the prompt shard changed
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    turns: dict[int, list[str]] = field(default_factory=dict)  # records of rollouts still going on, per position
    dropped: set[str] = field(default_factory=set)  # ids of the answers whose prompt is no longer in the shard
    recut: bool = False  # a log was written against other prompts: answers may have moved between shards

    def apply(self, lines: list[str], source: str) -> bool:
        """Apply a log's lines in order; False, with nothing applied, when the log is another run's."""
        if not lines:
            return True
        header = json.loads(lines[0])
        if "run_id" not in header:
            raise GenerationError(
                f"{source} was written by an older eagle3-datagen, without prompt ids: finish the run with that "
                "version, or delete it (its prompts are asked again)"
            )
        if header["run_id"] != self.run_id:
            return False
        same_prompts = True
        for line in lines:
            entry = json.loads(line)
            if "run_id" in entry:
                same_prompts = entry["prompts_sha256"] == self.prompts.sha256
                self.recut |= not same_prompts
                continue
            at = entry["position"] if same_prompts else self.positions().get(prompt_id_of(entry["id"]))
            if at is None:
                if "discard" not in entry:
                    self.dropped.add(entry["id"])
            else:
                place(self.entries, self.turns, at, {**kept_form(entry), "position": at})
        return True


@dataclass
class ShardState:
    """An unfinished shard: its entries so far (records or a rejection per position) and its partial log.

    The log is appended on local disk as each entry comes. When the run lives in object storage, entries are
    also `spill`ed there in segments (every SEGMENT_RECORDS entries or SEGMENT_EVERY_S seconds), so a lost
    machine loses at most one segment and a re-run anywhere resumes from the rest.
    """

    ref: ShardRef
    log_path: Path
    header: str  # `log_header`: the first line of this attempt's part of the log, and of each segment
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    turns: dict[int, list[str]] = field(default_factory=dict)  # records of rollouts still going on, per position
    log: IO[str] | None = None
    spill: Callable[[str, list[str]], None] | None = None
    fence: Callable[[], None] | None = None  # refuses an append once another writer holds the run (a local log)
    positions: Callable[[], dict[str, int]] = dict  # prompt id to position in this shard (read once, if asked)
    recut: bool = False  # its sources were written for other prompts: some of its answers may be in other shards
    segments: int = 0
    pending: list[str] = field(default_factory=list)
    spilled_at: float = field(default_factory=time.monotonic)

    def append(self, prompt: Prompt, **outcome: Any) -> None:
        """Log how `prompt` ended: `records`, `rejected` or `discard` (and a rollout's `turn`, `ended`); the entry
        carries the prompt's own id and position, so it can never be placed at another prompt's."""
        entry = kept_form({"id": prompt.record_id, "position": prompt.position, **prompt.turn_fields(), **outcome})
        self._log(entry)
        placed = place(self.entries, self.turns, prompt.position, entry)
        assert placed, f"turn {entry.get('turn')} of {prompt.record_id} does not follow its conversation's last"

    def adopt(self, prompt_id: str, at: int, outcome: dict[str, Any] | None, turns: list[str]) -> None:
        """Keep here, logged as if asked here, what the prompt at `at` got in another shard of an earlier layout:
        its `outcome` (an answer, a rejection, a whole conversation), or a rollout's `turns` so far."""
        if outcome is not None:
            entry = {**{key: value for key, value in outcome.items() if key != "position"}, "id": prompt_id,
                     "position": at}
            self._log(entry)
            place(self.entries, self.turns, at, entry)
            return
        for turn, line in enumerate(turns):
            entry = {"id": turn_id(prompt_id, turn), "position": at, "turn": turn, "lines": [line]}
            self._log(entry)
            place(self.entries, self.turns, at, entry)

    def _log(self, entry: dict[str, Any]) -> None:
        if self.fence is not None:
            self.fence()
        if self.log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log = self.log_path.open("a", encoding="utf-8")
            self.log.write(self.header + "\n")
        line = log_line(entry)
        self.log.write(line + "\n")
        self.log.flush()
        if self.spill is not None:
            self.pending.append(line)
            if len(self.pending) >= SEGMENT_RECORDS or time.monotonic() - self.spilled_at >= SEGMENT_EVERY_S:
                self.spill_segment()

    def spill_segment(self) -> None:
        if self.spill is not None and self.pending:
            self.spill(f"{segment_folder(self.ref.index)}/segment-{self.segments:05d}.jsonl",
                       [self.header, *self.pending])
            self.segments += 1
        self.pending, self.spilled_at = [], time.monotonic()

    def close(self) -> None:
        """Keep what is pending (a run stopped short resumes from it) and close the local log."""
        try:
            self.spill_segment()
        finally:
            if self.log is not None:
                self.log.close()
                self.log = None

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.ref.num_records


def resume_shard(store: RunStore, prompts: ShardRef, run_id: str, spill: Callable[[str, list[str]], None] | None,
                 log: Log) -> ShardState:
    """An unfinished shard's state: what its finished file (written for an older prompt shard), its segments in
    run storage and its local log hold for the current prompts. Logs and segments of another run of this name
    are removed."""
    replay = Replay(prompts, run_id, functools.cache(lambda: prompt_positions(store, prompts)))
    previous = finished_shard(store, prompts.index, replay.positions)
    if previous is not None:
        replay.entries = previous[1]
        marker = store.read_marker(artifact_path("generations", prompts.index))
        replay.recut = marker is None or marker.get("prompts_sha256") != prompts.sha256
    local = store.local_path(segment_folder(prompts.index)) is not None  # the log is in the run folder
    state = ShardState(prompts, partial_log_path(store, prompts.index, run_id), log_header(run_id, prompts),
                       spill=spill, fence=store.check_fence if local else None, positions=replay.positions)
    stale: list[str] = []
    for rel in store.list(segment_folder(prompts.index), ".jsonl") if spill is not None else []:
        if replay.apply(store.read_text(rel).splitlines(), rel):
            state.segments = int(rel.rsplit("-", 1)[1].removesuffix(".jsonl")) + 1
        else:
            store.remove(rel)
            stale.append(rel)
    if not replay.apply(read_log_lines(state.log_path), str(state.log_path)):
        state.log_path.unlink()
        stale.append(str(state.log_path))
    if stale:
        log.warning("removed %s: partial logs of another run that had this run's name", ", ".join(stale))
    if replay.dropped:
        log.warning("shard %05d: %d logged answers are of prompts no longer in this shard (the prompts changed "
                    "since they were logged): each is kept in the shard that holds its prompt now, if any",
                    prompts.index, len(replay.dropped))
    state.entries, state.turns, state.recut = replay.entries, replay.turns, replay.recut
    return state


def answer_pool(store: RunStore, run_id: str, wanted: set[str]) -> tuple[dict[str, dict[str, Any]],
                                                                         dict[str, list[str]]]:
    """What the run holds for the prompts `wanted`, wherever a shard of any layout wrote or logged it: finished
    shards, their rejections, and this run's partial logs and segments. Outcomes and rollouts still going on, by
    prompt id; only the wanted ones are kept in memory."""
    entries: dict[str, dict[str, Any]] = {}
    turns: dict[str, list[str]] = {}
    indexes = sorted({index for name in store.list("generations") if (index := shard_index_of(
        posixpath.basename(name))) is not None} | set(_spooled_indexes(store, run_id)))
    for index in indexes:
        finished = artifact_path("generations", index)
        for line in store.read_text(finished).splitlines() if store.exists(finished) else []:
            if (pid := prompt_id_of(json.loads(line)["id"])) in wanted:
                entries.setdefault(pid, {"lines": []})["lines"].append(line)
        rejected = rejected_path("generations", index)
        for row in store.read_jsonl(rejected) if store.exists(rejected) else []:
            if (pid := prompt_id_of(row["id"])) in wanted:
                entries.setdefault(pid, {})["rejected"] = row
        logs = [store.read_text(rel).splitlines() for rel in store.list(segment_folder(index), ".jsonl")]
        logs.append(read_log_lines(partial_log_path(store, index, run_id)))
        for lines in logs:
            if not lines or json.loads(lines[0]).get("run_id") != run_id:
                continue
            for entry in map(json.loads, lines[1:]):
                if "run_id" not in entry and (pid := prompt_id_of(entry["id"])) in wanted:
                    place(entries, turns, pid, kept_form(entry))
    return entries, turns


def _spooled_indexes(store: RunStore, run_id: str) -> list[int]:
    """The shards with a local partial log of this run in the spool (a run in object storage)."""
    if store.local_path("generations") is not None:
        return []
    folder = spool_folder(store) / run_id / "generations"
    return [index for log in folder.glob("*.partial.jsonl") if (index := shard_index_of(log.name)) is not None]


def answers_beyond(store: RunStore, count: int) -> list[str]:
    """What shards the layout no longer has left of their answers in the run: finished files, markers, rejections,
    segments (and, on local disk, partial logs)."""
    return [rel for rel in store.shard_files_outside(set(range(count))) if holds_answers(rel)]


def retire_generations_beyond(store: RunStore, count: int, run_id: str | None) -> list[str]:
    """Remove the answers of shards the layout no longer has, once generation has adopted what it needs of them
    (their spooled partial logs too)."""
    retired = answers_beyond(store, count)
    for rel in retired:
        store.remove(rel)
    for index in _spooled_indexes(store, run_id) if run_id is not None else []:
        if index >= count:
            partial_log_path(store, index, run_id).unlink(missing_ok=True)
    return retired


def prompt_positions(store: RunStore, prompts: ShardRef) -> dict[str, int]:
    """Each prompt id of a prompt shard, and its position there."""
    return {prompt["id"]: at for at, prompt in enumerate(store.read_shard_records(prompts))}


def finalize_shard(store: RunStore, state: ShardState) -> ShardRef:
    """Write the finished shard atomically (records in prompt order), its rejections, then drop the log."""
    ordered = [state.entries[p] for p in sorted(state.entries)]
    lines = [line for e in ordered for line in e.get("lines", [])]
    rejected = [e["rejected"] for e in ordered if "rejected" in e]
    rejected_rel = rejected_path("generations", state.ref.index)
    rejected_bytes = store.write_jsonl(rejected_rel, rejected) if rejected else 0
    if not rejected:
        store.remove(rejected_rel)  # an earlier attempt's, of prompts no longer in the shard
    data = "".join(line + "\n" for line in lines).encode()
    answered = sum(bool(e.get("lines")) for e in ordered)
    # what a structural `verify` reads instead of the shard: a rollout whose later turn was refused keeps the turns
    # before it, so its prompt counts as answered, not refused
    account = {"prompts_answered": answered, "prompts_refused": len(ordered) - answered,
               "rejected_bytes": rejected_bytes}
    ref = store.write_shard_bytes("generations", state.ref.index, data, len(lines),
                                  stage_key=GENERATIONS.key(prompts=state.ref), prompts_sha256=state.ref.sha256,
                                  **account)
    state.pending = []  # the shard is written: nothing of it needs keeping any more
    state.close()
    state.log_path.unlink(missing_ok=True)
    store.remove(segment_folder(state.ref.index))
    return ref


def finished_shard(
    store: RunStore, index: int, positions: Callable[[], dict[str, int]]
) -> tuple[ShardRef, dict[int, dict[str, Any]]] | None:
    """A finished shard's ref, and its records and rejections keyed by their prompt's current position
    (`positions`: prompt id to position, asked only if the shard exists); records of prompts no longer in the
    shard are left out.

    None if the shard was never finished. Fewer entries than prompts means the prompt shard grew (a dataset
    that gained rows, say): only the new prompts are generated, the finished records are kept.
    """
    path = artifact_path("generations", index)
    if not store.exists(path):
        return None
    data = store.read_bytes(path)
    position = positions()
    entries: dict[int, dict[str, Any]] = {}
    for line in data.decode("utf-8").splitlines():
        at = position.get(prompt_id_of(json.loads(line)["id"]))
        if at is not None:
            entries.setdefault(at, {"position": at, "lines": []})["lines"].append(line)
    rejected = rejected_path("generations", index)
    for row in store.read_jsonl(rejected) if store.exists(rejected) else []:
        at = position.get(prompt_id_of(row["id"]))
        if at is not None:  # a rollout's rejected turn ends its conversation: the turns before it stay
            entries.setdefault(at, {"position": at})["rejected"] = row
    return ShardRef("generations", index, path, data.count(b"\n"), sha256_hex(data)), entries


def marked_finished(store: RunStore, prompts: ShardRef) -> ShardRef | None:
    """The generations of a prompt shard, if their completion marker says they answer exactly these prompts:
    a re-run of a finished run reads no shard, only markers."""
    marker = GENERATIONS.done(store, prompts, GENERATIONS.key(prompts=prompts))
    return None if marker is None else ShardRef.of_marker(marker)


def unmarked_shards(prompt_shards: list[ShardRef], run: RunLocation) -> list[ShardRef]:
    """Prompt shards whose generations no completion marker vouches for: unfinished, or dropped by a stage that
    found them changed. Generation must look at storage for these, not at its cache."""
    store = run.store()
    return [ref for ref in prompt_shards if marked_finished(store, ref) is None]


def unfinished_shards(unmarked: list[ShardRef], run: RunLocation) -> list[int]:
    """Of the `unmarked_shards`, those with prompts not yet generated: the server is needed only if this is
    non-empty."""
    store = run.store()
    unfinished = []
    for ref in unmarked:
        done = finished_shard(store, ref.index, lambda ref=ref: prompt_positions(store, ref))
        if done is None or len(done[1]) < ref.num_records:
            unfinished.append(ref.index)
    return unfinished
