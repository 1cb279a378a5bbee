"""What generation writes: the settings a run is pinned to, per-shard partial logs, and finished shards.

A record is appended to its shard's partial log the moment it completes, so a killed run resumes without asking
a finished prompt again; a finished shard is written atomically, in prompt order, and its log removed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from eagle3_datagen.artifacts import ShardRef, artifact_path, prompt_id_of, rejected_path, sample_id, sha256_hex
from eagle3_datagen.config import GenerationConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.protocol import Completion
from eagle3_datagen.storage import RunStore

SETTINGS_FILE = "generations/settings.json"


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


def check_settings(store: RunStore, settings: GenerationSettings) -> None:
    """Refuse to resume or extend a run whose generations were made with other settings."""
    if store.exists(SETTINGS_FILE) and store.read_json(SETTINGS_FILE)["fingerprint"] != settings.fingerprint():
        raise GenerationError(
            f"run {store.uri} was generated with other settings (model, sampling, profile or prompt "
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


def read_partial_log(path: Path) -> dict[int, dict[str, Any]]:
    """Finished entries by position; a torn last line (killed mid-write) is ignored.

    A `discard` line voids the entry before it at that position (records of an aborted early-abort window),
    so the prompt is asked again once the cause is fixed.
    """
    done: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "discard" in entry:
            done.pop(entry["position"], None)
        else:
            done[entry["position"]] = entry
    return done


@dataclass
class ShardState:
    """An unfinished shard: its entries so far (records or a rejection per position) and its partial log."""

    ref: ShardRef
    size: int
    log_path: Path
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    log: IO[str] | None = None

    def append(self, entry: dict[str, Any]) -> None:
        if self.log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log = self.log_path.open("a", encoding="utf-8")
        self.log.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.log.flush()
        if "discard" in entry:
            self.entries.pop(entry["position"], None)
        else:
            self.entries[entry["position"]] = entry

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.size


def finalize_shard(store: RunStore, state: ShardState) -> ShardRef:
    """Write the finished shard atomically (records in prompt order), its rejections, then drop the log."""
    ordered = [state.entries[p] for p in sorted(state.entries)]
    records = [record for e in ordered for record in e.get("records", [])]
    rejected = [e["rejected"] for e in ordered if "rejected" in e]
    if rejected:
        store.write_jsonl(rejected_path("generations", state.ref.index), rejected)
    ref = store.write_shard("generations", state.ref.index, records)
    state.close()
    state.log_path.unlink(missing_ok=True)
    return ref


def finished_shard(
    store: RunStore, index: int, prompts: list[dict[str, Any]]
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
        record = json.loads(line)
        at = position.get(prompt_id_of(record["id"]))
        if at is not None:
            entries.setdefault(at, {"position": at, "records": []})["records"].append(record)
    rejected = rejected_path("generations", index)
    for row in store.read_jsonl(rejected) if store.exists(rejected) else []:
        at = position.get(row["id"])
        if at is not None:
            entries[at] = {"position": at, "rejected": row}
    return ShardRef("generations", index, path, data.count(b"\n"), sha256_hex(data)), entries


def unfinished_shards(prompt_shards: list[ShardRef], output_uri: str, run_name: str) -> list[int]:
    """Shards with prompts not yet generated: the server is needed only if this is non-empty."""
    store = RunStore(output_uri, run_name)
    unfinished = []
    for ref in prompt_shards:
        prompts = store.read_shard_records(ref)
        done = finished_shard(store, ref.index, prompts)
        if done is None or len(done[1]) < len(prompts):
            unfinished.append(ref.index)
    return unfinished
