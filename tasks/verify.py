"""The run invariant, checked from storage alone (after any faulty run, by `eagle3-datagen verify`, and before
`rerun-failed` plans its work).

Two depths. The structural check (the default) reads no data: one listing per stage (every file and its size),
then per shard its completion markers, validation verdict and hidden-state index. It follows each shard's chain,
prompts → generations → sequences → hidden states: every file has the size its marker vouches for, every marker
names the previous stage's file as it is now, and the counts the markers keep add up. Its time grows with the
shards, not the bytes. The deep check (`--deep`) reads every byte: every row accepted exactly once or rejected
with a reason, no id twice, a rollout's transcript as it was asked, checksums, every hidden-state part and final
norm read back. A shard no marker vouches for (written by an older version, or cut short between file and
marker) is read in the structural check too.

Shards are enumerated from the prompt stage's files, not from the manifest (which a killed run never finishes). A
run is vouched for only if it is complete and consistent.
"""

from __future__ import annotations

import copy
import io
import json
import os
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import (
    MANIFEST,
    PROMPTS_SUMMARY,
    REJECTED_PATH,
    SHARD_STAGES,
    artifact_path,
    prompt_id_of,
    rejected_path,
    sha256_hex,
    shard_index_of,
    shard_name,
)
from eagle3_datagen.config import ExecutionConfig
from eagle3_datagen.conversations import Ended, answer_of, next_turn, turn_id
from eagle3_datagen.hidden_state_format import (
    FINAL_NORM_FILE,
    HiddenStatesError,
    check_format,
    part_split,
    read_final_norm,
    read_hidden_state_shard,
)
from eagle3_datagen.images import IMAGES_DIR, image_names, image_path, name_matches
from eagle3_datagen.lease import refuse_while_written
from eagle3_datagen.storage import RunLocation, RunStore, marker_path

PROGRESS_EVERY_S = 5.0  # a deep check says how far it is this often
READERS = 16  # markers and indexes read at once: an object store answers each in tens of milliseconds
# shards read whole at once by --deep: each holds its records parsed (16 took 1.9 GB at 10,000 prompts a shard),
# and parsing them is bound to the CPUs
DEEP_READERS = min(READERS, 2 * (os.cpu_count() or 1))


@dataclass
class ShardFindings:
    """What one shard adds to the run's account."""

    index: int
    prompts: int = 0
    samples: int = 0
    accepted: int = 0
    rejected: int = 0
    quarantined: int = 0
    pending: int = 0
    missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    in_quarantine: bool = False
    rows: set[int] = field(default_factory=set)  # input rows its prompts came from (read only by the deep check)
    bytes_read: int = 0

    @property
    def unfinished(self) -> bool:
        return bool(self.missing)

    def mark_missing(self, rel: str, pending: int) -> ShardFindings:
        self.missing.append(rel)
        self.pending += pending
        return self


@dataclass
class Verification:
    """What the check found. `complete` only when nothing is missing, nothing inconsistent, and the run ended."""

    status: str = "missing"  # the manifest's: completed, failed, cancelled, or running (killed, or still going)
    cause: str | None = None
    deep: bool = False
    rows: int = 0
    rejected_rows: int = 0  # by the prompt stage, each with its reason
    prompts: int = 0  # one per accepted row, one per user turn of it (data.turns: each), one per conversation
    samples: int = 0  # training samples: one per prompt, or per sample (n > 1), or per turn of a rollout
    accepted: int = 0
    rejected: int = 0  # prompts refused by the server or dropped by the length policy, with reasons
    quarantined: int = 0
    pending: int = 0
    bytes_read: int = 0
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
            return "run complete and consistent" + ("" if self.deep else " (structure; --deep reads every byte)")
        if self.status == "running":
            why = "the run did not end (killed or crashed, or still running elsewhere)"
        elif self.status == "missing":
            why = f"no {MANIFEST}: not a run folder, or the run never started"
        else:
            why = f"the run ended {self.status}" + (f": {self.cause}" if self.cause else "")
        parts = [f"{len(self.missing)} artifacts missing" if self.missing else "",
                 f"{len(self.problems)} problems" if self.problems else ""]
        return "NOT complete: " + "; ".join([why, *filter(None, parts)])

    def absorb(self, found: ShardFindings) -> None:
        for name in ("prompts", "samples", "accepted", "rejected", "quarantined", "pending", "bytes_read"):
            setattr(self, name, getattr(self, name) + getattr(found, name))
        self.missing += found.missing
        self.problems += found.problems
        if found.unfinished:
            self.unfinished_shards.append(found.index)
        if found.in_quarantine:
            self.quarantined_shards.append(found.index)


@dataclass(frozen=True)
class RunLayout:
    """What every shard's check needs from the run as a whole, read once: the shards, what the manifest recorded
    of each, whether hidden states are expected, and every file's size (one listing per stage)."""

    shards: list[int]
    recorded: dict[str, dict[str, Any]]
    hidden: bool
    sizes: dict[str, int]
    summary: dict[str, Any]


def start_verification(store: RunStore, deep: bool) -> tuple[Verification, RunLayout | None]:
    """The run-wide part of the check; no layout when the prompt stage never finished (nothing more to check).
    A run another process is writing is refused: its shards are rewritten under the check."""
    refuse_while_written(store, "verify it once that run ends")
    manifest: dict[str, Any] = store.read_json(MANIFEST) if store.exists(MANIFEST) else {}
    result = Verification(status=manifest.get("status", "missing"), cause=manifest.get("cause"), deep=deep)
    if not store.exists(PROMPTS_SUMMARY):
        result.missing.append(f"{PROMPTS_SUMMARY} (the prompt stage did not finish)")
        return result, None
    summary = store.read_json(PROMPTS_SUMMARY)
    sizes = {rel: size for stage in ("prompts", *SHARD_STAGES, IMAGES_DIR) for rel, size in store.sizes(stage).items()}
    shards = sorted(int(rel[len("prompts/shard-"):-len(".jsonl")]) for rel in sizes
                    if rel.startswith("prompts/shard-") and rel.endswith(".jsonl"))
    if shards != list(range(summary["shards"])):
        result.problems.append(f"prompts: shards {shards} in storage, {summary['shards']} written")
    strays = sorted({rel.split("/")[0] + "/" + rel.split("/")[1] for rel in sizes
                     if not rel.startswith("prompts/") and rel.count("/") >= 1
                     and (index := shard_index_of(rel.split("/")[1])) is not None and index not in shards})
    if strays:
        result.problems.append(f"{len(strays)} files of shards the prompts no longer have, e.g. {strays[0]}: a "
                               "folder read whole would hold their prompts twice (run the pipeline again)")
    stored_images = [rel for rel in sizes if rel.startswith(f"{IMAGES_DIR}/")]
    if len(stored_images) < summary.get("images", 0):
        result.problems.append(f"{IMAGES_DIR}: {len(stored_images)} images in storage, {summary['images']} stored by "
                               "the prompt stage (run the pipeline again)")
    if deep:
        changed = [rel for rel in stored_images if not name_matches(posixpath.basename(rel), store.read_bytes(rel))]
        result.problems += [f"{rel} no longer hashes to its name: the image was changed after its prompts were made"
                            for rel in changed]
    hidden = manifest.get("config", {}).get("hidden_states", {}).get("backend") != "none"
    return result, RunLayout(shards, manifest.get("shards", {}), hidden, sizes, summary)


def conclude(result: Verification, layout: RunLayout, findings: Iterable[ShardFindings],
             store: RunStore) -> Verification:
    """The run's account from its shards' findings: every input row and every prompt accounted for once."""
    rows: set[int] = set()
    for found in sorted(findings, key=lambda found: found.index):
        result.absorb(found)
        rows |= found.rows
    result.rows = layout.summary["rows"]
    if result.deep:
        result.rejected_rows = len(store.read_jsonl(REJECTED_PATH)) if store.exists(REJECTED_PATH) else 0
        accepted_rows = len(rows)
    else:
        result.rejected_rows = layout.summary.get("rejected_rows", 0)
        accepted_rows = layout.summary.get("accepted_rows", result.rows - result.rejected_rows)
    if accepted_rows + result.rejected_rows != result.rows:
        result.problems.append(f"input rows {result.rows} != rows with prompts {accepted_rows} + rejected "
                               f"rows {result.rejected_rows}")
    if result.accepted + result.rejected + result.quarantined + result.pending != result.prompts:
        result.problems.append(
            f"prompts {result.prompts} != accepted {result.accepted} + rejected {result.rejected} + "
            f"quarantined {result.quarantined} + pending {result.pending}"
        )
    return result


def verify_run(store: RunStore, deep: bool = False, threads: int | None = None,
               progress: Callable[[int, int, int], None] | None = None) -> Verification:
    """Walk prompts → generations → sequences → hidden states of every shard in storage; account for every row.

    Shards are checked on `threads` threads (READERS, or DEEP_READERS for `deep`); `progress` hears (shards done,
    shards, bytes read) after each.
    """
    result, layout = start_verification(store, deep)
    if layout is None:
        return result
    findings: list[ShardFindings] = []
    with ThreadPoolExecutor(max_workers=threads or (DEEP_READERS if deep else READERS),
                            thread_name_prefix="verify") as pool:
        for found in pool.map(lambda index: check_shard(store, index, layout, deep), layout.shards):
            findings.append(found)
            if progress is not None:
                progress(len(findings), len(layout.shards), sum(found.bytes_read for found in findings))
    return conclude(result, layout, findings, store)


def check_shard(store: RunStore, index: int, layout: RunLayout, deep: bool) -> ShardFindings:
    """One shard's account, structural or deep; a shard no marker vouches for is read whatever the depth. A file
    that cannot be parsed is a problem named by its path, not a crash."""
    store, reads = _logging_reads(store)
    found = ShardFindings(index)
    try:
        structure = None if deep else _shard_structure(store, layout, index)
        if structure is None:
            _shard_contents(store, layout, found)
        else:
            found = structure
    except (ValueError, KeyError, TypeError) as error:  # what JSON, Parquet and safetensors parsers raise
        found.problems.append(f"{shard_name(index)}: {reads.last} cannot be read ({type(error).__name__}: {error}): "
                              "run the pipeline again")
    found.bytes_read = reads.bytes
    return found


@dataclass
class _Reads:
    bytes: int = 0
    last: str = ""


def _logging_reads(store: RunStore) -> tuple[RunStore, _Reads]:
    """A copy of the store that counts what it reads (for the progress line) and keeps the last file's name."""
    logged, reads, read_bytes = copy.copy(store), _Reads(), store.read_bytes

    def read(rel: str) -> bytes:
        reads.last = rel
        data = read_bytes(rel)
        reads.bytes += len(data)
        return data

    logged.read_bytes = read  # type: ignore[method-assign]
    return logged, reads


@task(name="verify-shard", task_run_name="verify-shard-{index:05d}", cache_policy=NO_CACHE, persist_result=False)
def verify_shard(run: RunLocation, index: int, layout: RunLayout, deep: bool) -> ShardFindings:
    """`check_shard` as a Prefect task: a deep check's shards on the run's task runner (Ray's nodes, say)."""
    return check_shard(run.store(), index, layout, deep)


def recorded_execution(store: RunStore) -> ExecutionConfig:
    """Where the run was recorded to run (its manifest's `execution`): a deep check of a Ray run runs on Ray."""
    manifest = store.read_json(MANIFEST) if store.exists(MANIFEST) else {}
    return ExecutionConfig.model_validate(manifest.get("config", {}).get("execution", {}))


def progress_line(done: int, total: int, bytes_read: int, seconds: float) -> str:
    """How far a check is: shards, bytes read and their rate."""
    return (f"verify: {done}/{total} shards, {bytes_read / 1e9:.2f} GB read "
            f"({bytes_read / 1e6 / max(seconds, 1e-9):.0f} MB/s, {seconds:.0f} s)")


def _vouched(store: RunStore, layout: RunLayout, rel: str, *facts: str) -> dict[str, Any] | None:
    """The completion marker of a listed file, if it vouches for the file's size now and keeps `facts`."""
    if marker_path(rel) not in layout.sizes:
        return None
    marker = store.read_json(marker_path(rel))
    if marker.get("bytes") != layout.sizes.get(rel) or any(fact not in marker for fact in facts):
        return None
    return marker


def _sized(layout: RunLayout, rel: str, expected: int, problems: list[str], whose: str) -> None:
    size = layout.sizes.get(rel, 0)
    if size != expected:
        problems.append(f"{rel} has {size} bytes, {whose} says {expected}: run the pipeline again")


def _shard_structure(store: RunStore, layout: RunLayout, index: int) -> ShardFindings | None:
    """The shard's account from its markers, verdict and index and the listing's sizes; None if a file it needs
    has no marker vouching for it (the caller reads the shard instead)."""
    name, found, recorded = shard_name(index), ShardFindings(index), layout.recorded.get(shard_name(index), {})
    problems = found.problems
    prompts = _vouched(store, layout, artifact_path("prompts", index))
    if prompts is None:
        return None
    found.prompts = prompts["num_records"]
    gen_rel = artifact_path("generations", index)
    if gen_rel not in layout.sizes:
        return found.mark_missing(gen_rel, found.prompts)
    generations = _linked(store, layout, index, "generations", prompts, problems)
    if generations is None:
        return None
    answered = generations["prompts_answered"]
    if answered + generations["prompts_refused"] != found.prompts:
        problems.append(f"{name} generations: prompts and generated + rejected ids differ")
    found.rejected += generations["prompts_refused"]
    validation = artifact_path("validation", index)
    if validation not in layout.sizes:
        return found.mark_missing(validation, answered)
    if store.read_json(validation)["status"] == "quarantine":
        found.quarantined, found.in_quarantine = answered, True
        return found
    seq_rel = artifact_path("sequences", index)
    if seq_rel not in layout.sizes:
        return found.mark_missing(seq_rel, answered)
    sequences = _linked(store, layout, index, "sequences", generations, problems)
    if sequences is None:
        return None
    if sequences["num_records"] + sequences["rejected_samples"] != generations["num_records"]:
        problems.append(f"{name} sequences: generated and sequence + rejected ids differ")
    found.rejected += sequences["rejected_prompts"]
    accepted, samples = sequences["accepted_prompts"], sequences["num_records"]
    if layout.hidden:
        index_rel = artifact_path("hidden_states", index)
        if index_rel not in layout.sizes:
            return found.mark_missing(index_rel, accepted)
        data = store.read_bytes(index_rel)
        _check_recorded(recorded, "hidden_states", sha256_hex(data), index_rel, problems)
        shard_index = json.loads(data)
        try:
            check_format(shard_index, index_rel)
        except HiddenStatesError as error:
            problems.append(f"{name} hidden_states: {error}")
            return found
        if shard_index["sequences_sha256"] != sequences["sha256"]:
            problems.append(f"{name} hidden_states: made from other sequences than {seq_rel} holds")
        if shard_index["num_samples"] != samples or len(shard_index["samples"]) != samples:
            problems.append(f"{name} hidden_states: samples differ from the sequences")
        folder = posixpath.dirname(index_rel)
        for part in shard_index["parts"]:
            _sized(layout, posixpath.join(folder, part["file"]), part["bytes"], problems, index_rel)
        if posixpath.join(folder, FINAL_NORM_FILE) not in layout.sizes:
            problems.append(f"{name} hidden_states: {index_rel}: its final norm is missing: re-run hidden_states")
        accepted = len({prompt_id_of(i) for i in shard_index["samples"]})
    found.accepted += accepted
    found.samples += samples
    return found


_LINKS = {"generations": ("prompts", "prompts_answered"), "sequences": ("generations", "accepted_prompts")}


def _linked(store: RunStore, layout: RunLayout, index: int, stage: str, previous: dict[str, Any],
            problems: list[str]) -> dict[str, Any] | None:
    """A stage's marker, if it vouches for its file: made from the previous stage's file as it is now, its rejected
    file the size it says, its checksum the manifest's. None: no marker vouches (the caller reads the shard)."""
    before, fact = _LINKS[stage]
    rel = artifact_path(stage, index)
    marker = _vouched(store, layout, rel, fact)
    if marker is None:
        return None
    if marker[f"{before}_sha256"] != previous["sha256"]:
        problems.append(f"{shard_name(index)} {stage}: made from other {before} than {artifact_path(before, index)} "
                        "holds")
    _sized(layout, rejected_path(stage, index), marker["rejected_bytes"], problems, f"the marker of {rel}")
    _check_recorded(layout.recorded.get(shard_name(index), {}), stage, marker["sha256"], rel, problems)
    return marker


def _check_recorded(recorded: dict[str, Any], stage: str, sha256: str | None, rel: str, problems: list[str]
                    ) -> None:
    """The manifest's checksum of a stage's file, where it recorded one, must be the file's now (None: absent)."""
    sha = recorded.get(stage, {}).get("sha256")
    if sha and sha != sha256:
        problems.append(f"{stage}: {rel} does not match the checksum in the manifest")


def _ids_of_jsonl(store: RunStore, rel: str) -> list[str]:
    return [row["id"] for row in store.read_jsonl(rel)] if store.exists(rel) else []


def _check_once(stage: str, shard: str, ids: list[str], problems: list[str]) -> None:
    doubled = [i for i, n in Counter(ids).items() if n > 1]
    if doubled:
        problems.append(f"{shard} {stage}: duplicate ids {doubled[:5]}")


def _shard_contents(store: RunStore, layout: RunLayout, found: ShardFindings) -> None:
    """Account for one shard's prompts from every byte of its files, into `found`."""
    index = found.index
    name = shard_name(index)
    problems, recorded = found.problems, layout.recorded.get(shard_name(index), {})
    prompts = store.read_jsonl(artifact_path("prompts", index))
    prompt_ids = [prompt["id"] for prompt in prompts]
    found.prompts = len(prompt_ids)
    found.rows = {prompt["row"] for prompt in prompts}
    _check_once("prompts", name, prompt_ids, problems)
    problems += [f"{name} prompts: prompt {prompt['id']} shows {image_path(shown)}, which is not in storage"
                 for prompt in prompts for shown in image_names(prompt["messages"]) if image_path(shown) not in
                 layout.sizes]
    for stage in ("generations", "sequences", "hidden_states"):
        rel = artifact_path(stage, index)
        if recorded.get(stage, {}).get("sha256"):
            sha = sha256_hex(store.read_bytes(rel)) if rel in layout.sizes else None
            _check_recorded(recorded, stage, sha, rel, problems)
    generations = artifact_path("generations", index)
    if not store.exists(generations):
        return found.mark_missing(generations, len(prompt_ids))
    records = store.read_jsonl(generations)  # read once: ids, and a rollout's transcripts
    generated_ids = [record["id"] for record in records]
    generated = {prompt_id_of(i) for i in generated_ids}
    refused_rel = rejected_path("generations", index)
    refused = store.read_jsonl(refused_rel) if store.exists(refused_rel) else []
    gen_rejected = [prompt_id_of(row["id"]) for row in refused]
    rollout = bool(prompts) and "turns" in prompts[0]
    found.rejected += len(set(gen_rejected) - generated) if rollout else len(gen_rejected)
    if sorted(generated | set(gen_rejected)) != sorted(prompt_ids) or (generated & set(gen_rejected)
                                                                        and not rollout):
        problems.append(f"{name} generations: prompts and generated + rejected ids differ")
    if rollout:
        problems += _transcript_problems(name, prompts, records, refused)
    validation = artifact_path("validation", index)
    if not store.exists(validation):
        return found.mark_missing(validation, len(generated))
    if store.read_json(validation)["status"] == "quarantine":
        found.quarantined, found.in_quarantine = len(generated), True
        return found
    sequences = artifact_path("sequences", index)
    if not store.exists(sequences):
        return found.mark_missing(sequences, len(generated))
    sequences_data = store.read_bytes(sequences)
    with_split = "split" in pq.read_schema(io.BytesIO(sequences_data)).names
    table = pq.read_table(io.BytesIO(sequences_data), columns=["id", "split"] if with_split else ["id"])
    seq_ids = table.column("id").to_pylist()
    splits = dict(zip(seq_ids, table.column("split").to_pylist(), strict=True)) if with_split else {}
    _check_once("sequences", name, seq_ids, problems)
    seq_rejected = _ids_of_jsonl(store, rejected_path("sequences", index))
    found.rejected += len({prompt_id_of(i) for i in seq_rejected} - {prompt_id_of(i) for i in seq_ids})
    if sorted(seq_ids + seq_rejected) != sorted(generated_ids):
        problems.append(f"{name} sequences: generated and sequence + rejected ids differ")
    final_ids = seq_ids
    if layout.hidden:
        index_rel = artifact_path("hidden_states", index)
        if not store.exists(index_rel):
            return found.mark_missing(index_rel, len({prompt_id_of(i) for i in seq_ids}))
        try:
            final_ids = [sample.id for sample in read_hidden_state_shard(store, index_rel)]
            read_final_norm(store, index_rel)
        except HiddenStatesError as error:
            problems.append(f"{name} hidden_states: {error}")
            return found
        if sorted(final_ids) != sorted(seq_ids):
            problems.append(f"{name} hidden_states: samples differ from the sequences")
        elif astray := _in_another_split(store.read_json(index_rel), splits):
            problems.append(f"{name} hidden_states: {len(astray)} samples are in parts of another split than their "
                            f"sequences say (e.g. {astray[0]}): run hidden_states again")
    found.accepted += len({prompt_id_of(i) for i in final_ids})
    found.samples += len(final_ids)
    return found


def _in_another_split(index: dict[str, Any], splits: dict[str, str]) -> list[str]:
    """Samples whose part is of another split than their sequence: held out, yet where training reads."""
    return [sample for sample, (part, _row) in index["samples"].items()
            if part_split(index["parts"][part]) != splits.get(sample, "train")]


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
