"""Stage 5: each sample's exact token sequence with the model's own think tokens, and its loss mask.

Two ways, cross-checked: (a) the server's own ids (prompt_token_ids + completion token_ids), exact by
construction; (b) rebuilt from text: the generation prompt rendered in the record's mode, then the start tag if
the template did not write it, the reasoning, the end tag id, the content and the end-of-turn id (in a mode
answered without reasoning, instant, the template closed the think block: the content and the end-of-turn id
only). The whole
conversation is never rendered through the template, which would drop the reasoning. `sequences.source` picks
the way ((a) where the server sent ids under `auto`); where the server sent ids, a sample of prompts
(`sequences.cross_check_rate`) is rebuilt from text too and the agreement recorded per sample. A text
rebuild is kept only when its token counts equal the server's usage counts, and a completion may carry at most
one think-end id: a sample not provably exact is rejected with its cause, never trained on. A completion without
one (the model ended its turn inside its reasoning, or max_tokens cut it there) is what the model did and is kept;
validation counts the first kind (`unclosed_reasoning`, quarantined above `validation.max_unclosed_reasoning_rate`).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import GenerationRecord, ShardRef, artifact_path, prompt_id_of, rejected_path
from eagle3_datagen.caching import StageOutput, handed_on
from eagle3_datagen.config import PipelineConfig, SequencesConfig
from eagle3_datagen.errors import UserError, retry_unless_user_error
from eagle3_datagen.holdout import NO_HOLDOUT, HoldoutSplit, Split
from eagle3_datagen.images import image_names
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.storage import RunLocation, marker_path
from eagle3_datagen.think_tokens import (
    ThinkTokenSpec,
    discover_think_tokens,
    encode_texts,
    load_tokenizer,
    render_generation_prompt,
    tool_calls_text,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("source", pa.string()),
    ("agrees", pa.bool_()),
    ("first_diff", pa.int32()),
    ("mode", pa.string()),
    ("split", pa.string()),
    ("turn", pa.int32()),
    ("has_tool_call", pa.bool_()),
    ("images", pa.list_(pa.string())),  # these two written only where a shard holds image prompts
    ("image_spans", pa.list_(pa.list_(pa.int32()))),  # [start, end) of each run of image tokens
])
_IMAGE_COLUMNS = ["images", "image_spans"]


CHUNK_RECORDS = 64  # records built at once: large enough for batch tokenizing, small enough to stay flat


class RebuildMismatch(UserError):
    """Too many text-rebuilt samples of a shard disagree with the server's token counts."""


@dataclass(frozen=True)
class Sequence:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str  # "server" or "text"
    agrees: bool | None  # None when only one way was built
    first_diff: int | None
    mode: str  # the mode the prompt was asked in (the profile's default mode in a run without a mix)
    split: Split = "train"  # held out (data.holdout) or not
    turn: int = 0  # a rollout's turn
    has_tool_call: bool = False  # the answer calls a tool
    images: tuple[str, ...] = ()  # the stored images its prompt shows, in order (their tokens are in input_ids)
    image_spans: tuple[tuple[int, int], ...] = ()  # where the server's ids hold image tokens: [start, end) runs


@dataclass
class ShardSequences:
    """A shard's sequences, its rejected samples with their reasons, and how its text rebuilds fared."""

    sequences: list[Sequence] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    rebuilt_from_text: int = 0
    count_mismatches: int = 0

    def reject(self, record_id: str, reason: str) -> None:
        self.rejected.append({"id": record_id, "stage": "sequences", "reason": reason})


def first_difference(a: list[int], b: list[int]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def completion_ids_from_text(
    reasoning_ids: list[int], content_ids: list[int], record: GenerationRecord, spec: ThinkTokenSpec,
    thinks: bool = True, calls_ids: list[int] | None = None,
) -> list[int]:
    """Start tag (if the model writes it), reasoning, end tag, content, tool calls, end of turn; truncation cuts
    the tail.

    In a mode that does not think (instant) the prompt closed the think block: content and end of turn only.
    """
    ids = ([] if spec.template_writes_start_tag or not thinks else [spec.start_id]) + reasoning_ids
    truncated = record["finish_reason"] == "length"
    if truncated and not record["content"]:
        return ids
    ids += [*([spec.end_id] if thinks else []), *content_ids, *(calls_ids or [])]
    return ids if truncated else [*ids, spec.end_of_turn_id]


def prompt_mask(prompt_ids: list[int], spec: ThinkTokenSpec, supervise_start_tag: bool) -> list[int]:
    mask = [0] * len(prompt_ids)
    if supervise_start_tag and spec.template_writes_start_tag and prompt_ids and prompt_ids[-1] == spec.start_id:
        mask[-1] = 1
    return mask


def think_end_miscount(completion_ids: list[int], spec: ThinkTokenSpec, thinks: bool = True) -> str | None:
    """Why a completion carries more think-end ids than its mode allows; else None.

    The model closes its reasoning once: a second think-end id is one the server's parser took out of the answer
    text (vLLM's kimi_k2 does), and a sequence would supervise both. None (reasoning never closed, or cut by
    max_tokens) is what the model did and stays exact; validation counts it. In a mode that does not think
    (instant) the template closed the think block: any think-end id in the completion means the model thought.
    """
    found = completion_ids.count(spec.end_id)
    if found <= (1 if thinks else 0):
        return None
    if not thinks:
        return (f"{found} think-end tokens ({spec.end_id}) in a completion of a mode answered without reasoning: "
                "the model thought though the mode's switch turned thinking off")
    return (f"{found} think-end tokens ({spec.end_id}) in the completion, not 1: the server's parser took one out "
            "of the answer text")


def count_mismatch(record: GenerationRecord, prompt_tokens: int, completion_tokens: int,
                   profile: ModelProfile) -> str | None:
    """The first plausible cause when a text rebuild's counts differ from the server's usage; None if they agree.

    Counts are what every OpenAI-protocol server returns; equal counts do not prove equal ids, but every way text
    loses a token seen so far (stripped whitespace, merges across tag boundaries, a template that renders the
    prompt differently) changes a count.
    """
    usage = record.get("usage") or {}
    served_prompt, served_completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if served_prompt is None or served_completion is None:
        return "the server reported no usage counts (prompt_tokens, completion_tokens) to check the text rebuild"
    if served_prompt != prompt_tokens:
        return (f"the prompt is {prompt_tokens} tokens here and {served_prompt} on the server: model.tokenizer or "
                "its chat template differs from the served model's")
    if served_completion == completion_tokens:
        return None
    counts = f"the server generated {served_completion} completion tokens, the text rebuilds {completion_tokens}"
    if 0 < served_completion - completion_tokens <= 2 and record["reasoning"] == record["reasoning"].rstrip():
        return f"{counts}: the parser stripped whitespace from the end of the reasoning (vLLM's kimi_k2 does)"
    if any(tag in record["reasoning"] + (record["content"] or "") for tag in (profile.think_start, profile.think_end)):
        return f"{counts}: a think tag inside the reasoning or answer text"
    return f"{counts}: tokens merge differently across the reasoning / {profile.think_end} / answer boundaries"


def _group_counts(records: list[GenerationRecord], completion_lengths: list[int]) -> list[int]:
    """Per record, the text-rebuilt completion tokens of its prompt's samples together: `usage` counts a request's
    samples (n > 1) together."""
    totals: dict[str, int] = {}
    for record, length in zip(records, completion_lengths, strict=True):
        totals[prompt_id_of(record["id"])] = totals.get(prompt_id_of(record["id"]), 0) + length
    return [totals[prompt_id_of(record["id"])] for record in records]


def cross_checked(prompt: str, rate: float) -> bool:
    """Whether a prompt's samples are in the cross-check sample: a pure function of its id, the same on any
    machine and in every run."""
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") < rate * 2**64


def _needs_text(record: GenerationRecord, settings: SequencesConfig) -> bool:
    """Whether a text record (not an image one: a rebuild cannot count an image's tokens) is rebuilt from text."""
    has_ids = record.get("prompt_token_ids") is not None and record.get("completion_token_ids") is not None
    if not has_ids:
        return settings.source != "server"
    return settings.source == "text" or cross_checked(prompt_id_of(record["id"]), settings.cross_check_rate)


def text_rebuilds(records: list[GenerationRecord], tokenizer: PreTrainedTokenizerBase, profile: ModelProfile,
                   spec: ThinkTokenSpec) -> list[tuple[list[int], list[int]] | None]:
    """(prompt ids, completion ids) rebuilt from each record's text in its own mode, batch-tokenized; None for a
    record whose tool calls the template renders where a rebuild cannot place them."""
    if not records:
        return []
    encode = lambda texts: encode_texts(tokenizer, texts)  # noqa: E731
    modes = [profile.mode_of(r) for r in records]
    prompt_ids = encode([render_generation_prompt(tokenizer, r["messages"], profile, mode, r.get("tools"))
                         for r, mode in zip(records, modes, strict=True)])
    reasoning_ids = encode([r["reasoning"] for r in records])
    content_ids = encode([r["content"] or "" for r in records])
    calls = [tool_calls_text(tokenizer, r, profile, spec) if r.get("tool_calls") else "" for r in records]
    calls_ids = encode([text or "" for text in calls])
    return [None if calls[i] is None else
            (prompt_ids[i], completion_ids_from_text(reasoning_ids[i], content_ids[i], record, spec,
                                                     profile.mode(modes[i]).thinks, calls_ids[i]))
            for i, record in enumerate(records)]


def build_sequences(
    records: list[GenerationRecord],
    tokenizer: PreTrainedTokenizerBase,
    profile: ModelProfile,
    spec: ThinkTokenSpec,
    settings: SequencesConfig,
    holdout: HoldoutSplit = NO_HOLDOUT,
) -> ShardSequences:
    """Sequences for a shard's records; samples that are not provably exact are rejected.

    Only the samples that need it are rebuilt from text: those without server ids, and the cross-check sample.
    """
    shown = [tuple(image_names(record["messages"])) for record in records]
    image_id = image_token_id(tokenizer, profile) if any(shown) else None
    need_text = [not images and _needs_text(record, settings) for record, images in zip(records, shown, strict=True)]
    rebuilt = iter(text_rebuilds([r for r, needed in zip(records, need_text, strict=True) if needed],
                                  tokenizer, profile, spec))
    text = [next(rebuilt) if needed else None for needed in need_text]
    # a request's samples are rebuilt together or not at all (same ids, same prompt): their sums stay whole
    request_completion_tokens = _group_counts(records, [len(built[1]) if built else 0 for built in text])
    shard = ShardSequences()
    for i, record in enumerate(records):
        server_prompt, server_completion = record.get("prompt_token_ids"), record.get("completion_token_ids")
        has_ids = server_prompt is not None and server_completion is not None
        mode = profile.mode_of(record)
        thinks = profile.mode(mode).thinks
        if not thinks and record["reasoning"].strip():
            shard.reject(record["id"], f"reasoning in a record of mode {mode!r}, answered without reasoning: the "
                                       "mode's switch was ignored")
            continue
        if settings.source == "server" and not has_ids:
            shard.reject(record["id"], "the server returned no token ids (sequences.source: server)")
            continue
        images = shown[i]
        if images and (not has_ids or settings.source == "text"):
            shard.reject(record["id"], "an image prompt is exact only in the server's own token ids (a text rebuild "
                                       "cannot count the tokens each image expanded to): serve with token ids and "
                                       "sequences.source auto or server")
            continue
        spans = token_runs(server_prompt, image_id) if images and image_id is not None else ()
        if images and len(spans) < len(images):
            shard.reject(record["id"], f"the server's prompt ids hold {len(spans)} runs of the image token "
                                       f"{profile.image_token!r} for {len(images)} images: is it the model's?")
            continue
        text_prompt, text_completion = text[i] or ([], [])
        compared = has_ids and text[i] is not None
        diff = first_difference(server_prompt + server_completion, text_prompt + text_completion) if compared \
            else None
        agrees = diff is None if compared else None
        if has_ids and settings.source != "text":
            prompt, completion, source = server_prompt, server_completion, "server"
        elif text[i] is None:
            shard.reject(record["id"], "the chat template renders this answer's tool calls where a text rebuild "
                                       "cannot place them: serve with token ids (sequences.source: auto)")
            continue
        else:
            prompt, completion, source = text_prompt, text_completion, "text"
            shard.rebuilt_from_text += 1
            mismatch = count_mismatch(record, len(text_prompt), request_completion_tokens[i], profile)
            if mismatch:
                shard.count_mismatches += 1
                shard.reject(record["id"], f"text rebuild disagrees with the server's counts: {mismatch}")
                continue
        if profile.single_token_tags and (miscount := think_end_miscount(completion, spec, thinks)):
            shard.reject(record["id"], miscount)
            continue
        ids = prompt + completion
        mask = prompt_mask(prompt, spec, settings.supervise_template_start_tag) + [1] * len(completion)
        if len(ids) > settings.max_seq_len:
            if settings.over_length == "drop":
                shard.reject(record["id"], f"{len(ids)} tokens > sequences.max_seq_len {settings.max_seq_len}")
                continue
            ids, mask = ids[: settings.max_seq_len], mask[: settings.max_seq_len]
        split = holdout.split_of(prompt_id_of(record["id"]), mode)
        shard.sequences.append(Sequence(record["id"], ids, mask, source, agrees, diff, mode, split,
                                        record.get("turn", 0), bool(record.get("tool_calls")), images,
                                        tuple(span for span in spans if span[1] <= len(ids))))
    return shard


def image_token_id(tokenizer: PreTrainedTokenizerBase, profile: ModelProfile) -> int:
    """The id of the profile's image token in the target's tokenizer (checked by `check_image_prompts` to be set)."""
    token_id = tokenizer.convert_tokens_to_ids(profile.image_token) if profile.image_token else None
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise UserError(f"the profile's image_token {profile.image_token!r} is not a token of the tokenizer: set the "
                        "model's own (e.g. <|media_pad|> for Kimi-K2.5, <|image_pad|> for Qwen-VL)")
    return token_id


def token_runs(ids: list[int], token: int) -> tuple[tuple[int, int], ...]:
    """[start, end) of each run of `token` in `ids`: where a server expanded an image's placeholder (one run per
    image, or per tile where the model cuts an image into tiles)."""
    runs: list[tuple[int, int]] = []
    for position, value in enumerate(ids):
        if value != token:
            continue
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return tuple(runs)


def to_table(sequences: list[Sequence]) -> pa.Table:
    return pa.table(
        {
            "id": [s.id for s in sequences],
            "input_ids": [s.input_ids for s in sequences],
            "loss_mask": [s.loss_mask for s in sequences],
            "num_tokens": [len(s.input_ids) for s in sequences],
            "source": [s.source for s in sequences],
            "agrees": [s.agrees for s in sequences],
            "first_diff": [s.first_diff for s in sequences],
            "mode": [s.mode for s in sequences],
            "split": [s.split for s in sequences],
            "turn": [s.turn for s in sequences],
            "has_tool_call": [s.has_tool_call for s in sequences],
            "images": [list(s.images) for s in sequences],
            "image_spans": [[list(span) for span in s.image_spans] for s in sequences],
        },
        schema=SCHEMA,
    )


def to_parquet(tables: list[pa.Table]) -> bytes:
    """The shard's file; a shard without image prompts has no `images` column, as before image prompts were read."""
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    if not any(pc.list_value_length(table.column("images")).to_pylist()):
        table = table.drop_columns(_IMAGE_COLUMNS)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def whole_prompts(records: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    """Records in chunks of about `size`, never splitting a prompt's samples (their usage counts are one
    request's), so a shard's records are never all parsed at once."""
    chunk: list[dict[str, Any]] = []
    for record in records:
        if len(chunk) >= size and prompt_id_of(record["id"]) != prompt_id_of(chunk[-1]["id"]):
            yield chunk
            chunk = []
        chunk.append(record)
    if chunk:
        yield chunk


@dataclass(frozen=True)
class SequenceSettings:
    """Everything that changes a shard's sequences, and so the stage's cache key."""

    profile: ModelProfile
    tokenizer: str
    tokenizer_fingerprint: str  # a tokenizer changed at the same path builds again
    sequences: SequencesConfig
    max_rebuild_mismatch_rate: float
    holdout: HoldoutSplit  # the prompt stage's choice: which samples are written as the held-out split

    @classmethod
    def from_config(cls, config: PipelineConfig, tokenizer_fingerprint: str, holdout: HoldoutSplit
                    ) -> SequenceSettings:
        return cls(config.profile, config.model.tokenizer, tokenizer_fingerprint, config.sequences,
                   config.validation.max_rebuild_mismatch_rate, holdout)


# Bump `version` when the sequences or rejections written for the same input and settings change.
SEQUENCES = StageOutput("sequences", version=1, record=lambda generations: artifact_path("sequences",
                                                                                         generations.index),
                        marked=True)


@task(name="build-sequences", task_run_name="{run.run_name}/build-sequences-{generations.index:05d}", retries=1,
      retry_condition_fn=retry_unless_user_error, persist_result=True,
      cache_policy=NO_CACHE)
def build_sequence_shard(generations: ShardRef, settings: SequenceSettings, run: RunLocation) -> ShardRef:
    """sequences/shard-NNNNN.parquet from a validated generations shard; a shard made under this key already is
    handed on as it is.

    Rejected samples are written first, so a shard stopped for too many count mismatches keeps its reasons.
    """
    store = run.store()
    key = SEQUENCES.key(generations=generations, settings=settings)
    if (done := SEQUENCES.done(store, generations, key)) is not None:
        return handed_on(ShardRef.of_marker(done), key)
    store.remove(marker_path(artifact_path("sequences", generations.index)))  # nothing vouches for a half-rewrite
    tok = load_tokenizer(settings.tokenizer)
    spec = discover_think_tokens(tok, settings.profile)
    max_rebuild_mismatch_rate = settings.max_rebuild_mismatch_rate
    tables, rejected, rebuilt_from_text, count_mismatches = [], [], 0, 0
    for records in whole_prompts(store.read_shard_records(generations), CHUNK_RECORDS):
        chunk = build_sequences(records, tok, settings.profile, spec, settings.sequences, settings.holdout)
        tables.append(to_table(chunk.sequences))
        rejected += chunk.rejected
        rebuilt_from_text += chunk.rebuilt_from_text
        count_mismatches += chunk.count_mismatches
    rejected_rel = rejected_path("sequences", generations.index)
    rejected_bytes = store.write_jsonl(rejected_rel, rejected) if rejected else 0
    if not rejected:
        store.remove(rejected_rel)  # an earlier attempt's
    rate = count_mismatches / rebuilt_from_text if rebuilt_from_text else 0.0
    if rate > max_rebuild_mismatch_rate:
        raise RebuildMismatch(
            f"shard {generations.index:05d}: {count_mismatches} of {rebuilt_from_text} text-rebuilt "
            f"samples disagree with the server's token counts ({rate:.1%} > validation.max_rebuild_mismatch_rate "
            f"{max_rebuild_mismatch_rate:.1%}): see {rejected_path('sequences', generations.index)} for each cause; "
            "use a server that returns token ids (vLLM >= 0.10.2) for exact sequences"
        )
    accepted = {prompt_id_of(i) for table in tables for i in table.column("id").to_pylist()}
    # what a structural `verify` reads instead of the shard
    account = {"accepted_prompts": len(accepted), "rejected_samples": len(rejected), "rejected_bytes": rejected_bytes,
               "rejected_prompts": len({prompt_id_of(row["id"]) for row in rejected} - accepted)}
    return store.write_shard_bytes("sequences", generations.index, to_parquet(tables),
                                   sum(table.num_rows for table in tables), stage_key=key,
                                   generations_sha256=generations.sha256,
                                   **account)
