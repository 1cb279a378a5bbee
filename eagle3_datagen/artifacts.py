"""Names of a run's artifacts and the small reference one stage hands to the next.

Layout under `{output_uri}/{run_name}/`:
  manifest.json                          config, fingerprints, think-token ids, per-shard per-stage status
  prompts/shard-NNNNN.jsonl              {id, messages, row, turn}
  prompts/summary.json                   rows read, accepted and rejected, prompts, shards
  generations/shard-NNNNN.jsonl          {id, messages, reasoning, content, finish_reason, ...}
  validation/shard-NNNNN.json            counts, rates, pass/quarantine
  sequences/shard-NNNNN.parquet          {id, input_ids, loss_mask, num_tokens, source, agrees}
  hidden_states/shard-NNNNN/part-NNNNN.safetensors + index.json
  rejected/<stage>-shard-NNNNN.jsonl     {id?, row?, stage, reason}
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MANIFEST = "manifest.json"
PROMPTS_SUMMARY = "prompts/summary.json"  # rows read, accepted and rejected by the prompt stage
REJECTED_PATH = "rejected/prompts.jsonl"  # input rows that gave no prompt, with their reasons


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


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


def rejected_path(stage: str, index: int) -> str:
    return f"rejected/{stage}-{shard_name(index)}.jsonl"


def sample_id(prompt_id: str, sample: int, samples: int) -> str:
    """A training sample's id: the prompt's id, with a `:k` suffix when a prompt has several samples (n > 1)."""
    return prompt_id if samples == 1 else f"{prompt_id}:{sample}"


def prompt_id_of(sample: str) -> str:
    """The id of the prompt a sample (or a rejection) belongs to."""
    return sample.split(":", 1)[0]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
