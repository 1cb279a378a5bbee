"""Tiny random hidden-state targets and sequence shards, shared by the unit, integration and e2e tests."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.storage import RunStore

HIDDEN = 64
LAYERS = 8
AUX = [2, 4, 5]


def random_qwen3(**config: object) -> Qwen3ForCausalLM:
    """The tiny random 8-layer Qwen3 these tests extract from (seeded: the same weights every time)."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=192, vocab_size=512,
                                        **config))


def random_rows(lengths: list[int], seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (f"s{i}", torch.randint(0, 512, (n,), generator=gen).tolist(), [int(k >= n // 2) for k in range(n)])
        for i, n in enumerate(lengths)
    ]


def write_sequences(store: RunStore, shard: int, rows: list[tuple[str, list[int], list[int]]],
                    held_out: set[str] | None = None) -> ShardRef:
    """A shard with the sequences stage's schema (id, input_ids list<int32>, loss_mask list<int8>, + extras; with
    `held_out`, a split column holding those ids out), and the ShardRef the extraction stage reads it by."""
    columns = {
        "id": pa.array([r[0] for r in rows], pa.string()),
        "input_ids": pa.array([r[1] for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([r[2] for r in rows], pa.list_(pa.int8())),
        "num_tokens": pa.array([len(r[1]) for r in rows], pa.int32()),
    }
    if held_out is not None:
        columns["split"] = pa.array(["holdout" if r[0] in held_out else "train" for r in rows], pa.string())
    table = pa.table(columns)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return store.write_shard_bytes("sequences", shard, buffer.getvalue(), len(rows))
