"""Names of a run's artifacts and the small reference one stage hands to the next.

Layout under `{output_uri}/{run_name}/`:
  manifest.json                          config, fingerprints, think-token ids, per-shard per-stage status
  prompts/shard-NNNNN.jsonl              {id, messages, row, turn}
  prompts/summary.json                   rows read, accepted and rejected, prompts, shards
  generations/shard-NNNNN.jsonl          {id, messages, reasoning, content, finish_reason, ...}
  validation/shard-NNNNN.json            counts, rates, pass/quarantine
  sequences/shard-NNNNN.parquet          {id, input_ids, loss_mask, num_tokens, source, agrees}
  hidden_states/shard-NNNNN/part-NNNNN.safetensors + index.json
  hidden_states/shard-NNNNN/worker.json  host and process that extracted it, target loads in that process
  rejected/<stage>-shard-NNNNN.jsonl     {id?, row?, stage, reason}
  <stage>/shard-NNNNN.done.json          completion marker of a shard file: its ref, bytes, what it was made from,
                                         and the report's counts of it (a re-run reads markers, not shards)
  generations/timeline.jsonl             generation sampled twice a second: time, prompts finished, in flight
  report.md, plots/*.png                 the run report and its plots (and the drafts judged on its held-out split)
  evaluations/DRAFT/                     evaluation.json, evaluation.md, acceptance.png: `evaluate` of one draft
  lease/epoch-NNNNNNNN.json              who writes the run: one file per holder, created exclusively (lease.py)
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, NotRequired, TypedDict

import blake3

from eagle3_datagen.holdout import NO_HOLDOUT, HoldoutSplit

MANIFEST = "manifest.json"
# 2: `format_version` itself, and `totals` under machine keys (RunTotals); 1 (no key) had the report's labels
MANIFEST_FORMAT = 2
PROMPTS_SUMMARY = "prompts/summary.json"  # rows read, accepted and rejected by the prompt stage
PROMPTS_DONE = "prompts/done.json"  # the prompt stage's key and result, written after every shard
IMAGE_FILES = "prompts/image_files.json"  # the local image files the prompt stage read, as they were then
REJECTED_PATH = "rejected/prompts.jsonl"  # input rows that gave no prompt, with their reasons
TIMELINE = "generations/timeline.jsonl"  # generation's progress over time, for the report's latency plot
REPORT = "report.md"
EVALUATIONS = "evaluations"  # evaluations/DRAFT/: a draft judged on the held-out split (`evaluate`)
EVALUATIONS_HEADING = "\n## Draft evaluations\n"  # the report's last section, kept when the run re-renders it


LEASE_FOLDER = "lease"


def lease_file(epoch: int) -> str:
    """The file the run's `epoch`-th writer creates, exclusively, to hold the run (eagle3_datagen/lease.py)."""
    return f"{LEASE_FOLDER}/epoch-{epoch:08d}.json"


def holds_answers(rel: str) -> bool:
    """Whether a run-relative file or folder holds generation's answers (shards, markers, rejections, logs): a
    layout that drops its shard leaves it for generation, which adopts its answers first, then removes it."""
    return rel.startswith("generations/") or rel.startswith("rejected/generations-")


SHARD_STAGES = ("generations", "validation", "sequences", "hidden_states", "rejected")  # made per prompt shard
_SHARD_FILE = re.compile(r"(?:[a-z_]+-)?shard-(\d{5})(?:[./]|$)")


def evaluations_section(report: str) -> str:
    """What `evaluate` appended to a report ('' if nothing): a re-run that renders the report again keeps it."""
    at = report.find(EVALUATIONS_HEADING)
    return report[at:] if at >= 0 else ""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def shard_index_of(name: str) -> int | None:
    """The prompt shard a file or folder directly in a stage folder belongs to (`shard-00003.done.json`,
    `generations-shard-00003.jsonl` in `rejected/`), or None for the stage's own files (`settings.json`)."""
    match = _SHARD_FILE.match(name)
    return int(match.group(1)) if match else None


def artifact_path(stage: str, index: int) -> str:
    """Relative path of shard `index`'s output of `stage`."""
    suffix = {
        "prompts": ".jsonl",
        "generations": ".jsonl",
        "validation": ".json",
        "sequences": ".parquet",
        "hidden_states": "/index.json",
    }[stage]
    return f"{stage}/{shard_name(index)}{suffix}"


def worker_record_path(index: int) -> str:
    """Where extraction records the host and process that made shard `index`, and that process's target loads."""
    return f"hidden_states/{shard_name(index)}/worker.json"


def ui_key(run_name: str, what: str) -> str:
    """A Prefect artifact key scoped to one run, so one run's artifacts never replace another's.

    Keys allow lowercase letters, digits and dashes only: a run name that had to change to fit gets a short
    hash of itself, so `My_Run` and `my-run` stay apart.
    """
    fitted = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    if fitted != run_name:
        fitted += "-" + hashlib.sha256(run_name.encode()).hexdigest()[:6]
    return f"{fitted}-{what}"


def rejected_path(stage: str, index: int) -> str:
    return f"rejected/{stage}-{shard_name(index)}.jsonl"


def sample_id(prompt_id: str, sample: int, samples: int) -> str:
    """A training sample's id: the prompt's id, with a `:k` suffix when a prompt has several samples (n > 1)."""
    return prompt_id if samples == 1 else f"{prompt_id}:{sample}"


def prompt_id_of(sample: str) -> str:
    """The id of the prompt a sample (or a rejection) belongs to."""
    return sample.split(":", 1)[0]


def sha256_hex(*buffers: bytes | memoryview) -> str:
    """The sha256 of the buffers' bytes in turn (a file written as several, never joined)."""
    digest = hashlib.sha256()
    for buffer in buffers:
        digest.update(buffer)
    return digest.hexdigest()


ENCODING_THREADS = min(8, os.cpu_count() or 1)  # samples compressed, or blocks hashed, at once


def blake3_hex(*buffers: bytes | memoryview) -> str:
    """The BLAKE3 of the buffers' bytes in turn: a hidden-state part's checksum. One core hashes ~7.7 GB/s with it
    against ~2 GB/s with sha256 (`benchmarks/README.md`): it keeps up with a GPU's states on one thread, and a
    second would take a core from the write it runs beside."""
    digest = blake3.blake3()
    for buffer in buffers:
        digest.update(buffer)  # releases the GIL
    return digest.hexdigest()


def blocks_sha256_hex(*buffers: bytes | memoryview, block_bytes: int) -> str:
    """The sha256 of the sha256 digests of the buffers' bytes cut into blocks of `block_bytes`, the blocks hashed
    on several threads: the checksum of a part of format /4, still read and checked.

    The blocks follow the bytes, not the buffers, so a file written as buffers and read back whole agree.
    """
    blocks: list[list[memoryview]] = [[]]
    room = block_bytes
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while len(view):
            if room == 0:
                blocks.append([])
                room = block_bytes
            blocks[-1].append(view[:room])
            room -= len(blocks[-1][-1])
            view = view[len(blocks[-1][-1]):]

    def digest(pieces: list[memoryview]) -> bytes:
        block = hashlib.sha256()
        for piece in pieces:
            block.update(piece)  # releases the GIL: the threads hash at once
        return block.digest()

    if len(blocks) == 1:
        return hashlib.sha256(digest(blocks[0])).hexdigest()
    with ThreadPoolExecutor(max_workers=ENCODING_THREADS, thread_name_prefix="hash-blocks") as pool:
        return hashlib.sha256(b"".join(pool.map(digest, blocks))).hexdigest()


class GenerationRecord(TypedDict):
    """One line of `generations/shard-*.jsonl`: one generation event, with the ids the server saw and sent."""

    id: str  # the prompt's id; with n > 1 samples `#k`, a rollout's turn `:turnK` (`prompt_id_of` strips both)
    messages: list[dict[str, Any]]  # what was sent: the system and user messages, a rollout's history
    reasoning: str
    content: str
    finish_reason: str | None
    reasoning_source: str  # the response field the reasoning came from, "inline", or "none"
    prompt_token_ids: list[int] | None  # the server's; None where it returns none (the text rebuild applies)
    completion_token_ids: list[int] | None
    usage: dict[str, Any]
    mode: NotRequired[str]  # a run with a mix of thinking modes
    tools: NotRequired[list[dict[str, Any]]]  # the tools the request offered
    tool_calls: NotRequired[list[dict[str, Any]]]  # as the served tool parser read them
    turn: NotRequired[int]  # a rollout's generation event, and its user turn
    user_turn: NotRequired[int]
    ended: NotRequired[str]  # a rollout's last record: how its conversation ended


@dataclass(frozen=True)
class ShardRef:
    """One shard's artifact of one stage: where it is, how many records, and its content hash.

    The hash makes the next stage's cache key follow the content, not the file name.
    """

    stage: str
    index: int
    path: str
    num_records: int
    sha256: str

    @classmethod
    def of_marker(cls, marker: dict[str, Any]) -> ShardRef:
        """The reference a shard's completion marker vouches for."""
        return cls(*(marker[name] for name in ("stage", "index", "path", "num_records", "sha256")))


@dataclass(frozen=True)
class PromptLoadResult:
    """The prompt shards in order, how many source rows were read, accepted and rejected, and which prompts are
    held out."""

    shards: list[ShardRef]
    rows: int
    accepted: int
    rejected: int
    holdout: HoldoutSplit = NO_HOLDOUT
    images: int = 0  # distinct images stored in the run
    image_prompts: int = 0  # prompts that show at least one
    images_shown: int = 0  # images in all prompts, each time it is shown

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "holdout": self.holdout.model_dump()}

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> PromptLoadResult:
        return cls(**{**record, "shards": [ShardRef(**ref) for ref in record["shards"]],
                      "holdout": HoldoutSplit.model_validate(record["holdout"])})


@dataclass(frozen=True)
class GenerationOutcome:
    """What the flow takes from generation: the shards it finished, and why it ended short (None: it did not)."""

    shards: list[ShardRef]
    error: BaseException | None = None


@dataclass(frozen=True)
class RunTotals:
    """A run's totals: the manifest's `totals` (these keys) and the report's (`labelled`)."""

    input_rows: int
    rejected: int
    shards: int
    shards_finished: int
    records_generated: int
    reasoning_coverage: float  # share of the records of modes that think that came with reasoning
    sequence_tokens: int
    hidden_state_bytes: int
    conversations: int | None = None  # rollouts only
    conversations_answered_in_full: int | None = None
    samples_with_tool_calls: int | None = None
    fp8_fidelity: str | None = None  # shards stored in fp8: the worst cosines to the model-dtype states
    images: int | None = None  # image prompts only: distinct images stored
    images_per_image_prompt: float | None = None
    image_tokens_per_image_sample: float | None = None  # as the server expanded them

    def as_manifest(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def labelled(self) -> dict[str, Any]:
        """The report's rows: words for the keys, the coverage as a percentage."""
        labels = {"hidden_state_bytes": "hidden-state bytes", "fp8_fidelity": "fp8 cosine to the model-dtype states"}
        return {labels.get(key, key.replace("_", " ")): f"{value:.1%}" if key == "reasoning_coverage" else value
                for key, value in self.as_manifest().items()}
