"""The run invariant, checked from storage alone (after any faulty run, and by `eagle3-datagen verify`).

Shards are enumerated from the prompt stage's files, not from the manifest (which a killed run never
finishes): every input row is accepted exactly once or rejected with a reason, no id is duplicated, every
stage's artifact of every shard exists, checksums match the manifest where it recorded one, and every
hidden-state part and final norm reads back. A run is vouched for only if it is complete and consistent.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from eagle3_datagen.artifacts import (
    MANIFEST,
    PROMPTS_SUMMARY,
    REJECTED_PATH,
    artifact_path,
    prompt_id_of,
    rejected_path,
    sha256_hex,
    shard_name,
)
from eagle3_datagen.conversations import Ended, answer_of, next_turn, turn_id
from eagle3_datagen.hidden_state_format import HiddenStatesError, read_final_norm, read_hidden_state_shard
from eagle3_datagen.storage import RunStore


@dataclass
class Verification:
    """What the check found. `complete` only when nothing is missing, nothing inconsistent, and the run ended."""

    status: str = "missing"  # the manifest's: completed, failed, cancelled, or running (killed, or still going)
    cause: str | None = None
    rows: int = 0
    rejected_rows: int = 0  # by the prompt stage, each with its reason
    prompts: int = 0  # one per accepted row, one per user turn of it (data.turns: each), one per conversation
    samples: int = 0  # training samples: one per prompt, or per sample (n > 1), or per turn of a rollout
    accepted: int = 0
    rejected: int = 0  # prompts refused by the server or dropped by the length policy, with reasons
    quarantined: int = 0
    pending: int = 0
    quarantined_shards: list[int] = field(default_factory=list)
    unfinished_shards: list[int] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # stage artifacts a finished run would have
    problems: list[str] = field(default_factory=list)  # inconsistencies: never expected, whatever the status

    @property
    def complete(self) -> bool:
        return self.status == "completed" and not self.missing and not self.problems and not self.pending

    def verdict(self) -> str:
        """One line: vouched for, or why not."""
        if self.complete:
            return "run complete and consistent"
        if self.status == "running":
            why = "the run did not end (killed or crashed, or still running elsewhere)"
        elif self.status == "missing":
            why = f"no {MANIFEST}: not a run folder, or the run never started"
        else:
            why = f"the run ended {self.status}" + (f": {self.cause}" if self.cause else "")
        parts = [f"{len(self.missing)} artifacts missing" if self.missing else "",
                 f"{len(self.problems)} problems" if self.problems else ""]
        return "NOT complete: " + "; ".join([why, *filter(None, parts)])


def _ids_of_jsonl(store: RunStore, rel: str) -> list[str]:
    return [row["id"] for row in store.read_jsonl(rel)] if store.exists(rel) else []


def _check_once(stage: str, shard: str, ids: list[str], problems: list[str]) -> None:
    doubled = [i for i, n in Counter(ids).items() if n > 1]
    if doubled:
        problems.append(f"{shard} {stage}: duplicate ids {doubled[:5]}")


def _prompt_shards(store: RunStore) -> list[int]:
    return [int(rel.rsplit("-", 1)[1].removesuffix(".jsonl")) for rel in store.list("prompts", ".jsonl")]


def verify_run(store: RunStore) -> Verification:
    """Walk prompts → generations → sequences → hidden states of every shard in storage; account for every row."""
    manifest: dict[str, Any] = store.read_json(MANIFEST) if store.exists(MANIFEST) else {}
    result = Verification(status=manifest.get("status", "missing"), cause=manifest.get("cause"))
    if not store.exists(PROMPTS_SUMMARY):
        result.missing.append(f"{PROMPTS_SUMMARY} (the prompt stage did not finish)")
        return result
    summary = store.read_json(PROMPTS_SUMMARY)
    result.rows = summary["rows"]
    result.rejected_rows = len(store.read_jsonl(REJECTED_PATH)) if store.exists(REJECTED_PATH) else 0
    indexes = _prompt_shards(store)
    if indexes != list(range(summary["shards"])):
        result.problems.append(f"prompts: shards {indexes} in storage, {summary['shards']} written")
    strays = store.shard_files_outside(set(indexes))
    if strays:
        result.problems.append(f"{len(strays)} files of shards the prompts no longer have, e.g. {strays[0]}: a "
                               "folder read whole would hold their prompts twice (run the pipeline again)")
    hidden = manifest.get("config", {}).get("hidden_states", {}).get("backend") != "none"
    accepted_rows: set[int] = set()
    for index in indexes:
        accepted_rows |= _verify_shard(store, index, manifest.get("shards", {}).get(shard_name(index), {}), hidden,
                                       result)
    if len(accepted_rows) + result.rejected_rows != result.rows:
        result.problems.append(f"input rows {result.rows} != rows with prompts {len(accepted_rows)} + rejected "
                               f"rows {result.rejected_rows}")
    if result.accepted + result.rejected + result.quarantined + result.pending != result.prompts:
        result.problems.append(
            f"prompts {result.prompts} != accepted {result.accepted} + rejected {result.rejected} + "
            f"quarantined {result.quarantined} + pending {result.pending}"
        )
    return result


def _mark_missing(result: Verification, index: int, rel: str) -> None:
    result.missing.append(rel)
    result.unfinished_shards.append(index)


def _verify_shard(store: RunStore, index: int, recorded: dict[str, Any], hidden: bool,
                  result: Verification) -> set[int]:
    """Account for one shard's prompts; returns the input rows they came from."""
    name, problems = shard_name(index), result.problems
    prompts = store.read_jsonl(artifact_path("prompts", index))
    prompt_ids = [prompt["id"] for prompt in prompts]
    result.prompts += len(prompt_ids)
    _check_once("prompts", name, prompt_ids, problems)
    for stage in ("generations", "sequences", "hidden_states"):
        sha = recorded.get(stage, {}).get("sha256")
        rel = artifact_path(stage, index)
        if sha and (not store.exists(rel) or sha256_hex(store.read_bytes(rel)) != sha):
            problems.append(f"{name} {stage}: {rel} does not match the checksum in the manifest")
    rows = {prompt["row"] for prompt in prompts}
    generations = artifact_path("generations", index)
    if not store.exists(generations):
        _mark_missing(result, index, generations)
        result.pending += len(prompt_ids)
        return rows
    records = store.read_jsonl(generations)  # read once: ids, and a rollout's transcripts
    generated_ids = [record["id"] for record in records]
    generated = {prompt_id_of(i) for i in generated_ids}
    refused_rel = rejected_path("generations", index)
    refused = store.read_jsonl(refused_rel) if store.exists(refused_rel) else []
    gen_rejected = [prompt_id_of(row["id"]) for row in refused]
    rollout = bool(prompts) and "turns" in prompts[0]
    result.rejected += len(set(gen_rejected) - generated) if rollout else len(gen_rejected)
    if sorted(generated | set(gen_rejected)) != sorted(prompt_ids) or (generated & set(gen_rejected)
                                                                        and not rollout):
        problems.append(f"{name} generations: prompts and generated + rejected ids differ")
    if rollout:
        problems += _transcript_problems(name, prompts, records, refused)
    validation = artifact_path("validation", index)
    if not store.exists(validation):
        _mark_missing(result, index, validation)
        result.pending += len(generated)
        return rows
    if store.read_json(validation)["status"] == "quarantine":
        result.quarantined += len(generated)
        result.quarantined_shards.append(index)
        return rows
    sequences = artifact_path("sequences", index)
    if not store.exists(sequences):
        _mark_missing(result, index, sequences)
        result.pending += len(generated)
        return rows
    seq_ids = pq.read_table(io.BytesIO(store.read_bytes(sequences)), columns=["id"]).column("id").to_pylist()
    _check_once("sequences", name, seq_ids, problems)
    seq_rejected = _ids_of_jsonl(store, rejected_path("sequences", index))
    result.rejected += len({prompt_id_of(i) for i in seq_rejected} - {prompt_id_of(i) for i in seq_ids})
    if sorted(seq_ids + seq_rejected) != sorted(generated_ids):
        problems.append(f"{name} sequences: generated and sequence + rejected ids differ")
    final_ids = seq_ids
    if hidden:
        index_rel = artifact_path("hidden_states", index)
        if not store.exists(index_rel):
            _mark_missing(result, index, index_rel)
            result.pending += len({prompt_id_of(i) for i in seq_ids})
            return rows
        try:
            final_ids = [sample.id for sample in read_hidden_state_shard(store, index_rel)]
            read_final_norm(store, index_rel)
        except HiddenStatesError as error:
            problems.append(f"{name} hidden_states: {error}")
            return rows
        if sorted(final_ids) != sorted(seq_ids):
            problems.append(f"{name} hidden_states: samples differ from the sequences")
    result.accepted += len({prompt_id_of(i) for i in final_ids})
    result.samples += len(final_ids)
    return rows


def _transcript_problems(name: str, prompts: list[dict[str, Any]], records: list[dict[str, Any]],
                         rejected: list[dict[str, Any]]) -> list[str]:
    """A rollout's kept turns are its turns 0..k-1, each asked on the answers (and paired tool results) before it,
    and the conversation ends as its last record says (answered in full, or a call without a recorded result) or
    with a refused turn k."""
    turns: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        turns.setdefault(prompt_id_of(record["id"]), []).append(record)
    refused = {prompt_id_of(row["id"]): row["id"] for row in rejected}
    problems = []
    for prompt in prompts:
        conversation, script = prompt["id"], prompt["messages"]
        kept = sorted(turns.get(conversation, []), key=lambda record: record["turn"])
        outputs = [answer_of(record) for record in kept]
        if [record["turn"] for record in kept] != list(range(len(kept))):
            problems.append(f"{name} generations: conversation {conversation} does not keep turns 0..k in order")
            continue
        try:
            asked = [next_turn(script, outputs[:k]) for k in range(len(kept) + 1)]
        except ValueError as error:
            problems.append(f"{name} generations: conversation {conversation}: {error}")
            continue
        problems += [f"{name} generations: {record['id']} was not asked on the turns before it"
                     for record, prompt_messages in zip(kept, asked, strict=False)
                     if record["messages"] != prompt_messages]
        end, last = asked[-1], kept[-1] if kept else {}
        if conversation in refused:
            if refused[conversation] != turn_id(conversation, len(kept)) or isinstance(end, Ended):
                problems.append(f"{name} generations: {refused[conversation]} is rejected but {len(kept)} turns "
                                "are kept")
        elif not isinstance(end, Ended) or last.get("ended") != end.reason:
            problems.append(f"{name} generations: conversation {conversation} ends after {len(kept)} turns without "
                            "its reason")
    return problems


def rerun_plan(result: Verification, redo_quarantined: bool) -> str:
    """What `rerun-failed` will redo, in one line, before it does it."""
    shards = [shard_name(i) for i in result.unfinished_shards]
    todo = (f"will finish {len(shards)} shards ({', '.join(shards[:8])}{'…' if len(shards) > 8 else ''}), "
            f"{result.pending} prompts pending") if shards else "nothing unfinished"
    names = ", ".join(shard_name(i) for i in result.quarantined_shards)
    if not result.quarantined_shards:
        quarantine = "no quarantined shard"
    elif redo_quarantined:
        quarantine = f"will generate quarantined {names} again (their records are moved to quarantine/, not deleted)"
    else:
        quarantine = f"quarantined {names} stay as they are (add --redo-quarantined once the cause is fixed)"
    return f"rerun-failed: {todo}; {quarantine}"
