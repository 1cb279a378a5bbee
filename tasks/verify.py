"""The run invariant, checked from the artifacts alone (after any faulty run, and by `eagle3-datagen verify`):
every input row is accepted exactly once or rejected with a reason, no id is duplicated, every shard's
checksum matches its manifest entry, and every hidden-state part and final norm reads back.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from eagle3_datagen.artifacts import MANIFEST, artifact_path, rejected_path, sha256_hex
from eagle3_datagen.storage import RunStore
from tasks.hidden_states import HiddenStatesError, read_final_norm, read_hidden_state_shard
from tasks.prompts import REJECTED_PATH


@dataclass
class Verification:
    """What the check found; `problems` empty means the invariant holds."""

    rows: int = 0
    rejected_rows: int = 0  # by the prompt stage, each with its reason
    prompts: int = 0  # one per accepted row, or one per user turn of it (data.turns: each)
    accepted: int = 0
    rejected: int = 0  # prompts refused by the server or dropped by the length policy, with reasons
    quarantined: int = 0
    pending: int = 0
    problems: list[str] = field(default_factory=list)


def _ids_of_jsonl(store: RunStore, rel: str) -> list[str]:
    return [row["id"] for row in store.read_jsonl(rel)] if store.exists(rel) else []


def _check_once(stage: str, shard: str, ids: list[str], problems: list[str]) -> None:
    doubled = [i for i, n in Counter(ids).items() if n > 1]
    if doubled:
        problems.append(f"{shard} {stage}: duplicate ids {doubled[:5]}")


def verify_run(store: RunStore) -> Verification:
    """Walk prompts → generations → sequences → hidden states and account for every row."""
    manifest: dict[str, Any] = store.read_json(MANIFEST)
    result = Verification(rows=manifest.get("totals", {}).get("input rows", 0))
    problems = result.problems
    result.rejected_rows = len(store.read_jsonl(REJECTED_PATH)) if store.exists(REJECTED_PATH) else 0
    accepted_rows: set[int] = set()
    hidden = manifest["config"]["hidden_states"]["backend"] != "none"
    for name, status in manifest.get("shards", {}).items():
        index = int(name.rsplit("-", 1)[1])
        prompts = store.read_jsonl(artifact_path("prompts", index))
        prompt_ids = [prompt["id"] for prompt in prompts]
        accepted_rows |= {prompt["row"] for prompt in prompts}
        result.prompts += len(prompt_ids)
        _check_once("prompts", name, prompt_ids, problems)
        for stage in ("generations", "sequences", "hidden_states"):
            recorded = status.get(stage, {}).get("sha256")
            rel = artifact_path(stage, index)
            if recorded and (not store.exists(rel) or sha256_hex(store.read_bytes(rel)) != recorded):
                problems.append(f"{name} {stage}: {rel} does not match the checksum in the manifest")
        generations = artifact_path("generations", index)
        if not store.exists(generations):
            result.pending += len(prompt_ids)
            continue
        generated = [i.split(":")[0] for i in _ids_of_jsonl(store, generations)]
        gen_rejected = _ids_of_jsonl(store, rejected_path("generations", index))
        result.rejected += len(gen_rejected)
        if sorted(set(generated) | set(gen_rejected)) != sorted(prompt_ids) or set(generated) & set(gen_rejected):
            problems.append(f"{name} generations: prompts and generated + rejected ids differ")
        if status.get("validation", {}).get("status") == "quarantine":
            result.quarantined += len(set(generated))
            continue
        sequences = artifact_path("sequences", index)
        if not store.exists(sequences):
            result.pending += len(set(generated))
            continue
        table = pq.read_table(io.BytesIO(store.read_bytes(sequences)), columns=["id"])
        seq_ids = table.column("id").to_pylist()
        _check_once("sequences", name, seq_ids, problems)
        seq_rejected = _ids_of_jsonl(store, rejected_path("sequences", index))
        result.rejected += len({i.split(":")[0] for i in seq_rejected} - {i.split(":")[0] for i in seq_ids})
        if sorted(seq_ids + seq_rejected) != sorted(_ids_of_jsonl(store, generations)):
            problems.append(f"{name} sequences: generated and sequence + rejected ids differ")
        final_ids = seq_ids
        if hidden:
            index_rel = artifact_path("hidden_states", index)
            if not store.exists(index_rel):
                result.pending += len(seq_ids)
                continue
            try:
                final_ids = [sample.id for sample in read_hidden_state_shard(store, index_rel)]
                read_final_norm(store, index_rel)
            except HiddenStatesError as error:
                problems.append(f"{name} hidden_states: {error}")
                continue
            if sorted(final_ids) != sorted(seq_ids):
                problems.append(f"{name} hidden_states: samples differ from the sequences")
        result.accepted += len({i.split(":")[0] for i in final_ids})
    if result.rows and len(accepted_rows) + result.rejected_rows != result.rows:
        problems.append(f"input rows {result.rows} != rows with prompts {len(accepted_rows)} + rejected rows "
                        f"{result.rejected_rows}")
    if result.accepted + result.rejected + result.quarantined + result.pending != result.prompts:
        problems.append(
            f"prompts {result.prompts} != accepted {result.accepted} + rejected {result.rejected} + "
            f"quarantined {result.quarantined} + pending {result.pending}"
        )
    return result
