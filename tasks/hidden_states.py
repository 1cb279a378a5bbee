"""Stage 6: the target model's hidden states for every training sequence (transformers backend).

Output per shard, under `hidden_states/shard-NNNNN/`:
  part-NNNNN.safetensors  input_ids [T] int32, loss_mask [T] uint8, aux_hidden_states [T, 3H] (the three aux
                          layers concatenated in order), final_hidden_states [T, H] (after the final norm), offsets
                          [n+1] int64 (sample k is rows offsets[k]:offsets[k+1]); metadata names ids and layers.
  index.json              parts with checksums, sample id -> [part, row], layer ids in both conventions, model
                          fingerprint. Written last: its presence means the shard is complete.
"""

from __future__ import annotations

import itertools
import json
import posixpath
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoConfig, AutoModelForCausalLM

from eagle3_datagen.artifacts import ShardRef, artifact_path, sha256_hex, shard_name
from eagle3_datagen.config import ConfigError, HiddenStatesConfig
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.storage import RunStore

FORMAT = "eagle3-hidden-states/1"
FINAL_STATE = "after_norm"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_PART_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states")


class HiddenStatesError(RuntimeError):
    """Hidden states that must not reach a trainer: non-finite values, wrong shapes, corrupted parts."""


@dataclass(frozen=True)
class TokenSequence:
    """One row of the sequences stage: what the target reads and what the trainer supervises."""

    id: str
    input_ids: torch.Tensor  # [t] int32
    loss_mask: torch.Tensor  # [t] uint8


@dataclass(frozen=True)
class Sample:
    """One sequence's training features, padding removed."""

    id: str
    input_ids: torch.Tensor  # [t] int32
    loss_mask: torch.Tensor  # [t] uint8
    aux_hidden_states: torch.Tensor  # [t, 3H], model dtype
    final_hidden_states: torch.Tensor  # [t, H], after the final norm

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in _PART_TENSORS)


@dataclass(frozen=True)
class TargetModel:
    """The target's base model (decoder layers + final norm, no lm_head: logits are never needed here)."""

    path: str
    base: torch.nn.Module
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    fingerprint: str


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features as input-to-layer ids (= transformers' hidden_states index)."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layers(configured: Sequence[int] | None, num_layers: int) -> list[int]:
    """The configured ids, or the default, refused unless they are three increasing inputs of real layers.

    Id 0 is the embedding output and id N would be after the final norm (the final state), so 1..N-1.
    """
    layers = list(configured) if configured is not None else default_aux_layers(num_layers)
    if len(layers) == 3 and layers == sorted(set(layers)) and all(1 <= i < num_layers for i in layers):
        return layers
    what = f"{layers} is invalid" if configured is not None else f"the default {layers} does not fit"
    raise ConfigError(
        f"config key hidden_states.aux_layers: {what}; give 3 increasing input-to-layer ids in "
        f"1..{num_layers - 1} (the valid range for this {num_layers}-layer target)"
    )


def target_num_layers(path: str) -> int:
    """Decoder layer count from the config alone, to validate aux layers before loading any weights."""
    return AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers


@lru_cache(maxsize=1)
def load_target_model(path: str, dtype: str, device_map: str) -> TargetModel:
    """Load once per process (a run has many shards); one entry, so a new target replaces the old in memory."""
    # "cpu" is where from_pretrained loads anyway; any device_map at all would make accelerate a requirement.
    placement = {} if device_map == "cpu" else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], **placement).eval()
    base = model.get_decoder()
    if not (hasattr(base, "layers") and hasattr(base, "norm")):
        raise HiddenStatesError(f"{path}: {type(base).__name__} has no .layers/.norm to hook; unsupported model")
    config = model.config.get_text_config()
    return TargetModel(
        path=path,
        base=base,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=base.get_input_embeddings().num_embeddings,
        dtype=_DTYPES[dtype],
        fingerprint=fingerprint(path),
    )


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence positions so batch_size x longest stays within max_tokens; one too long runs alone.

    Longest first: similar lengths waste little padding, and an out-of-memory shows on the first batch.
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def capture_batch(
    target: TargetModel, aux_layers: Sequence[int], sequences: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward pass over a right-padded batch; per sequence (aux [t, 3H], final [t, H]) on CPU, unpadded.

    Hooks keep only the needed states: output_hidden_states would hold all N+1 of them for the whole batch.
    """
    base = target.base
    longest = max(len(seq) for seq in sequences)
    input_ids = torch.zeros((len(sequences), longest), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1

    captured: dict[int, torch.Tensor] = {}

    def keep_input(layer_id: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    def keep_final(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        captured[target.num_layers] = output

    handles = [base.layers[i].register_forward_pre_hook(keep_input(i), with_kwargs=True) for i in aux_layers]
    handles.append(base.norm.register_forward_hook(keep_final))
    device = base.get_input_embeddings().weight.device
    try:
        with torch.inference_mode():
            base(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    expected = (len(sequences), longest, target.hidden_size)
    for layer_id, states in captured.items():
        if tuple(states.shape) != expected or states.dtype != target.dtype:
            raise HiddenStatesError(
                f"layer {layer_id} state is {tuple(states.shape)} {states.dtype}, expected {expected} "
                f"{target.dtype} from the model config"
            )
    final = captured[target.num_layers]
    return [
        (
            torch.cat([captured[i][row, : len(seq)].cpu() for i in aux_layers], dim=-1),
            final[row, : len(seq)].to("cpu", copy=True),
        )
        for row, seq in enumerate(sequences)
    ]


def read_sequences(store: RunStore, rel: str, vocab_size: int) -> list[TokenSequence]:
    """The sequences shard, checked for what would break a forward pass or the index (ids, lengths, vocab)."""
    with store.open(rel, "rb") as handle:
        table = pq.read_table(handle, columns=["id", "input_ids", "loss_mask"])
    ids = table.column("id").to_pylist()
    input_ids = _list_column(table.column("input_ids"), torch.int32)
    loss_masks = _list_column(table.column("loss_mask"), torch.uint8)
    sequences: list[TokenSequence] = []
    seen: set[str] = set()
    for sample_id, tokens, mask in zip(ids, input_ids, loss_masks, strict=True):
        if sample_id in seen:
            raise HiddenStatesError(f"{rel}: sample id {sample_id!r} appears twice")
        if len(tokens) == 0 or len(tokens) != len(mask):
            raise HiddenStatesError(f"{rel}: sample {sample_id!r} has {len(tokens)} tokens, {len(mask)} mask values")
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
            raise HiddenStatesError(
                f"{rel}: sample {sample_id!r} has token ids outside the target's vocabulary of {vocab_size}"
                " (tokenized for another model?)"
            )
        seen.add(sample_id)
        sequences.append(TokenSequence(sample_id, tokens, mask))
    return sequences


def _list_column(column: pa.ChunkedArray, dtype: torch.dtype) -> list[torch.Tensor]:
    """A list<int> column as one tensor per row, without a Python int per token."""
    array = column.combine_chunks()
    lengths = array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).tolist()
    flat = torch.tensor(array.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    return list(torch.split(flat, lengths))


class _PartWriter:
    """Buffers samples and writes a part as soon as it holds part_size_bytes, so a shard never sits in memory."""

    def __init__(self, store: RunStore, folder: str, part_size_bytes: int, metadata: dict[str, str]) -> None:
        self.store, self.folder, self.part_size_bytes, self.metadata = store, folder, part_size_bytes, metadata
        self.parts: list[dict[str, Any]] = []
        self.rows: dict[str, list[int]] = {}
        self._pending: list[Sample] = []
        self._pending_bytes = 0

    def add(self, sample: Sample) -> None:
        for name in ("aux_hidden_states", "final_hidden_states"):
            if not torch.isfinite(getattr(sample, name)).all():
                raise HiddenStatesError(f"sample {sample.id!r}: {name} has NaN or Inf values")
        self._pending.append(sample)
        self._pending_bytes += sample.nbytes
        if self._pending_bytes >= self.part_size_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        samples, self._pending, self._pending_bytes = self._pending, [], 0
        ids = [sample.id for sample in samples]
        lengths = [len(sample.input_ids) for sample in samples]
        tensors = {name: torch.cat([getattr(sample, name) for sample in samples]) for name in _PART_TENSORS}
        del samples
        tensors["offsets"] = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
        data = save_safetensors(tensors, metadata={**self.metadata, "sample_ids": json.dumps(ids)})
        del tensors
        name = f"part-{len(self.parts):05d}.safetensors"
        self.store.write_bytes(posixpath.join(self.folder, name), data)
        for row, sample_id in enumerate(ids):
            self.rows[sample_id] = [len(self.parts), row]
        part = {"file": name, "num_samples": len(ids), "num_tokens": sum(lengths)}
        self.parts.append({**part, "bytes": len(data), "sha256": sha256_hex(data)})


def extract_shard(
    store: RunStore, shard_index: int, target: TargetModel, settings: HiddenStatesConfig
) -> dict[str, Any]:
    """Stage 6 for one shard, without Prefect: parts as they fill, then the index; returns the index."""
    aux_layers = resolve_aux_layers(settings.aux_layers, target.num_layers)
    sequences = read_sequences(store, artifact_path("sequences", shard_index), target.vocab_size)
    folder = f"hidden_states/{shard_name(shard_index)}"
    store.remove(folder)  # the old index goes first: a crash below must not leave it vouching for new parts
    layer_ids = {"input_to_layer": aux_layers, "output_of_layer": [i - 1 for i in aux_layers]}
    writer = _PartWriter(
        store,
        folder,
        settings.part_size_bytes,
        {"format": FORMAT, "aux_layers": json.dumps(layer_ids), "final_state": FINAL_STATE},
    )
    for batch in plan_batches([len(seq.input_ids) for seq in sequences], settings.max_tokens_per_batch):
        states = capture_batch(target, aux_layers, [sequences[i].input_ids for i in batch])
        for i, (aux, final) in zip(batch, states, strict=True):
            seq = sequences[i]
            writer.add(Sample(seq.id, seq.input_ids, seq.loss_mask, aux, final))
    writer.flush()
    index = {
        "format": FORMAT,
        "shard": shard_index,
        "num_samples": len(writer.rows),
        "num_tokens": sum(part["num_tokens"] for part in writer.parts),
        "hidden_size": target.hidden_size,
        "num_layers": target.num_layers,
        "dtype": settings.dtype,
        "aux_layers": layer_ids,
        "final_state": FINAL_STATE,
        "model": {"path": target.path, "fingerprint": target.fingerprint},
        "parts": writer.parts,
        "samples": writer.rows,
    }
    store.write_json(artifact_path("hidden_states", shard_index), index)
    return index


def read_hidden_state_shard(store: RunStore, index_rel: str) -> Iterator[Sample]:
    """Every sample of a finished shard, part by part, each part checked against the index's size and sha256."""
    index = store.read_json(index_rel)
    folder = posixpath.dirname(index_rel)
    ids_by_part: dict[int, list[str]] = {}
    for sample_id, (part, _row) in sorted(index["samples"].items(), key=lambda item: item[1]):
        ids_by_part.setdefault(part, []).append(sample_id)
    for part_number, part in enumerate(index["parts"]):
        rel = posixpath.join(folder, part["file"])
        data = store.read_bytes(rel)
        if len(data) != part["bytes"] or sha256_hex(data) != part["sha256"]:
            raise HiddenStatesError(f"{rel} does not match its checksum in {index_rel}: re-run hidden_states")
        tensors = load_safetensors(data)
        offsets = tensors["offsets"].tolist()
        ids = ids_by_part.get(part_number, [])
        if len(offsets) != len(ids) + 1 or offsets[0] != 0 or offsets[-1] != part["num_tokens"]:
            raise HiddenStatesError(f"{rel}: offsets do not match the {len(ids)} samples listed in {index_rel}")
        for sample_id, start, end in zip(ids, offsets[:-1], offsets[1:], strict=True):
            yield Sample(sample_id, *(tensors[name][start:end] for name in _PART_TENSORS))


@task(name="extract-hidden-states", retries=1, persist_result=True, cache_policy=INPUTS + TASK_SOURCE)
def extract_hidden_states(
    sequences: ShardRef,
    settings: HiddenStatesConfig,
    target_model: str,
    target_fingerprint: str,
    output_uri: str,
    run_name: str,
) -> ShardRef:
    """Prefect stage 6 for one shard; the target stays loaded across the shards a process runs.

    `target_fingerprint` is part of the cache key: new weights at the same path extract again.
    """
    if settings.backend != "transformers":
        raise ConfigError(f"config key hidden_states.backend: {settings.backend!r} extracts nothing")
    resolve_aux_layers(settings.aux_layers, target_num_layers(target_model))  # before loading any weights
    target = load_target_model(target_model, settings.dtype, settings.device_map)
    store = RunStore(output_uri, run_name)
    index = extract_shard(store, sequences.index, target, settings)
    rel = artifact_path("hidden_states", sequences.index)
    return ShardRef(
        stage="hidden_states",
        index=sequences.index,
        path=rel,
        num_records=index["num_samples"],
        sha256=sha256_hex(store.read_bytes(rel)),
    )
