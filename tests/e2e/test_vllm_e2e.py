"""The pipeline against a real vLLM CPU server on the tiny reasoning model: what `make demo` does, checked.

Also the failure modes set up for real: a server without a reasoning parser, thinking switched off, and a
prompt longer than the model's context (rejected with the server's reason while the run goes on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from cli.demo import demo_config, demo_questions
from cli.runner import run_pipeline
from eagle3_datagen.config import PipelineConfig, SequencesConfig, parse_config
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.testing.vllm_server import LocalVLLMServer
from eagle3_datagen.think_tokens import discover_think_tokens, load_tokenizer
from tasks.generation import GenerationError
from tasks.health import ServerCheckFailed
from tasks.sequences import build_sequences

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("prefect_api")]


EVERY_SAMPLE_CROSS_CHECKED = {"cross_check_rate": 1.0}  # the text rebuild compared with the ids on every sample


def served_config(tiny_model: Path, server: LocalVLLMServer, output: Path, **tree: Any) -> PipelineConfig:
    base = demo_config(tiny_model, server.url, output).model_dump(mode="json")
    base["model"]["name"] = server.served_name
    for section, values in tree.items():
        base[section] = {**base.get(section, {}), **values} if isinstance(values, dict) else values
    return parse_config(base)


def test_the_demo_job_on_a_real_vllm_server(tiny_model: Path, vllm_server: LocalVLLMServer, tmp_path: Path) -> None:
    summary = run_pipeline(served_config(tiny_model, vllm_server, tmp_path, sequences=EVERY_SAMPLE_CROSS_CHECKED))
    run = tmp_path / "demo"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    records = [json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()]
    with_both = [r for r in records if r["reasoning"].strip() and (r["content"] or "").strip()]
    assert len(with_both) >= 0.95 * len(records), f"{len(with_both)}/{len(records)} with reasoning and answer"
    assert {r["reasoning_source"] for r in records} == {"reasoning"}, "vLLM >= 0.16 sends `reasoning`"

    tokenizer = load_tokenizer(str(tiny_model))
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    assert manifest["think_tokens"]["start_id"] == start and manifest["think_tokens"]["end_id"] == end
    for shard in manifest["shards"].values():
        assert shard["validation"]["rates"]["token_text_mismatch"] == 0.0, "server ids decode to the text"
        assert shard["sequences"]["text_rebuild_agreement"] >= 0.9
    table = pq.read_table(run / "sequences" / "shard-00000.parquet").to_pylist()
    for row in table:
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert masked.count(end) <= 1 and masked[0] == start, "the model's own single think ids"
        assert row["source"] == "server" and (row["agrees"] or row["first_diff"] is not None), \
            "the text rebuild agrees with the server's ids, or where it does not is recorded"

    # the text rebuild, proven on the server's own answers: it agrees with the ids almost always, and where it
    # does not, the usage counts every server returns flag it (none slips through into the training set)
    profile = BUILTIN_PROFILES["qwen3"]
    rebuilt = build_sequences(records, tokenizer, profile, discover_think_tokens(tokenizer, profile),
                              SequencesConfig(source="text", max_seq_len=1 << 20))
    slipped = [s.id for s in rebuilt.sequences if s.agrees is not True]
    assert slipped == [], f"text rebuilds that differ from the server's ids yet passed the count check: {slipped}"
    assert len(rebuilt.sequences) >= 0.9 * len(records), rebuilt.rejected
    assert all(r["reason"].startswith("text rebuild disagrees with the server's counts") for r in rebuilt.rejected)

    hf = json.loads((tiny_model / "config.json").read_text())
    index = json.loads((run / "hidden_states" / "shard-00000" / "index.json").read_text())
    part = load_file(run / "hidden_states" / "shard-00000" / index["parts"][0]["file"])
    tokens = part["input_ids"].shape[0]
    assert part["aux_hidden_states"].shape == (tokens, 3 * hf["hidden_size"])
    assert part["final_hidden_states"].shape == (tokens, hf["hidden_size"])

    second = run_pipeline(served_config(tiny_model, vllm_server, tmp_path, sequences=EVERY_SAMPLE_CROSS_CHECKED))
    assert any("work tasks cached" in line for line in second["stages"])
    assert second["totals"] == summary["totals"]


def test_a_prompt_longer_than_the_context_is_rejected_and_the_run_goes_on(
        tiny_model: Path, vllm_server: LocalVLLMServer, tmp_path: Path) -> None:
    data = tmp_path / "long.jsonl"
    rows = [{"messages": [{"role": "user", "content": "What is two plus two?"}]},
            {"messages": [{"role": "user", "content": "tell me " * 3000}]},
            {"messages": [{"role": "user", "content": "Name a color."}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = served_config(tiny_model, vllm_server, tmp_path, data={"source": str(data), "shard_size": 8},
                           hidden_states={"backend": "none"})
    run_pipeline(config)
    rejected = [json.loads(line) for line in (tmp_path / "demo/rejected/generations-shard-00000.jsonl")
                .read_text().splitlines()]
    assert len(rejected) == 1 and "HTTP 400" in rejected[0]["reason"]
    assert "context" in rejected[0]["reason"] or "max" in rejected[0]["reason"]
    generated = (tmp_path / "demo/generations/shard-00000.jsonl").read_text().splitlines()
    assert len(generated) == 2
    [probe] = json.loads((tmp_path / "demo/manifest.json").read_text())["probe"]
    assert probe["max_model_len"] == 2048 and "1 of 3 prompts do not fit" in probe["context_warning"]


def test_max_tokens_beyond_the_served_context_is_refused_before_generation(
        tiny_model: Path, vllm_server: LocalVLLMServer, tmp_path: Path) -> None:
    config = served_config(tiny_model, vllm_server, tmp_path, generation={"max_tokens": 4096},
                           hidden_states={"backend": "none"})
    with pytest.raises(ServerCheckFailed, match=r"context of 2048 tokens .* serve with --max-model-len >= \d+"):
        run_pipeline(config)
    manifest = json.loads((tmp_path / "demo/manifest.json").read_text())
    assert manifest["status"] == "failed" and "max_model_len" in manifest["cause"]
    assert not (tmp_path / "demo" / "generations").exists()


def test_thinking_switched_off_stops_the_run_at_its_third_answer(tiny_model: Path, vllm_server: LocalVLLMServer,
                                                              tmp_path: Path) -> None:
    off = {"reasoning_parser": "qwen3", "chat_template_kwargs": {"enable_thinking": False},
           "end_of_turn": "<|im_end|>", "template_writes_start_tag": False}
    config = served_config(tiny_model, vllm_server, tmp_path, profiles={"qwen3-off": off},
                           model={"profile": "qwen3-off"})
    with pytest.raises(GenerationError, match=r"early abort: 3 of the first 3 records have empty reasoning .*"
                                              r"thinking is off or the switch is ignored"):
        run_pipeline(config)
    assert not list((tmp_path / "demo" / "generations").glob("shard-*[0-9].jsonl")), "no shard kept"
    assert not (tmp_path / "demo" / "generations" / "settings.json").exists(), "nothing pins the settings"


def test_a_server_without_a_reasoning_parser_stops_the_run(tiny_model: Path, tmp_path: Path) -> None:
    with LocalVLLMServer(tiny_model, served_name="tiny", reasoning_parser=None,
                         log_path=tmp_path / "no-parser.log") as server:
        with pytest.raises(ServerCheckFailed, match="no reasoning parser: restart vLLM with --reasoning-parser qwen3"):
            run_pipeline(served_config(tiny_model, server, tmp_path))
        allowed = served_config(tiny_model, server, tmp_path, validation={"allow_inline_reasoning": True},
                                hidden_states={"backend": "none"}, run_name="inline")
        run_pipeline(allowed)
    records = [json.loads(line) for line in (tmp_path / "inline/generations/shard-00000.jsonl")
               .read_text().splitlines()]
    inline = [r for r in records if r["reasoning_source"] == "inline"]
    assert len(inline) >= 0.9 * len(records), "reasoning split out of content here, and marked"
    assert all("</think>" not in r["content"] and "<think>" not in r["reasoning"] for r in inline)


def test_a_qwen3_thinking_and_instant_mix_is_exact_in_each_mode(tiny_model: Path, vllm_server: LocalVLLMServer,
                                                                tmp_path: Path) -> None:
    """Instant prompts end with the template's `<think>\\n\\n</think>\\n\\n` and are answered without reasoning;
    every kept sample of each mode is the server's ids, and its text rebuild equals them."""
    mix = [{"mode": "thinking", "weight": 0.5}, {"mode": "instant", "weight": 0.5}]
    config = served_config(tiny_model, vllm_server, tmp_path, sequences=EVERY_SAMPLE_CROSS_CHECKED,
                           generation={"modes": mix}, hidden_states={"backend": "none"},
                           validation={"max_unexpected_reasoning_rate": 0.5, "max_token_text_mismatch_rate": 0.5,
                                       "max_unclosed_reasoning_rate": 0.5, "max_leaked_tags_rate": 0.5})
    run_pipeline(config)
    run = tmp_path / "demo"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed", manifest.get("cause")
    tokenizer = load_tokenizer(str(tiny_model))
    end = tokenizer.convert_tokens_to_ids("</think>")
    prefill = tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    records = {json.loads(line)["id"]: json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()}
    rows = [row for f in sorted((run / "sequences").glob("shard-*.parquet")) for row in pq.read_table(f).to_pylist()]
    assert min(sum(row["mode"] == mode for row in rows) for mode in ("thinking", "instant")) >= 10
    for row in rows:
        record = records[row["id"]]
        prompt, completion = record["prompt_token_ids"], record["completion_token_ids"]
        assert row["mode"] == record["mode"] and row["input_ids"] == prompt + completion
        assert row["agrees"] is True or row["first_diff"] >= len(prompt), \
            f"{row['id']} ({row['mode']}): the rebuild agrees, or differs in the answer and says where"
        if row["mode"] == "instant":
            assert prompt[-len(prefill):] == prefill and end not in completion and not record["reasoning"]
        else:
            assert completion.count(end) <= 1 and record["reasoning"]
    assert sum(row["agrees"] is True for row in rows) >= 0.9 * len(rows), "the rebuild path is exercised in full"


def test_a_rollout_asks_each_turn_on_the_models_own_earlier_answers(
        tiny_model: Path, vllm_server: LocalVLLMServer, tmp_path: Path) -> None:
    """Three-turn conversations of questions the tiny model knows: turn k's prompt ids, as vLLM rendered them,
    hold the model's own answer to turn k-1 (never the dataset's), and every kept sample is the server's ids."""
    questions = [json.loads(line)["conversations"][-1]["value"]
                 for line in demo_questions().read_text().splitlines()[:12]]
    rows = [{"messages": [message for q in questions[i:i + 3] for message in (
        {"role": "user", "content": q}, {"role": "assistant", "content": "the dataset's answer"})]}
        for i in range(0, 12, 3)]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # Later turns are contexts the tiny model was never taught: whatever format it answers in there (a second
    # <think>, a cut answer) is the validator's business, tested elsewhere, so no rate quarantines a shard here.
    unpoliced = {f"max_{rate}_rate": 1.0 for rate in (
        "empty_content", "leaked_tags", "token_text_mismatch", "truncated", "unclosed_reasoning", "rebuild_mismatch")}
    config = served_config(tiny_model, vllm_server, tmp_path, sequences=EVERY_SAMPLE_CROSS_CHECKED,
                           data={"source": str(data), "shard_size": 2, "turns": "rollout"}, validation=unpoliced)
    run_pipeline(config)
    run = tmp_path / "demo"
    assert json.loads((run / "manifest.json").read_text())["status"] == "completed"
    records = {json.loads(line)["id"]: json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()}
    assert sorted(r["turn"] for r in records.values()) == [0] * 4 + [1] * 4 + [2] * 4, "every turn, once"
    tokenizer = load_tokenizer(str(tiny_model))
    for record in records.values():
        assert not [m for m in record["messages"] if m["content"] == "the dataset's answer"]
        if record["turn"]:
            earlier = records[record["id"].replace(f":turn{record['turn']}", f":turn{record['turn'] - 1}")]
            seen = tokenizer.decode(record["prompt_token_ids"])
            assert earlier["content"].strip() in seen, "the server was asked on the model's own answer"
            if earlier["reasoning"].strip() and earlier["reasoning"].strip() not in earlier["content"]:
                assert earlier["reasoning"].strip() not in seen, "history carries the answer, not its reasoning"
    rows = [row for f in sorted((run / "sequences").glob("shard-*.parquet")) for row in pq.read_table(f).to_pylist()]
    refused = [json.loads(line) for f in (run / "rejected").glob("sequences-*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(rows) + len(refused) == 12 and all(entry["reason"] for entry in refused), "every sample kept or refused"
    assert len(rows) >= 6, f"only {len(rows)} of 12 samples kept: {[entry['reason'] for entry in refused]}"
    for row in rows:
        record = records[row["id"]]
        assert row["source"] == "server"
        assert row["input_ids"] == record["prompt_token_ids"] + record["completion_token_ids"]
