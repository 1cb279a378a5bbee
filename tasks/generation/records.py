"""What generation writes: the settings a run is pinned to, per-shard partial logs, and finished shards.

A record is appended to its shard's partial log the moment it completes, so a killed run resumes without asking
a finished prompt again; a finished shard is written atomically, in prompt order, and its log removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from eagle3_datagen.artifacts import ShardRef, artifact_path, prompt_id_of, rejected_path, sample_id, sha256_hex
from eagle3_datagen.config import GenerationConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.modes import assign_mode
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion
from eagle3_datagen.storage import RunStore

SETTINGS_FILE = "generations/settings.json"
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
            "profile": self.profile.model_dump(),
            "generation": self.generation.model_dump(),
            "prompt_source": self.prompt_source,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def mode_of(self, prompt_id: str) -> str | None:
        """The mode a prompt is asked in; None without `generation.modes` (the default mode, not recorded, so
        records stay as they were before mixes existed)."""
        if self.generation.modes is None:
            return None
        return assign_mode(prompt_id, self.generation.mode_mix(self.profile))


def check_settings(store: RunStore, settings: GenerationSettings) -> None:
    """Refuse to resume or extend a run whose generations were made with other settings."""
    if store.exists(SETTINGS_FILE) and store.read_json(SETTINGS_FILE)["fingerprint"] != settings.fingerprint():
        raise GenerationError(
            f"run {store.uri} was generated with other settings (model, sampling, modes, profile or prompt "
            f"source differ): use a new run_name, or restore the settings recorded in {SETTINGS_FILE}"
        )


def record_settings(store: RunStore, settings: GenerationSettings) -> None:
    """Pin the settings once a record is kept under them (after the early-abort window passed)."""
    if not store.exists(SETTINGS_FILE):
        payload = json.loads(json.dumps(asdict(settings), default=lambda o: o.model_dump()))
        store.write_json(SETTINGS_FILE, {"fingerprint": settings.fingerprint(), **payload})


@dataclass
class Prompt:
    """One prompt to generate, with where its records go."""

    shard: int
    position: int
    record_id: str
    messages: list[dict[str, str]]
    seed: int | None
    mode: str | None = None  # None: the profile's default mode, in a run without generation.modes


def new_records(prompt: Prompt, completions: list[Completion]) -> list[dict[str, Any]]:
    """The records of one answered prompt; with `n` samples per prompt, each sample's id gets its own suffix."""
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
        }
        for k, done in enumerate(completions)
    ]


def partial_log_path(store: RunStore, index: int) -> Path:
    """Where a shard's partial log lives: beside the shard on local disk, else in a local spool folder."""
    rel = artifact_path("generations", index).replace(".jsonl", ".partial.jsonl")
    local = store.local_path(rel)
    if local is not None:
        return Path(local)
    spool = Path(os.environ.get("EAGLE3_SPOOL_DIR", Path.home() / ".cache" / "eagle3-datagen" / "partials"))
    return spool / hashlib.sha256(store.uri.encode()).hexdigest()[:16] / rel


def segment_folder(index: int) -> str:
    """Where a shard's partial log is copied in segments when the run lives in object storage."""
    return artifact_path("generations", index).replace(".jsonl", ".partial")


def replay(entries: Iterable[dict[str, Any]], done: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Apply partial-log entries in order: an entry per position, a `discard` voids the one before it (records of
    an aborted early-abort window, asked again once the cause is fixed)."""
    for entry in entries:
        if "discard" in entry:
            done.pop(entry["position"], None)
        else:
            done[entry["position"]] = kept_form(entry)
    return done


def kept_form(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as a shard in flight keeps it: its records as their JSON lines, the shard file's own bytes.

    Why: a record's token ids as Python ints take about six times their text; a shard of long reasoning kept
    parsed until it is written cost hundreds of MiB per shard in flight.
    """
    if "records" not in entry:
        return entry
    return {"position": entry["position"], "lines": [orjson.dumps(r).decode() for r in entry["records"]]}


def log_line(entry: dict[str, Any]) -> str:
    """The partial-log line of an entry in its kept form (records serialized once, not twice)."""
    if "lines" not in entry:
        return json.dumps(entry, ensure_ascii=False)
    return f'{{"position": {entry["position"]}, "records": [{", ".join(entry["lines"])}]}}'


def read_partial_log(path: Path) -> dict[int, dict[str, Any]]:
    """Finished entries by position from a local partial log; a torn last line (killed mid-write) is ignored."""
    if not path.exists():
        return {}
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return replay(entries, {})


def read_segments(store: RunStore, index: int) -> tuple[list[dict[str, Any]], int]:
    """A shard's partial-log segments in run storage, in order, and how many there are."""
    segments = store.list(segment_folder(index), ".jsonl")
    return [entry for rel in segments for entry in store.read_jsonl(rel)], len(segments)


@dataclass
class ShardState:
    """An unfinished shard: its entries so far (records or a rejection per position) and its partial log.

    The log is appended on local disk as each entry comes. When the run lives in object storage, entries are
    also `spill`ed there in segments (every SEGMENT_RECORDS entries or SEGMENT_EVERY_S seconds), so a lost
    machine loses at most one segment and a re-run anywhere resumes from the rest.
    """

    ref: ShardRef
    size: int
    log_path: Path
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    log: IO[str] | None = None
    spill: Callable[[str, list[str]], None] | None = None
    segments: int = 0
    pending: list[str] = field(default_factory=list)
    spilled_at: float = field(default_factory=time.monotonic)

    def append(self, entry: dict[str, Any]) -> None:
        if self.log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log = self.log_path.open("a", encoding="utf-8")
        entry = kept_form(entry)
        line = log_line(entry)
        self.log.write(line + "\n")
        self.log.flush()
        replay([entry], self.entries)
        if self.spill is not None:
            self.pending.append(line)
            if len(self.pending) >= SEGMENT_RECORDS or time.monotonic() - self.spilled_at >= SEGMENT_EVERY_S:
                self.spill_segment()

    def spill_segment(self) -> None:
        if self.spill is not None and self.pending:
            self.spill(f"{segment_folder(self.ref.index)}/segment-{self.segments:05d}.jsonl", self.pending)
            self.segments += 1
        self.pending, self.spilled_at = [], time.monotonic()

    def close(self) -> None:
        """Keep what is pending (a run stopped short resumes from it) and close the local log."""
        self.spill_segment()
        if self.log is not None:
            self.log.close()
            self.log = None

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.size


def finalize_shard(store: RunStore, state: ShardState) -> ShardRef:
    """Write the finished shard atomically (records in prompt order), its rejections, then drop the log."""
    ordered = [state.entries[p] for p in sorted(state.entries)]
    lines = [line for e in ordered for line in e.get("lines", [])]
    rejected = [e["rejected"] for e in ordered if "rejected" in e]
    if rejected:
        store.write_jsonl(rejected_path("generations", state.ref.index), rejected)
    data = "".join(line + "\n" for line in lines).encode()
    ref = store.write_shard_bytes("generations", state.ref.index, data, len(lines), prompts_sha256=state.ref.sha256)
    state.pending = []  # the shard is written: nothing of it needs keeping any more
    state.close()
    state.log_path.unlink(missing_ok=True)
    store.remove(segment_folder(state.ref.index))
    return ref


def finished_shard(
    store: RunStore, index: int, prompts: Iterable[dict[str, Any]]
) -> tuple[ShardRef, dict[int, dict[str, Any]]] | None:
    """A finished shard's ref, and its records and rejections keyed by their prompt's current position.

    None if the shard was never finished. Fewer entries than prompts means the prompt shard grew (a dataset
    that gained rows, say): only the new prompts are generated, the finished records are kept.
    """
    path = artifact_path("generations", index)
    if not store.exists(path):
        return None
    data = store.read_bytes(path)
    position = {prompt["id"]: i for i, prompt in enumerate(prompts)}
    entries: dict[int, dict[str, Any]] = {}
    for line in data.decode("utf-8").splitlines():
        at = position.get(prompt_id_of(json.loads(line)["id"]))
        if at is not None:
            entries.setdefault(at, {"position": at, "lines": []})["lines"].append(line)
    rejected = rejected_path("generations", index)
    for row in store.read_jsonl(rejected) if store.exists(rejected) else []:
        at = position.get(row["id"])
        if at is not None:
            entries[at] = {"position": at, "rejected": row}
    return ShardRef("generations", index, path, data.count(b"\n"), sha256_hex(data)), entries


def marked_finished(store: RunStore, prompts: ShardRef) -> ShardRef | None:
    """The generations of a prompt shard, if their completion marker says they answer exactly these prompts:
    a re-run of a finished run reads no shard, only markers."""
    marker = store.read_marker(artifact_path("generations", prompts.index))
    if marker is None or marker.get("prompts_sha256") != prompts.sha256:
        return None
    return ShardRef(*(marker[name] for name in ("stage", "index", "path", "num_records", "sha256")))


def unfinished_shards(prompt_shards: list[ShardRef], output_uri: str, run_name: str) -> list[int]:
    """Shards with prompts not yet generated: the server is needed only if this is non-empty."""
    store = RunStore(output_uri, run_name)
    unfinished = []
    for ref in prompt_shards:
        if marked_finished(store, ref) is not None:
            continue
        prompts = list(store.read_shard_records(ref))
        done = finished_shard(store, ref.index, prompts)
        if done is None or len(done[1]) < len(prompts):
            unfinished.append(ref.index)
    return unfinished
