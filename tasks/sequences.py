"""Stage 5: each sample's exact token sequence with the model's own think tokens, and its loss mask.

Two ways, cross-checked: (a) the server's own ids (prompt_token_ids + completion token_ids), exact by
construction; (b) rebuilt from text: the generation prompt rendered with thinking on, then the start tag if the
template did not write it, the reasoning, the end tag id, the content and the end-of-turn id. The whole
conversation is never rendered through the template, which would drop the reasoning. (a) wins; agreement is
recorded per sample.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from transformers import PreTrainedTokenizerBase

from eagle3_datagen.artifacts import ShardRef, rejected_path
from eagle3_datagen.caching import STAGE_CACHE
from eagle3_datagen.config import SequencesConfig
from eagle3_datagen.errors import retry_unless_user_error
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.storage import RunStore
from eagle3_datagen.think_tokens import (
    ThinkTokenSpec,
    discover_think_tokens,
    load_tokenizer,
    render_generation_prompt,
)

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("source", pa.string()),
    ("agrees", pa.bool_()),
    ("first_diff", pa.int32()),
])


@dataclass(frozen=True)
class Sequence:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str  # "server" or "text"
    agrees: bool | None  # None when only one way was possible
    first_diff: int | None


def first_difference(a: list[int], b: list[int]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def completion_ids_from_text(
    reasoning_ids: list[int], content_ids: list[int], record: dict[str, Any], spec: ThinkTokenSpec
) -> list[int]:
    """Start tag (if the model writes it), reasoning, end tag, content, end of turn; truncation cuts the tail."""
    ids = ([] if spec.template_writes_start_tag else [spec.start_id]) + reasoning_ids
    truncated = record["finish_reason"] == "length"
    if truncated and not record["content"]:
        return ids
    ids += [spec.end_id, *content_ids]
    return ids if truncated else [*ids, spec.end_of_turn_id]


def prompt_mask(prompt_ids: list[int], spec: ThinkTokenSpec, supervise_start_tag: bool) -> list[int]:
    mask = [0] * len(prompt_ids)
    if supervise_start_tag and spec.template_writes_start_tag and prompt_ids and prompt_ids[-1] == spec.start_id:
        mask[-1] = 1
    return mask


def build_sequences(
    records: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    profile: ModelProfile,
    spec: ThinkTokenSpec,
    settings: SequencesConfig,
) -> tuple[list[Sequence], list[dict[str, Any]]]:
    """Sequences for a shard's records (batch-tokenized), and the rejected ones with their reasons."""
    prompts = [render_generation_prompt(tokenizer, r["messages"], profile) for r in records]
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt_ids = encode(prompts) if prompts else []
    reasoning_ids = encode([r["reasoning"] for r in records]) if records else []
    content_ids = encode([r["content"] or "" for r in records]) if records else []
    sequences, rejected = [], []
    for i, record in enumerate(records):
        text_prompt = prompt_ids[i]
        text_completion = completion_ids_from_text(reasoning_ids[i], content_ids[i], record, spec)
        text_ids = text_prompt + text_completion
        server_prompt, server_completion = record.get("prompt_token_ids"), record.get("completion_token_ids")
        if server_prompt is not None and server_completion is not None:
            ids, cut, source = server_prompt + server_completion, len(server_prompt), "server"
            diff = first_difference(ids, text_ids)
            agrees: bool | None = diff is None
        else:
            ids, cut, source, diff, agrees = text_ids, len(text_prompt), "text", None, None
        mask = prompt_mask(ids[:cut], spec, settings.supervise_template_start_tag) + [1] * (len(ids) - cut)
        if len(ids) > settings.max_seq_len:
            if settings.over_length == "drop":
                rejected.append({"id": record["id"], "stage": "sequences",
                                 "reason": f"{len(ids)} tokens > sequences.max_seq_len {settings.max_seq_len}"})
                continue
            ids, mask = ids[: settings.max_seq_len], mask[: settings.max_seq_len]
        sequences.append(Sequence(record["id"], ids, mask, source, agrees, diff))
    return sequences, rejected


def to_parquet(sequences: list[Sequence]) -> bytes:
    table = pa.table(
        {
            "id": [s.id for s in sequences],
            "input_ids": [s.input_ids for s in sequences],
            "loss_mask": [s.loss_mask for s in sequences],
            "num_tokens": [len(s.input_ids) for s in sequences],
            "source": [s.source for s in sequences],
            "agrees": [s.agrees for s in sequences],
            "first_diff": [s.first_diff for s in sequences],
        },
        schema=SCHEMA,
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


@task(name="build-sequences", task_run_name="{run_name}/build-sequences-{generations.index:05d}", retries=1,
      retry_condition_fn=retry_unless_user_error, persist_result=True, cache_policy=STAGE_CACHE)
def build_sequence_shard(
    generations: ShardRef,
    profile: ModelProfile,
    tokenizer: str,
    tokenizer_fingerprint: str,
    settings: SequencesConfig,
    output_uri: str,
    run_name: str,
) -> ShardRef:
    """sequences/shard-NNNNN.parquet from a validated generations shard."""
    store = RunStore(output_uri, run_name)
    tok = load_tokenizer(tokenizer)
    spec = discover_think_tokens(tok, profile)
    sequences, rejected = build_sequences(store.read_shard_records(generations), tok, profile, spec, settings)
    if rejected:
        store.write_jsonl(rejected_path("sequences", generations.index), rejected)
    return store.write_shard_bytes("sequences", generations.index, to_parquet(sequences), len(sequences))
