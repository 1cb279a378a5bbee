"""The hidden-state format every reader shares: parts, their index and the final norm, checked on read.

Under `hidden_states/shard-NNNNN/` the extraction stage writes:
  part-NNNNN.safetensors  input_ids [T] int32, loss_mask [T] uint8, aux_hidden_states [T, 3H] (the three aux
                          layers concatenated in order), final_hidden_states [T, H] (before the final norm),
                          offsets [n+1] int64 (sample k is rows offsets[k]:offsets[k+1]); metadata names ids and
                          layers.
  final_norm.safetensors  the final RMSNorm's weight [H]; its eps in the metadata and the index.
  index.json              parts with checksums, sample id -> [part, row], layer ids in both conventions, model
                          fingerprint. Written last: its presence means the shard is complete.
The extraction stage writes it; export and verify read it, so it lives here, below the stages.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as _save_safetensors

from eagle3_datagen.artifacts import sha256_hex
from eagle3_datagen.errors import UserError
from eagle3_datagen.storage import RunStore

FORMAT = "eagle3-hidden-states/2"
FINAL_STATE = "before_norm"
FINAL_NORM_FILE = "final_norm.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PART_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states")


def save_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes that depend only on the tensors and metadata: the same on every machine and process.

    safetensors keeps metadata in a hash map whose order changes from process to process; the header is
    rewritten with its metadata sorted (same JSON, same length), so a shard extracted anywhere is the same file.
    """
    data = _save_safetensors(tensors, metadata=metadata)
    if not metadata:
        return data
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return data[:8] + text.ljust(size) + data[8 + size:]


class HiddenStatesError(UserError):
    """Hidden states that must not reach a trainer: non-finite values, wrong shapes, corrupted parts."""

@dataclass(frozen=True)
class Sample:
    """One sequence's training features, padding removed."""

    id: str
    input_ids: torch.Tensor  # [t] int32
    loss_mask: torch.Tensor  # [t] uint8
    aux_hidden_states: torch.Tensor  # [t, 3H], model dtype
    final_hidden_states: torch.Tensor  # [t, H], before the final norm

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in PART_TENSORS)

def final_rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm, computed as transformers does (fp32 statistics, scale in the states' dtype).

    Why: the stored final state is before the norm (what vLLM captures and speculators trains on); SpecForge
    trains on the state after it, which `lm_head` reads. Extraction checks this against the model's own norm.
    """
    hidden = states.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(states.dtype) * hidden.to(states.dtype)

def encode_part(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A part's file bytes: the one place the stored encoding of a part is decided."""
    return save_safetensors(tensors, metadata=metadata)


def read_part(store: RunStore, index_rel: str, part: dict) -> dict[str, torch.Tensor]:
    """One part of a finished shard, checked against the index's size and sha256, decoded to plain tensors."""
    rel = posixpath.join(posixpath.dirname(index_rel), part["file"])
    data = store.read_bytes(rel)
    if len(data) != part["bytes"] or sha256_hex(data) != part["sha256"]:
        raise HiddenStatesError(f"{rel} does not match its checksum in {index_rel}: re-run hidden_states")
    return load_safetensors(data)


def read_hidden_state_shard(store: RunStore, index_rel: str) -> Iterator[Sample]:
    """Every sample of a finished shard, part by part, each part checked against the index."""
    index = store.read_json(index_rel)
    ids_by_part: dict[int, list[str]] = {}
    for sample_id, (part, _row) in sorted(index["samples"].items(), key=lambda item: item[1]):
        ids_by_part.setdefault(part, []).append(sample_id)
    for part_number, part in enumerate(index["parts"]):
        tensors = read_part(store, index_rel, part)
        offsets = tensors["offsets"].tolist()
        ids = ids_by_part.get(part_number, [])
        if len(offsets) != len(ids) + 1 or offsets[0] != 0 or offsets[-1] != part["num_tokens"]:
            rel = posixpath.join(posixpath.dirname(index_rel), part["file"])
            raise HiddenStatesError(f"{rel}: offsets do not match the {len(ids)} samples listed in {index_rel}")
        for sample_id, start, end in zip(ids, offsets[:-1], offsets[1:], strict=True):
            yield Sample(sample_id, *(tensors[name][start:end] for name in PART_TENSORS))

def read_final_norm(store: RunStore, index_rel: str) -> tuple[torch.Tensor, float]:
    """The final norm's weight and eps stored beside a shard's parts, checked against the index."""
    entry = store.read_json(index_rel).get("final_norm")
    rel = posixpath.join(posixpath.dirname(index_rel), entry["file"]) if entry else None
    if rel is None or not store.exists(rel):
        raise HiddenStatesError(f"{index_rel}: its final norm is missing (an older version?): re-run hidden_states")
    data = store.read_bytes(rel)
    if sha256_hex(data) != entry["sha256"]:
        raise HiddenStatesError(f"{rel} does not match its checksum in {index_rel}: re-run hidden_states")
    return load_safetensors(data)["weight"], float(entry["eps"])
