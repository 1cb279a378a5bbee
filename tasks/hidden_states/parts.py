"""What both backends share: the sequences a shard reads, and the parts and index it writes as samples come."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import posixpath
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3_datagen.artifacts import ShardRef, artifact_path, sha256_hex
from eagle3_datagen.config import Compression, HiddenStatesConfig
from eagle3_datagen.hidden_state_format import (
    FINAL_NORM_FILE,
    FINAL_STATE,
    FORMAT,
    PART_TENSORS,
    HiddenStatesError,
    Sample,
    cosine_summary,
    encode_part,
    part_checksum,
    save_safetensors,
)
from eagle3_datagen.holdout import SPLITS, Split
from eagle3_datagen.storage import RunStore
from tasks.hidden_states.targets import TargetInfo, resolve_aux_layers


@dataclass(frozen=True)
class TokenSequence:
    """One row of the sequences stage: what the target reads and what the trainer supervises."""

    id: str
    input_ids: torch.Tensor  # [t] int32
    loss_mask: torch.Tensor  # [t] uint8
    mode: str | None = None  # the mode its prompt was asked in; None in sequences without a mode column
    split: Split = "train"  # held out, or not (sequences without a split column hold no held-out samples)
    images: tuple[str, ...] = ()  # the stored images the sample's image tokens stand for, in order
    image_spans: list[list[int]] = field(default_factory=list)  # [start, end) of each run of image tokens

def read_sequences(store: RunStore, ref: ShardRef, vocab_size: int) -> list[TokenSequence]:
    """The sequences shard (checksum checked), and what would break a forward pass or the index (ids, lengths,
    vocab)."""
    rel = ref.path
    data = store.read_shard(ref)
    optional = [name for name in ("mode", "split", "images", "image_spans")
                if name in pq.read_schema(io.BytesIO(data)).names]
    table = pq.read_table(io.BytesIO(data), columns=["id", "input_ids", "loss_mask", *optional])
    ids = table.column("id").to_pylist()
    modes = table.column("mode").to_pylist() if "mode" in optional else [None] * len(ids)
    splits = table.column("split").to_pylist() if "split" in optional else ["train"] * len(ids)
    images = table.column("images").to_pylist() if "images" in optional else [()] * len(ids)
    spans = table.column("image_spans").to_pylist() if "image_spans" in optional else [[]] * len(ids)
    input_ids = _list_column(table.column("input_ids"), torch.int32)
    loss_masks = _list_column(table.column("loss_mask"), torch.uint8)
    sequences: list[TokenSequence] = []
    seen: set[str] = set()
    for sample_id, tokens, mask, mode, split, shown, where in zip(ids, input_ids, loss_masks, modes, splits, images,
                                                                  spans, strict=True):
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
        sequences.append(TokenSequence(sample_id, tokens, mask, mode, split, tuple(shown), where))
    return sequences

def _list_column(column: pa.ChunkedArray, dtype: torch.dtype) -> list[torch.Tensor]:
    """A list<int> column as one tensor per row, without a Python int per token."""
    array = column.combine_chunks()
    lengths = array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).tolist()
    flat = torch.tensor(array.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    return list(torch.split(flat, lengths))

class _PartWriter:
    """Buffers samples and writes a part as soon as it holds part_size_bytes, so a shard never sits in memory.

    A part is encoded and written on a thread of its own while the next one fills, and hashed while it is written:
    hashing and writing release the GIL, so on a GPU they overlap the forward passes, and each other, instead of
    adding to them. The backends check the states are finite where they are made, before this. One part at a
    time, so at most two are in memory. Under fp8 it keeps every stored row's cosine to the model-dtype row (4
    floats per token) for the index. Held-out samples go to parts of their own (marked `"split": "holdout"` in the
    index), so training and evaluation each read only their own parts.
    """

    def __init__(self, store: RunStore, folder: str, part_size_bytes: int, metadata: dict[str, str],
                 compression: Compression) -> None:
        self.store, self.folder, self.part_size_bytes, self.metadata = store, folder, part_size_bytes, metadata
        self.compression = compression
        self.parts: list[dict[str, Any]] = []
        self.rows: dict[str, list[int]] = {}
        self.cosines: list[torch.Tensor] = []
        self._pending: dict[Split, list[Sample]] = {split: [] for split in SPLITS}
        self._pending_bytes: dict[Split, int] = dict.fromkeys(SPLITS, 0)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hidden-states-parts")
        self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hidden-states-beside")
        self._writing: Future[object] | None = None
        self._started: Future[object] | None = None

    def __enter__(self) -> _PartWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._thread.shutdown(wait=True)  # a part being written ends with the shard, never after it
        self._beside.shutdown(wait=True)

    def first(self, work: Callable[[], object]) -> None:
        """Run `work` before any part is written, beside the first part's filling and encoding: storage round
        trips that would otherwise come before them."""
        self._started = self._beside.submit(work)

    def add(self, sample: Sample, split: Split) -> None:
        self._pending[split].append(sample)
        self._pending_bytes[split] += sample.nbytes
        if self._pending_bytes[split] >= self.part_size_bytes:
            self.flush(split)

    def flush(self, split: Split) -> None:
        """Hand the split's samples so far to the writing thread, once the part before them is written."""
        samples = self._pending[split]
        if not samples:
            return
        self._pending[split], self._pending_bytes[split] = [], 0
        self.wait()
        number = len(self.parts)
        for row, sample in enumerate(samples):
            self.rows[sample.id] = [number, row]
        self._writing = self._thread.submit(self._write, number, samples, split)

    def wait(self) -> None:
        """Until the part being written is written; what stopped it is raised here."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()
        if self._started is not None:
            self._started.result()

    def _write(self, number: int, samples: list[Sample], split: Split) -> None:
        ids = [sample.id for sample in samples]
        lengths = [len(sample.input_ids) for sample in samples]
        pieces = {name: [getattr(sample, name) for sample in samples] for name in PART_TENSORS}
        pieces["offsets"] = [torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)]
        encoded = encode_part(pieces, {**self.metadata, "sample_ids": json.dumps(ids)}, self.compression)
        name = f"part-{number:05d}.safetensors"
        checksum = self._beside.submit(part_checksum, encoded.buffers)  # hashed while the bytes are written
        if self._started is not None:
            self._started.result()
        self.store.write_buffers(posixpath.join(self.folder, name), encoded.buffers)
        if encoded.cosines is not None:
            self.cosines.append(encoded.cosines)
        self.parts.append({"file": name, "num_samples": len(ids), "num_tokens": sum(lengths),
                           "bytes": sum(buffer.nbytes for buffer in encoded.buffers),
                           **checksum.result(), **({"split": split} if split != "train" else {})})


def norm_file(target: TargetInfo) -> bytes:
    """The final norm's weight, which every reader of the final state applies (its eps in the metadata)."""
    return save_safetensors({"weight": target.norm_weight.contiguous()}, metadata={"eps": repr(target.norm_eps)})


def start_folder(store: RunStore, index_rel: str, norm: bytes) -> None:
    """The old index goes first: a crash after this must not leave it vouching for new parts (which replace the
    old ones in place; the rest goes before the new index)."""
    store.remove(index_rel)
    store.write_bytes(posixpath.join(posixpath.dirname(index_rel), FINAL_NORM_FILE), norm)


def write_shard(
    store: RunStore,
    sequences_ref: ShardRef,
    target: TargetInfo,
    settings: HiddenStatesConfig,
    samples: Callable[[list[TokenSequence], list[int]], Generator[Sample, None, None]],
    stage_key: str = "",
) -> dict[str, Any]:
    """What both backends share: read the sequences, pack `samples(sequences, aux_layers)` into parts as they come,
    then write the index (with the `stage_key` the shard was made under).
    """
    aux_layers = resolve_aux_layers(settings.aux_layers, target.num_layers)
    shard_index = sequences_ref.index
    index_rel = artifact_path("hidden_states", shard_index)
    folder = posixpath.dirname(index_rel)
    layer_ids = {"input_to_layer": aux_layers, "output_of_layer": [i - 1 for i in aux_layers]}
    metadata = {"format": FORMAT, "aux_layers": json.dumps(layer_ids), "final_state": FINAL_STATE}
    norm = norm_file(target)
    with _PartWriter(store, folder, settings.part_size_bytes, metadata, settings.compression) as writer:
        writer.first(lambda: start_folder(store, index_rel, norm))
        sequences = read_sequences(store, sequences_ref, target.vocab_size)
        split_of = {sequence.id: sequence.split for sequence in sequences}
        with contextlib.closing(samples(sequences, aux_layers)) as stream:  # closed now, also when add() raises
            for sample in stream:
                writer.add(sample, split_of[sample.id])
        for split in SPLITS:
            writer.flush(split)
        writer.wait()
    # what an earlier extraction of the shard left that the new index will not name: its later parts, say
    store.remove_all_but(folder, {FINAL_NORM_FILE, *(part["file"] for part in writer.parts)})
    index = {
        "format": FORMAT,
        "shard": shard_index,
        "sequences_sha256": sequences_ref.sha256,  # what it was made from
        **({"stage_key": stage_key} if stage_key else {}),
        "backend": settings.backend,
        "num_samples": len(writer.rows),
        "num_tokens": sum(part["num_tokens"] for part in writer.parts),
        "hidden_size": target.hidden_size,
        "num_layers": target.num_layers,
        "dtype": settings.dtype,
        "compression": settings.compression,
        **({"fp8_cosine": cosine_summary(torch.cat(writer.cosines))} if writer.cosines else {}),
        "aux_layers": layer_ids,
        "final_state": FINAL_STATE,
        "final_norm": {"file": FINAL_NORM_FILE, "eps": target.norm_eps, "sha256": sha256_hex(norm)},
        "model": {"path": target.path, "fingerprint": target.fingerprint},
        "parts": writer.parts,
        "samples": writer.rows,
        "sample_modes": {s.id: s.mode for s in sequences if s.id in writer.rows and s.mode is not None},
        **({"image_spans": spans} if (spans := {s.id: s.image_spans for s in sequences if s.image_spans}) else {}),
    }
    store.write_json(index_rel, index)
    return index
