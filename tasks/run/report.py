"""The run report in markdown, and the verdict: why a run produced less than it should.

One text serves the report.md in the run folder and the Prefect artifact scoped to the run, its plots inline, so
the UI shows what the run made without opening the storage.
"""

from __future__ import annotations

import base64
from collections import Counter
from typing import Any

from eagle3_datagen.artifacts import MANIFEST
from eagle3_datagen.conversations import TOOL_RESULT_MISSING
from eagle3_datagen.storage import RunStore
from tasks.run.status import SHARD_STATUS_STAGES, ShardStatus


def where_outputs_are(uri: str) -> str:
    """The run folder as text to copy, with the commands that list and check it: a browser opens no `file://`
    link from an http page, nor an `s3://` one at all."""
    listing = f"aws s3 ls {uri}/" if uri.startswith("s3://") else f"ls {uri}"
    return f"`{uri}` (list it: `{listing}`; check it: `eagle3-datagen verify {uri}`)"


def shard_row(name: str, status: ShardStatus, last_stage: str) -> dict[str, Any]:
    """What the report says of one shard: records, accepted and rejected prompts, reasoning, lengths, stage."""
    gen = status.stage("generations")
    stage, reached = status.reached
    return {
        "shard": name,
        "records": gen.get("records"),
        "accepted": status.stage(last_stage).get("accepted_prompts"),
        "rejected": gen.get("rejected") + status.stage("sequences").get("rejected"),
        "reasoning coverage": f"{gen.get('reasoning_coverage'):.1%}",
        "truncated": gen.get("truncated"),
        "mean reasoning tok": f"{gen.get('mean_reasoning_tokens'):.1f}",
        "mean answer tok": f"{gen.get('mean_answer_tokens'):.1f}",
        "validation": status.stage("validation").status,
        "stage reached": f"{stage}: {reached.status}",
    }


def mode_rows(shards: dict[str, ShardStatus], weights: dict[str, float], last_stage: str,
              held_out: dict[str, int]) -> list[dict[str, Any]]:
    """What the report says of each mode of the run's mix: records, samples kept and refused, lengths, and its
    prompts held out to judge drafts on (`held_out`, the prompt stage's count).

    Kept samples are those of shards that reached the last stage; refused ones were refused by the server or by
    the sequences stage (not provably exact, or reasoning in a mode answered without it).
    """
    total_weight = sum(weights.values())
    rows = []
    for mode, weight in weights.items():
        generated = [s.stage("generations").get("modes", {}).get(mode, {}) for s in shards.values()]
        records = sum(g.get("records", 0) for g in generated)
        kept = sum(s.stage("sequences").get("modes", {}).get(mode, {}).get("records", 0) for s in shards.values()
                   if s.stage(last_stage).done)
        refused = sum(s.stage(stage).get("rejected_by_mode", {}).get(mode, 0) for s in shards.values()
                      for stage in ("generations", "sequences"))
        rows.append({
            "mode": mode,
            "share asked": f"{weight / total_weight:.0%}",
            "records": records,
            "kept": kept,
            "refused": refused,
            "held-out prompts": held_out.get(mode, 0),
            "with reasoning": f"{sum(g.get('with_reasoning', 0) for g in generated) / max(1, records):.1%}",
            "mean reasoning tok": f"{sum(g.get('reasoning_tokens', 0) for g in generated) / max(1, records):.1f}",
            "mean answer tok": f"{sum(g.get('answer_tokens', 0) for g in generated) / max(1, records):.1f}",
        })
    return rows


def turn_rows(shards: dict[str, ShardStatus]) -> list[dict[str, Any]]:
    """What the report says of each user turn of a run's rollouts (none without): its samples (a tool call and
    the answer after its results are two), those with tool calls, and the conversations that ended there, by
    reason."""
    counts: dict[int, Counter[str]] = {}
    for status in shards.values():
        gen = status.stage("generations")
        for turn, of_turn in gen.get("user_turns", {}).items():
            counts.setdefault(int(turn), Counter()).update(of_turn)
        for turn, refused in gen.get("rejected_by_turn", {}).items():
            counts.setdefault(int(turn), Counter())["refused"] += refused
    return [{"user turn": turn, "samples": counts[turn]["samples"], "with tool calls": counts[turn]["with tool calls"],
             "answered in full": counts[turn]["complete"], "ended: refused": counts[turn]["refused"],
             f"ended: {TOOL_RESULT_MISSING}": counts[turn][TOOL_RESULT_MISSING]} for turn in sorted(counts)]


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows)]


def render_report(run_name: str, run_uri: str, rows: list[dict[str, Any]], totals: dict[str, Any],
                  plots: dict[str, bytes], breakdowns: list[list[dict[str, Any]]]) -> str:
    """The report: output location, one row per shard, the breakdowns (per mode, per turn), totals, and the plots
    inline (PNG data URIs, which the Prefect UI renders in a markdown artifact)."""
    lines = [f"# Run {run_name}", "", f"Output: {where_outputs_are(run_uri)}", "", *_table(rows)]
    for breakdown in breakdowns:
        if breakdown:
            lines += ["", *_table(breakdown)]
    lines += ["", "| total | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in totals.items()]
    for title, png in plots.items():
        lines += ["", f"![{title}](data:image/png;base64,{base64.b64encode(png).decode()})"]
    return "\n".join(lines) + "\n"


def run_shortfall(shards: dict[str, ShardStatus], last_stage: str, num_shards: int, min_accepted_rate: float,
                  store: RunStore, generation_error: str | None = None) -> str | None:
    """Why the run produced less than it should, as one line naming the shards; None when it is complete."""
    short = [name for name, s in shards.items() if not s.stage(last_stage).done]
    if generation_error and not short:  # refused before asking (other settings): the shards are from before
        return generation_error
    if short:
        more = f" and {len(short) - 10} more" if len(short) > 10 else ""
        others = f"; the others went on to {last_stage}" if len(short) < num_shards else ""
        which = f"{len(short)} of {num_shards} shards did not finish ({', '.join(short[:10])}{more}{others})"
        if generation_error:
            return f"{generation_error}; {which}"
        why = next((f"{name} {stage}: {reasons[0]}; " for name in short for stage in SHARD_STATUS_STAGES
                    if (reasons := shards[name].stage(stage).get("reasons"))), "")
        return (f"{which}: {why}see {store.uri}/{MANIFEST}; fix the cause and run again (finished shards are not "
                "redone)")
    prompts = sum(s.prompts.get("records") for s in shards.values())
    accepted = sum(s.stage(last_stage).get("accepted_prompts") for s in shards.values())
    rate = accepted / max(1, prompts)
    if accepted and rate >= min_accepted_rate:
        return None
    reasons = Counter(row["reason"] for rel in store.list("rejected", ".jsonl") for row in store.read_jsonl(rel))
    common = ""
    if reasons:
        reason, count = reasons.most_common(1)[0]
        common = f"; most common reason ({count}×): {reason}"
    return (f"only {accepted} of {prompts} prompts reached the training set ({rate:.0%} < "
            f"validation.min_accepted_rate {min_accepted_rate:.0%}){common}; see {store.uri}/rejected/")
