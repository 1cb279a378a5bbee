"""Stage 4: per-shard checks of the generations; a shard that fails its thresholds is quarantined, loudly.

A quarantined shard keeps its records (marked in validation/shard-NNNNN.json) but never flows on into the
training set, and its task fails so the run says so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import GenerationRecord, ShardRef, artifact_path, rejected_path, shard_name, ui_key
from eagle3_datagen.caching import StageOutput, handed_on
from eagle3_datagen.config import PipelineConfig, ValidationConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.storage import RunLocation, RunStore
from eagle3_datagen.think_tokens import ThinkTokenSpec, discover_think_tokens, load_tokenizer, tool_calls_text


class ShardQuarantined(UserError):
    """A shard whose generations broke a validation threshold."""


@dataclass(frozen=True)
class ShardValidation:
    index: int
    records: int
    empty_reasoning: int
    empty_content: int
    truncated: int
    leaked_tags: int
    duplicate_ids: int
    token_text_mismatch: int
    think_end_miscount: int  # completions whose ids carry more than one think-end id (a parser changed the text)
    unclosed_reasoning: int  # completions that ended without closing their reasoning (no think-end id)
    reasoning_split_inline: int
    status: str
    reasons: list[str] = field(default_factory=list)
    unexpected_reasoning: int = 0  # records of a mode answered without reasoning (instant) that carry some
    records_by_mode: dict[str, int] = field(default_factory=dict)
    thinking_records: int = 0  # records of modes that think (the reasoning checks' own denominators)

    def rate(self, count: int, of: int | None = None) -> float:
        of = self.records if of is None else of
        return count / of if of else 0.0

    def rate_of(self, name: str) -> float:
        """A check's rate over the records it applies to: reasoning checks over their own modes' records."""
        of = {"empty_reasoning": self.thinking_records, "unclosed_reasoning": self.thinking_records,
              "unexpected_reasoning": self.records - self.thinking_records}.get(name, self.records)
        return self.rate(getattr(self, name), of)

    def as_dict(self) -> dict[str, Any]:
        counts = asdict(self)
        names = ("empty_reasoning", "empty_content", "truncated", "leaked_tags", "duplicate_ids",
                 "token_text_mismatch", "think_end_miscount", "unclosed_reasoning", "unexpected_reasoning")
        counts["rates"] = {name: round(self.rate_of(name), 6) for name in names}
        return counts


def expected_completion_text(record: GenerationRecord, spec: ThinkTokenSpec, closed: bool = True,
                             thinks: bool = True, calls: str = "") -> str:
    """The completion text the server's token ids should decode to, rebuilt from reasoning, content and the
    template's text of the record's tool `calls`.

    `closed`: the ids hold a think-end id (a model that never closed its reasoning has none to decode).
    `thinks`: the record's mode thinks; in one that does not (instant) the template closed the think block.
    """
    text = ("" if spec.template_writes_start_tag or not thinks else spec.think_start) + record["reasoning"]
    if record["finish_reason"] == "length" and not record["content"]:
        return text
    text += (spec.think_end if closed else "") + (record["content"] or "") + calls
    return text + spec.end_of_turn if record["finish_reason"] in ("stop", "tool_calls") else text


def _decodes_differently(decoded: str, record: GenerationRecord, spec: ThinkTokenSpec, closed: bool, thinks: bool,
                         render_calls: Callable[[dict[str, Any]], str | None] | None) -> bool:
    if not record.get("tool_calls"):
        return decoded != expected_completion_text(record, spec, closed, thinks)
    calls = render_calls(record) if render_calls is not None else None
    if calls is None:
        return not decoded.startswith(expected_completion_text({**record, "finish_reason": None}, spec, closed, thinks))
    return decoded != expected_completion_text(record, spec, closed, thinks, calls)


def validate_records(
    index: int,
    records: Iterable[dict[str, Any]],
    profile: ModelProfile,
    thresholds: ValidationConfig,
    decode: Any | None = None,
    spec: ThinkTokenSpec | None = None,
    render_calls: Callable[[dict[str, Any]], str | None] | None = None,
) -> ShardValidation:
    """Count what can silently ruin training data and decide pass or quarantine, in one pass over the records.

    Each record is held to its own mode: one that thinks must carry reasoning and close it at most once (a record
    that never closed it is kept, counted as `unclosed_reasoning`); one answered without reasoning (instant) must
    carry none and no think-end id. A record with tool calls may have no content; its ids must decode to its
    text and the calls as the template writes them (`render_calls`; where it cannot, its text must lead them).
    """
    tags = (profile.think_start, profile.think_end)
    ids: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for record in records:
        ids[record["id"]] += 1
        mode = profile.mode_of(record)
        modes[mode] += 1
        thinking = profile.mode(mode).thinks
        content, has_reasoning = record["content"] or "", bool(record["reasoning"].strip())
        counts["thinking_records"] += thinking
        counts["empty_reasoning"] += thinking and not has_reasoning
        counts["unexpected_reasoning"] += not thinking and has_reasoning
        counts["empty_content"] += not content.strip() and not record.get("tool_calls")
        counts["truncated"] += record["finish_reason"] == "length"
        counts["leaked_tags"] += any(t in record["reasoning"] or t in content for t in tags)
        counts["reasoning_split_inline"] += record.get("reasoning_source") == "inline"
        token_ids = record.get("completion_token_ids")
        if decode is None or spec is None or token_ids is None:
            continue
        ends = token_ids.count(spec.end_id)
        counts["token_text_mismatch"] += _decodes_differently(decode(token_ids), record, spec, ends > 0, thinking,
                                                              render_calls)
        counts["think_end_miscount"] += ends > (1 if thinking else 0)
        counts["unclosed_reasoning"] += thinking and ends == 0 and record["finish_reason"] != "length"
    checks = ("empty_reasoning", "unexpected_reasoning", "empty_content", "truncated", "leaked_tags",
              "token_text_mismatch", "think_end_miscount", "unclosed_reasoning", "reasoning_split_inline",
              "thinking_records")
    result = ShardValidation(
        index=index,
        records=ids.total(),
        duplicate_ids=sum(n - 1 for n in ids.values()),
        status="pass",
        records_by_mode=dict(modes),
        **{check: counts[check] for check in checks},
    )
    reasons = []
    for name, limit in (
        ("empty_reasoning", thresholds.max_empty_reasoning_rate),
        ("unexpected_reasoning", thresholds.max_unexpected_reasoning_rate),
        ("empty_content", thresholds.max_empty_content_rate),
        ("truncated", thresholds.max_truncated_rate),
        ("leaked_tags", thresholds.max_leaked_tags_rate),
        ("token_text_mismatch", thresholds.max_token_text_mismatch_rate),
        ("think_end_miscount", thresholds.max_token_text_mismatch_rate),
        ("unclosed_reasoning", thresholds.max_unclosed_reasoning_rate),
    ):
        rate = result.rate_of(name)
        if rate > limit:
            setting = "max_token_text_mismatch_rate" if name == "think_end_miscount" else f"max_{name}_rate"
            reasons.append(f"{name} rate {rate:.1%} > validation.{setting} {limit:.1%}")
    if result.duplicate_ids:
        reasons.append(f"{result.duplicate_ids} duplicate ids")
    if not reasons:
        return result
    return ShardValidation(**{**asdict(result), "status": "quarantine", "reasons": reasons})


def _markdown(run_name: str, report: ShardValidation) -> str:
    rows = "\n".join(f"| {k} | {v} | {report.rate_of(k):.1%} |" for k, v in asdict(report).items()
                     if isinstance(v, int) and k not in ("index", "records", "thinking_records"))
    by_mode = ", ".join(f"{mode} {count}" for mode, count in report.records_by_mode.items())
    verdict = report.status + ("" if not report.reasons else ": " + "; ".join(report.reasons))
    return (f"### {run_name} shard {report.index:05d}: {verdict}\n\n{report.records} records ({by_mode})\n\n"
            f"| check | count | rate |\n|---|---|---|\n{rows}\n")


def reopen_quarantined(store: RunStore) -> list[int]:
    """Move quarantined shards' generations (and their validation and rejections) to `quarantine/<time>/`.

    Nothing is deleted; with the generation file gone, the next run generates those shards again.
    """
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    reopened = []
    for rel in store.list("validation", ".json"):
        if store.read_json(rel)["status"] != "quarantine":
            continue
        index = int(rel.rsplit("-", 1)[1].removesuffix(".json"))
        for moved in (artifact_path("generations", index), rejected_path("generations", index), rel):
            if store.exists(moved):
                store.write_bytes(f"quarantine/{stamp}/{moved}", store.read_bytes(moved))
                store.remove(moved)
        reopened.append(index)
    return reopened


@task(name="reopen-quarantined", cache_policy=NO_CACHE)
def reopen_quarantined_shards(run: str) -> list[int]:
    """Prefect task: the quarantined shards of a run, reopened for generation (see `reopen_quarantined`)."""
    return reopen_quarantined(RunStore.at(run))


@dataclass(frozen=True)
class ValidationSettings:
    """Everything that changes a shard's verdict, and so the validation stage's cache key."""

    profile: ModelProfile
    tokenizer: str
    thresholds: ValidationConfig

    @classmethod
    def from_config(cls, config: PipelineConfig) -> ValidationSettings:
        return cls(config.profile, config.model.tokenizer, config.validation)


# Bump `version` when a verdict or report written for the same input and settings changes.
VALIDATION = StageOutput("validation", version=1, record=lambda generations: artifact_path("validation",
                                                                                           generations.index))


@task(name="validate", task_run_name="{run.run_name}/validate-{generations.index:05d}", retries=0,
      persist_result=True, cache_policy=NO_CACHE)
def validate_generations(generations: ShardRef, settings: ValidationSettings, run: RunLocation) -> ShardRef:
    """Write validation/shard-NNNNN.json and a UI artifact; fail the shard if it is quarantined. A report made
    under this key already is the verdict: nothing is read again."""
    store = run.store()
    path = artifact_path("validation", generations.index)
    key = VALIDATION.key(generations=generations, settings=settings)
    verdict = VALIDATION.done(store, generations, key)
    if verdict is not None and verdict["status"] == "pass":
        return handed_on(generations, key)
    if verdict is None:
        records = store.read_shard_records(generations)
        profile = settings.profile
        tok = load_tokenizer(settings.tokenizer)
        spec = discover_think_tokens(tok, profile) if profile.single_token_tags else None
        report = validate_records(generations.index, records, profile, settings.thresholds,
                                  lambda ids: tok.decode(ids, skip_special_tokens=False), spec,
                                  lambda record: tool_calls_text(tok, record, profile, spec) if spec else None)
        verdict = {**report.as_dict(), "generations_sha256": generations.sha256, "stage_key": key}
        store.write_json(path, verdict)
        create_markdown_artifact(key=ui_key(run.run_name, f"validation-{shard_name(generations.index)}"),
                                 markdown=_markdown(run.run_name, report), description="reasoning-field validation")
    if verdict["status"] != "pass":
        raise ShardQuarantined(
            f"shard {generations.index:05d} quarantined ({'; '.join(verdict['reasons'])}); its records stay in "
            f"{generations.path} and are kept out of the training set: see {path}"
        )
    return generations
