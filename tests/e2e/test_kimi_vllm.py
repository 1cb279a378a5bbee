"""Kimi-K2.5 end to end against the real thing: vLLM's own `kimi_k2` reasoning parser, serving a tiny model on the
real Kimi-K2.5 vocabulary (163,840 ids) and template, run with the `kimi-k2.5` profile.

Every sequence must be the server's ids with the template's `<think>` (163606) in the prompt, at most one
`</think>` (163607) in the supervised part, the loss mask on reasoning + answer + end of turn only; multi-turn
prompts keep earlier turns as the template renders them (their reasoning dropped, `<think></think>` in its
place); a run that mixes thinking and instant mode is exact in each (instant: `<think></think>` ends the prompt,
no think id generated); and a profile that switches thinking off is stopped by the first answers.

The tests hold whatever the tiny model says: a sampled answer that ends its turn inside its reasoning is kept as
the server's ids, counted as unclosed, and its text rebuild's first difference is where the server ended the
turn. What is asserted of the model is only the share its build checks with margin (`FormatMargin`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from built_models import built_model
from trainer_files import assert_the_trainers_read_every_sample

from cli.demo import demo_config
from cli.runner import run_pipeline
from eagle3_datagen.artifacts import prompt_id_of
from eagle3_datagen.config import parse_config
from eagle3_datagen.conversations import TOOL_RESULT_MISSING
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.tiny_model import build_tiny_kimi_model
from eagle3_datagen.testing.tiny_tool_calls import TOOL_CALL_SET, TOOL_MARKUP_IDS
from eagle3_datagen.testing.vllm_server import LocalVLLMServer
from tasks.export import export_run
from tasks.generation import GenerationError
from tasks.verify import verify_run

KIMI_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "tokenizers" / "kimi-k2.5"
THINK, END_THINK, IM_END = 163606, 163607, 163586
# A small shard with one answer that ended inside its reasoning must not be quarantined here: these tests check
# that such answers are kept and counted, whatever share a tiny model sampled on this machine gives.
UNCLOSED_KEPT = {"max_unclosed_reasoning_rate": 0.5}
TOOL_PARSER = ("--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2")

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("prefect_api"),
              pytest.mark.skipif(not KIMI_TOKENIZER.is_dir(), reason="../shared/tokenizers/kimi-k2.5 is absent")]


@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model on the real Kimi-K2.5 vocabulary (a fresh build takes a minute or two)."""
    return built_model("EAGLE3_TINY_KIMI",
                       lambda: build_tiny_kimi_model(tmp_path_factory.mktemp("tiny-kimi"), KIMI_TOKENIZER))


@pytest.fixture(scope="module")
def kimi_server(kimi_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServer]:
    log_path = tmp_path_factory.mktemp("vllm-kimi") / "server.log"
    with LocalVLLMServer(kimi_model, served_name="tiny-kimi", reasoning_parser="kimi_k2", log_path=log_path,
                         extra_args=TOOL_PARSER) as server:
        yield server


def kimi_config(model: Path, server: LocalVLLMServer, output: Path, **sections: Any) -> Any:
    tree = demo_config(model, server.url, output, run_name="kimi").model_dump(mode="json")
    tree["model"] = {"name": server.served_name, "profile": "kimi-k2.5", "tokenizer": str(model)}
    tree["hidden_states"] = {"backend": "none"}
    tree["sequences"] = {"cross_check_rate": 1.0}  # every sample's text rebuild compared with the ids
    tree.update(sections)
    return parse_config(tree)


def test_kimi_sequences_are_the_servers_ids_with_one_think_end_and_the_right_mask(
        kimi_model: Path, kimi_server: LocalVLLMServer, tmp_path: Path) -> None:
    run_pipeline(kimi_config(kimi_model, kimi_server, tmp_path, validation=UNCLOSED_KEPT))
    run = tmp_path / "kimi"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed", manifest.get("cause")
    assert (manifest["think_tokens"]["start_id"], manifest["think_tokens"]["end_id"]) == (THINK, END_THINK)
    assert manifest["think_tokens"]["template_writes_start_tag"] is True
    assert [p["reasoning_field"] for p in manifest["probe"]] == ["reasoning"], "vLLM's kimi_k2 sends `reasoning`"
    records = {json.loads(line)["id"]: json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()}
    rows = [row for f in sorted((run / "sequences").glob("shard-*.parquet")) for row in pq.read_table(f).to_pylist()]
    assert len(rows) == len(records) >= 40
    multi_turn = 0
    for row in rows:
        record = records[row["id"]]
        prompt, completion = record["prompt_token_ids"], record["completion_token_ids"]
        assert row["input_ids"] == prompt + completion and row["source"] == "server"
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(completion), "reasoning + answer + end of turn"
        assert prompt[-1] == THINK, "the template writes <think>"
        assert completion.count(END_THINK) <= 1 and completion[-1] == IM_END
        assert_rebuild_explained(row, prompt, completion)
        if sum(m["role"] == "user" for m in record["messages"]) > 1:
            multi_turn += 1
            earlier = prompt[: -1]
            assert earlier[earlier.index(THINK): earlier.index(THINK) + 2] == [THINK, END_THINK], \
                "an earlier assistant turn renders an empty think block: its reasoning is dropped"
    assert multi_turn >= 2, "the demo questions hold multi-turn prompts"
    unclosed = sum(END_THINK not in records[row["id"]]["completion_token_ids"] for row in rows)
    counted = sum(json.loads(f.read_text())["unclosed_reasoning"] for f in (run / "validation").glob("shard-*.json"))
    assert counted == unclosed, "every answer that ended inside its reasoning is counted, and kept"
    assert sum(row["agrees"] is True for row in rows) >= 0.9 * len(rows), "the rebuild path is exercised in full"


def assert_rebuild_explained(row: dict[str, Any], prompt: list[int], completion: list[int]) -> None:
    """The text rebuild equals the server's ids, or where it does not, its first difference is recorded in the
    answer (the prompt is always exact); an answer that never closed its reasoning differs at the latest where the
    server ended the turn (the rebuild closes the reasoning there)."""
    if row["agrees"] is True:
        assert row["first_diff"] is None
        return
    assert row["first_diff"] is not None and row["first_diff"] >= len(prompt), f"{row['id']}: the prompt is exact"
    if row["mode"] == "thinking" and END_THINK not in completion:
        assert row["first_diff"] <= len(prompt) + len(completion) - 1, f"{row['id']}: the turn ended in reasoning"


def test_kimi_with_thinking_switched_off_is_stopped_by_its_first_answers(
        kimi_model: Path, kimi_server: LocalVLLMServer, tmp_path: Path) -> None:
    """Instant mode (`thinking: false`) sends no reasoning: a run meant to collect reasoning ends at once."""
    instant = {"reasoning_parser": "kimi_k2", "chat_template_kwargs": {"thinking": False},
               "template_writes_start_tag": True, "think_start": "<think>", "think_end": "</think>",
               "end_of_turn": "<|im_end|>"}
    config = kimi_config(kimi_model, kimi_server, tmp_path, profiles={"kimi-instant": instant})
    config = parse_config({**config.model_dump(mode="json"),
                           "model": {**config.model.model_dump(), "profile": "kimi-instant"}})
    with pytest.raises(GenerationError) as stopped:
        run_pipeline(config)
    assert "3 of the first 3 records have empty reasoning" in str(stopped.value)
    assert "{'thinking': False}" in str(stopped.value)


def test_kimi_mixed_thinking_and_instant_run_is_exact_in_each_mode(
        kimi_model: Path, kimi_server: LocalVLLMServer, tmp_path: Path) -> None:
    """Half the prompts in instant mode (`thinking: false`): its prompt ends `<think></think>` (the template closes
    the block), its answer carries no reasoning and no think id; each mode's text rebuild is the server's ids.

    Now and then the tiny model thinks in instant mode too (the parser then sends reasoning, or leaves a
    `</think>` in the answer), which validation counts (allowed here) and the sequences stage refuses."""
    mix = [{"mode": "thinking", "weight": 0.5}, {"mode": "instant", "weight": 0.5}]
    config = kimi_config(kimi_model, kimi_server, tmp_path, validation={
        "max_unexpected_reasoning_rate": 0.5, "max_token_text_mismatch_rate": 0.5, "max_leaked_tags_rate": 0.5,
        **UNCLOSED_KEPT})
    config = parse_config({**config.model_dump(mode="json"),
                           "generation": {**config.generation.model_dump(mode="json"), "modes": mix}})
    run_pipeline(config)
    run = tmp_path / "kimi"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed", manifest.get("cause")
    records = {json.loads(line)["id"]: json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()}
    rows = [row for f in sorted((run / "sequences").glob("shard-*.parquet")) for row in pq.read_table(f).to_pylist()]
    kept = {mode: sum(row["mode"] == mode for row in rows) for mode in ("thinking", "instant")}
    assert min(kept.values()) >= 10, kept
    for row in rows:
        record = records[row["id"]]
        prompt, completion = record["prompt_token_ids"], record["completion_token_ids"]
        assert row["mode"] == record["mode"]
        assert row["input_ids"] == prompt + completion and row["source"] == "server"
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
        assert completion[-1] == IM_END
        assert_rebuild_explained(row, prompt, completion)
        if row["mode"] == "instant":
            assert prompt[-2:] == [THINK, END_THINK], "the template closes the think block in instant mode"
            assert END_THINK not in completion and THINK not in completion
            assert record["reasoning"] == "" and record["reasoning_source"] == "none"
        else:
            assert prompt[-1] == THINK and completion.count(END_THINK) <= 1 and record["reasoning"]
    assert sum(row["agrees"] is True for row in rows) >= 0.9 * len(rows), "the rebuild path is exercised in full"
    refused = [json.loads(line) for f in (run / "rejected").glob("sequences-*.jsonl")
               for line in f.read_text().splitlines()]
    for row in refused:
        record = records[row["id"]]
        thought_anyway = record["mode"] == "instant" and (record["reasoning"] or END_THINK in record[
            "completion_token_ids"])
        assert thought_anyway or record["completion_token_ids"].count(END_THINK) > 1, \
            "only instant answers that thought anyway, and answers with a second </think>, are refused"
        assert row["reason"].startswith(("reasoning in a record of mode 'instant', answered without reasoning",
                                         f"{record['completion_token_ids'].count(END_THINK)} think-end tokens"))
    assert len(rows) + len(refused) == len(records)
    by_mode = {row["mode"]: row for row in manifest["modes"]}
    assert (by_mode["thinking"]["kept"], by_mode["instant"]["kept"]) == (kept["thinking"], kept["instant"])
    assert by_mode["instant"]["refused"] == len(refused)


def test_kimi_tool_calls_come_back_parsed_exact_and_paired_with_the_recorded_results(
        kimi_model: Path, kimi_server: LocalVLLMServer, tmp_path: Path) -> None:
    """The function-calling set as a rollout on vLLM's own `kimi_k2` tool parser, through hidden states and both
    exports: every call the model writes comes back as `tool_calls` (its markup in the server's ids), each sample is
    the server's ids, each call is answered by the dataset's result for its function in order (parallel calls
    too), and a call the dataset has no result for ends its conversation as `tool_result_missing`.

    The model is asserted only where its build checks the margin: it calls after the question's reasoning, once per
    city, and writes no markup elsewhere. Which city a call names is its own (the tiny model often copies it wrong),
    and results are paired by function, not by arguments."""
    rows = [json.loads(line) for line in TOOL_CALL_SET.read_text().splitlines()]
    config = kimi_config(kimi_model, kimi_server, tmp_path, validation=UNCLOSED_KEPT,
                         data={"source": str(TOOL_CALL_SET), "shard_size": 4, "turns": "rollout"},
                         hidden_states={"backend": "transformers", "model": str(kimi_model), "dtype": "float32"})
    run_pipeline(config)
    run = tmp_path / "kimi"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed", manifest.get("cause")
    verification = verify_run(RunStore.at(str(run)))
    assert verification.complete and not verification.problems, verification.problems
    records = [json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()]
    conversations: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["turn"]):
        conversations.setdefault(prompt_id_of(record["id"]), []).append(record)
    assert len(conversations) == len(rows) == 12
    called = [r for r in records if r.get("tool_calls")]
    for record in records:
        completion = record["completion_token_ids"]
        section_begin = TOOL_MARKUP_IDS[0]
        assert (section_begin in completion) == bool(record.get("tool_calls")), "markup in the ids is a parsed call"
        for call in record.get("tool_calls") or []:
            assert call["function"]["name"] in {"get_weather", "get_time"}
            assert set(json.loads(call["function"]["arguments"])) == {"city"}, call
    by_question = {next(m["content"] for m in row["messages"] if m["role"] == "user"): row for row in rows}
    ends: dict[str, int] = {}
    for kept in conversations.values():
        unused = recorded_results(by_question[next(m["content"] for m in kept[0]["messages"] if m["role"] == "user")])
        for record, after in itertools.pairwise(kept):
            if record.get("tool_calls"):
                answered = after["messages"][len(record["messages"]) + 1:]
                assert [m["tool_call_id"] for m in answered] == [c["id"] for c in record["tool_calls"]]
                expected = [unused[record["user_turn"]].pop(next(
                    k for k, (name, _) in enumerate(unused[record["user_turn"]]) if name == c["function"]["name"]))[1]
                    for c in record["tool_calls"]]
                assert [m["content"] for m in answered] == expected, "each call gets its function's next result"
        end = kept[-1].get("ended", "refused")  # a refused turn leaves no record: the one before it is the last
        ends[end] = ends.get(end, 0) + 1
        if end == TOOL_RESULT_MISSING:
            assert kept[-1]["tool_calls"], "only a call ends a conversation for a missing result"
    cairo = conversations[next(c for c, kept in conversations.items()
                               if kept[0]["messages"][-1]["content"] == "What time is it in Cairo?")]
    assert cairo[-1]["ended"] == TOOL_RESULT_MISSING, "the dataset recorded no time for Cairo"
    assert sum(len(r["tool_calls"]) == 2 for r in called) >= 1, "a question on two cities makes parallel calls"
    assert ends.get("complete", 0) >= 8, ends
    sequences = [row for f in sorted((run / "sequences").glob("shard-*.parquet"))
                 for row in pq.read_table(f).to_pylist()]
    assert len(sequences) == len(records) == verification.samples
    by_id = {r["id"]: r for r in records}
    for row in sequences:
        record = by_id[row["id"]]
        assert row["input_ids"] == record["prompt_token_ids"] + record["completion_token_ids"]
        assert row["source"] == "server"
        assert_rebuild_explained(row, record["prompt_token_ids"], record["completion_token_ids"])
    calls_rebuilt = [row for row in sequences if by_id[row["id"]].get("tool_calls") and row["agrees"] is True]
    assert calls_rebuilt, "a call's text rebuild, markup rendered as the template does, equals the server's ids"
    for row in sequences:  # what evaluate breaks its figures down by
        record = by_id[row["id"]]
        assert (row["turn"], row["has_tool_call"]) == (record["turn"], bool(record.get("tool_calls")))
    held = [row for row in sequences if row["split"] == "holdout"]
    held_conversations = {prompt_id_of(row["id"]) for row in held}
    assert len(held_conversations) == 3, "12 conversations: a quarter held out (the minimum per mode, capped)"
    assert len(held) == sum(len(conversations[c]) for c in held_conversations), "each held out whole"
    assert export_run(str(run), "speculators")["num_samples"] == len(records) - len(held)
    assert export_run(str(run), "specforge")["num_samples"] == len(records) - len(held)
    assert_the_trainers_read_every_sample(run, len(records) - len(held))


def recorded_results(row: dict[str, Any]) -> list[list[tuple[str, str]]]:
    """The dataset's (function, result) pairs of each user turn, in the order recorded."""
    turns: list[list[tuple[str, str]]] = []
    names: dict[str, str] = {}
    for message in row["messages"]:
        if message["role"] == "user":
            turns.append([])
        for call in message.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool":
            turns[-1].append((names[message["tool_call_id"]], message["content"]))
    return turns
