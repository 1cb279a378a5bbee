"""Stage 2: real files in tmp_path read through real `datasets`, shards written through RunStore."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_datagen.artifacts import sha256_hex
from eagle3_datagen.config import DataConfig
from eagle3_datagen.modes import ModeWeight
from eagle3_datagen.storage import RunLocation, RunStore
from tasks.prompts import (
    REJECTED_PATH,
    DataSourceError,
    PromptLoadResult,
    PromptSettings,
    RowRejected,
    build_prompt_shards,
    load_prompts,
    load_rows,
    normalize_conversation,
    normalize_messages,
    prompt_id,
    rollout_id,
    row_tools,
    write_prompt_shards,
)

CONVERSATION = [
    ("system", "You are terse."),
    ("user", "What is 2+2?"),
    ("assistant", "4"),
    ("user", "And 3+3?"),
    ("assistant", "6"),
]
# The prompt is cut after the last user turn; earlier assistant and system turns stay as context.
EXPECTED_PROMPT = [{"role": r, "content": c} for r, c in CONVERSATION[:4]]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt(*turns: tuple[str, Any]) -> dict[str, Any]:
    return {"conversations": [{"from": SHAREGPT_ROLES.get(r, r), "value": c} for r, c in turns]}


def openai(*turns: tuple[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def question(n: int) -> dict[str, Any]:
    return openai(("user", f"question {n}"))


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run(tmp_path: Path, source: Path | str, **data: Any) -> tuple[PromptLoadResult, RunStore]:
    store = RunStore(str(tmp_path / "runs"), "r")
    return build_prompt_shards(DataConfig(source=str(source), **data), store), store


def all_records(store: RunStore, result: PromptLoadResult) -> list[dict[str, Any]]:
    return [record for ref in result.shards for record in store.read_shard_records(ref)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
@pytest.mark.parametrize("form", [sharegpt, openai])
def test_both_forms_in_every_file_type_give_the_same_prompt_and_id(tmp_path: Path, suffix: str, form: Any) -> None:
    source = write_rows(tmp_path / f"data{suffix}", [form(*CONVERSATION), form(("user", "Hi <think> there"))])
    result, store = run(tmp_path, source, turns="last")

    records = all_records(store, result)
    assert [r["messages"] for r in records] == [EXPECTED_PROMPT, [{"role": "user", "content": "Hi <think> there"}]]
    assert records[0]["id"] == prompt_id(EXPECTED_PROMPT)
    assert [r["row"] for r in records] == [0, 1]
    assert (result.rows, result.accepted, result.rejected) == (2, 2, 0)


def test_each_user_turn_of_a_multi_turn_row_is_its_own_prompt(tmp_path: Path) -> None:
    follow_up = [("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 5+5?")]
    source = write_rows(tmp_path / "d.jsonl", [sharegpt(*CONVERSATION), sharegpt(*follow_up)])
    result, store = run(tmp_path, source, turns="each")

    records = all_records(store, result)
    turns = [[m["content"] for m in r["messages"]] for r in records]
    assert turns == [["You are terse.", "What is 2+2?"], ["You are terse.", "What is 2+2?", "4", "And 3+3?"],
                     ["What is 2+2?"], ["What is 2+2?", "4", "And 5+5?"]]
    assert [(r["row"], r["turn"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (result.rows, result.accepted, result.rejected) == (2, 2, 0)
    again, _ = run(tmp_path / "again", write_rows(tmp_path / "e.jsonl", [sharegpt(*follow_up), sharegpt(*follow_up)]),
                   turns="each")
    assert (again.accepted, again.rejected) == (1, 1), "a row whose every turn was seen is a duplicate"


def test_a_folder_source_reads_every_data_file_in_name_order(tmp_path: Path) -> None:
    write_rows(tmp_path / "data" / "b.jsonl", [question(3)])
    write_rows(tmp_path / "data" / "a.jsonl", [question(1), question(2)])
    write_rows(tmp_path / "data" / "nested" / "c.json", [question(4)])
    (tmp_path / "data" / "README.md").write_text("not data")

    result, store = run(tmp_path, tmp_path / "data")

    contents = [r["messages"][0]["content"] for r in all_records(store, result)]
    assert contents == ["question 1", "question 2", "question 3", "question 4"]


def test_a_folder_mixing_json_and_parquet_is_refused(tmp_path: Path) -> None:
    write_rows(tmp_path / "data" / "a.jsonl", [question(1)])
    write_rows(tmp_path / "data" / "b.parquet", [question(2)])
    with pytest.raises(ValueError, match="mixes JSON and Parquet"):
        run(tmp_path, tmp_path / "data")


def test_local_sources_that_are_not_data_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "q.csv").write_text("question\nhi\n")
    with pytest.raises(ValueError, match=r"holds no \.jsonl, \.json or \.parquet files"):
        load_rows(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unsupported file type"):
        load_rows(str(tmp_path / "q.csv"))


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": None}, "no conversations or messages value"),
        (openai(("user", "  \n\t")), "empty user turn"),
        (openai(("user", "")), "empty user turn"),
        (openai(("user", 5)), "content is int, not a string"),
        (openai(("user", [{"type": "input_audio"}])), "turn 0 has a content part of type 'input_audio'"),
        (openai(("user", [])), "empty user turn"),
        (openai(("assistant", [{"type": "image_url", "image_url": {"url": "x.png"}}]), ("user", "hi")),
         "turn 0 (assistant) shows images; only user turns may"),
        (openai(("system", None), ("user", "hi")), "content is NoneType, not a string"),
        (openai(("tool", "x"), ("user", "hi")), "turn 0 is a tool result without a call before it"),
        (openai(("system", "s"), ("assistant", "a")), "no user turn"),
        (openai(), "no user turn"),
        (openai(("user", "bad \ud800 surrogate")), "text is not valid UTF-8"),
        (openai(("user", "decoded \ufffd garbage")), "text is not valid UTF-8"),
        ({"messages": "hi"}, "not a list of turns"),
        ({"messages": ["hi"]}, "turn 0 is not a {role, content} object"),
    ],
)
def test_each_bad_row_is_rejected_with_its_reason(row: dict[str, Any], reason: str) -> None:
    with pytest.raises(RowRejected, match=re.escape(reason)):
        normalize_messages(row)


def test_forced_format_reads_only_its_own_form() -> None:
    row = {**sharegpt(("user", "from sharegpt")), **openai(("user", "from openai"))}
    assert normalize_messages(row, "auto") == [{"role": "user", "content": "from sharegpt"}]
    assert normalize_messages(row, "openai") == [{"role": "user", "content": "from openai"}]
    with pytest.raises(RowRejected, match="no conversations value"):
        normalize_messages(openai(("user", "hi")), "sharegpt")


def test_sharegpt_model_role_is_the_assistant() -> None:
    row = {
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "model", "value": "a"},
            {"from": "user", "value": "q2"},
        ]
    }
    assert [m["role"] for m in normalize_messages(row)] == ["user", "assistant", "user"]


def test_bad_rows_in_a_file_are_logged_and_the_good_ones_kept(tmp_path: Path) -> None:
    source = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(question(0)),
        json.dumps(openai(("user", "   "))),
        json.dumps(openai(("user", 7))),
        json.dumps(openai(("critic", "x"), ("user", "q"))),
        json.dumps(openai(("assistant", "only me"))),
        json.dumps(question(0)),  # duplicate of row 0
        json.dumps(sharegpt(("user", "question 0"))),  # the same prompt in the other form: also a duplicate
        json.dumps(question(1)),
    ]
    raw = "\n".join(lines).encode() + b'\n{"messages": [{"role": "user", "content": "bad \xff byte"}]}\n'
    source.write_bytes(raw)

    result, store = run(tmp_path, source)

    assert [r["messages"][0]["content"] for r in all_records(store, result)] == ["question 0", "question 1"]
    assert (result.rows, result.accepted, result.rejected) == (9, 2, 7)
    assert result.rows == result.accepted + result.rejected
    rejected = store.read_jsonl(REJECTED_PATH)
    assert [r["row"] for r in rejected] == [1, 2, 3, 4, 5, 6, 8]
    assert {r["stage"] for r in rejected} == {"prompts"}
    reasons = [r["reason"] for r in rejected]
    assert "empty user turn" in reasons[0]
    assert "content is int" in reasons[1]
    assert "unknown role 'critic'" in reasons[2]
    assert reasons[3] == "no user turn"
    first_id = rollout_id([{"role": "user", "content": "question 0"}], None)  # the default: a conversation
    assert rejected[4] == {
        "row": 5,
        "id": first_id,
        "stage": "prompts",
        "reason": f"duplicate of id {first_id} (row 0)",
    }
    assert rejected[5]["id"] == first_id
    assert reasons[6] == "text is not valid UTF-8"
    assert "id" not in rejected[0]


def test_ids_are_stable_across_loads_and_row_order(tmp_path: Path) -> None:
    rows = [question(n) for n in range(5)]
    first, store_a = run(tmp_path / "a", write_rows(tmp_path / "a.jsonl", rows))
    again, store_b = run(tmp_path / "b", write_rows(tmp_path / "a2.jsonl", rows))
    reordered, store_c = run(tmp_path / "c", write_rows(tmp_path / "b.parquet", rows[::-1]))

    def ids(store: RunStore, result: PromptLoadResult) -> dict[str, str]:
        return {r["messages"][0]["content"]: r["id"] for r in all_records(store, result)}

    assert ids(store_a, first) == ids(store_b, again) == ids(store_c, reordered)
    assert len(set(ids(store_a, first).values())) == 5
    assert first.shards == again.shards  # same bytes, same hashes: downstream caches hit


def test_the_id_is_a_pinned_hash_of_the_canonical_messages() -> None:
    # Changing the scheme would orphan every earlier run's ids, so the value itself is pinned.
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    assert prompt_id(messages) == "f93e339c4b196280"
    assert prompt_id([{"content": m["content"], "role": m["role"]} for m in messages]) == "f93e339c4b196280"


def test_prompts_are_cut_into_fixed_size_shards_in_input_order(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [question(n) for n in range(7)])
    result, store = run(tmp_path, source, shard_size=3)

    assert [(ref.index, ref.path, ref.num_records) for ref in result.shards] == [
        (0, "prompts/shard-00000.jsonl", 3),
        (1, "prompts/shard-00001.jsonl", 3),
        (2, "prompts/shard-00002.jsonl", 1),
    ]
    for ref in result.shards:
        assert ref.stage == "prompts"
        assert ref.sha256 == sha256_hex(store.read_bytes(ref.path))
    assert [r["row"] for r in all_records(store, result)] == list(range(7))
    assert store.read_jsonl(REJECTED_PATH) == []


def test_a_rerun_with_fewer_shards_removes_the_stale_ones(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [question(n) for n in range(6)])
    run(tmp_path, source, shard_size=2)
    result, store = run(tmp_path, source, shard_size=2, limit=3)

    assert store.list("prompts", ".jsonl") == ["prompts/shard-00000.jsonl", "prompts/shard-00001.jsonl"]
    assert [ref.num_records for ref in result.shards] == [2, 1]


def test_limit_reads_only_the_first_rows(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.parquet", [question(n) for n in range(5)])
    result, store = run(tmp_path, source, limit=3)

    assert (result.rows, result.accepted) == (3, 3)
    assert [r["messages"][0]["content"] for r in all_records(store, result)] == [f"question {n}" for n in range(3)]
    assert len(list(load_rows(str(source), "train", 2))) == 2


def test_a_dataset_without_a_prompt_column_is_a_one_line_error(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"found columns \[question, answer\]") as info:
        run(tmp_path, source)
    message = str(info.value)
    assert "\n" not in message
    assert "`conversations`" in message and "`messages`" in message


def test_a_forced_format_that_does_not_match_the_dataset_names_the_column(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [sharegpt(("user", "hi"))])
    with pytest.raises(ValueError, match=r"found columns \[conversations\], expected `messages`"):
        run(tmp_path, source, format="openai")


def test_a_dataset_whose_every_row_is_rejected_points_to_the_rejection_log(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [openai(("user", " ")), openai(("assistant", "a"))])
    with pytest.raises(ValueError, match="every one of its 2 rows was rejected") as info:
        run(tmp_path, source)
    assert REJECTED_PATH in str(info.value)
    store = RunStore(str(tmp_path / "runs"), "r")
    assert len(store.read_jsonl(REJECTED_PATH)) == 2
    assert store.list("prompts", ".jsonl") == [], "no prompt shard"


def test_a_missing_local_path_is_a_one_line_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="no such file or folder") as info:
        load_rows(str(missing))
    assert str(missing) in str(info.value)
    assert "\n" not in str(info.value)


def test_a_changed_shard_is_refused_by_the_next_stage(tmp_path: Path) -> None:
    result, store = run(tmp_path, write_rows(tmp_path / "q.jsonl", [question(1)]))
    ref = result.shards[0]
    store.write_jsonl(ref.path, [{"id": "x", "messages": [], "row": 0}])
    with pytest.raises(ValueError, match="changed since the prompts stage wrote it"):
        store.read_shard_records(ref)


def test_rows_from_any_iterable_keep_the_invariant(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "r")
    rows = [question(1), {"messages": None}, question(1), question(2)]
    result = write_prompt_shards(rows, store, shard_size=10)
    assert (result.rows, result.accepted, result.rejected) == (4, 2, 2)
    assert result.rows == result.accepted + result.rejected


def test_the_prefect_task_writes_the_run_folder_and_returns_a_picklable_result(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [sharegpt(*CONVERSATION), question(1), question(1)])
    data = DataConfig(source=str(source), shard_size=1, turns="last")

    settings = PromptSettings(data, [ModeWeight(mode="thinking", weight=1.0)], "fp")
    result = load_prompts.fn(settings, RunLocation(str(tmp_path / "runs"), "demo"))

    assert (result.rows, result.accepted, result.rejected) == (3, 2, 1)
    assert [ref.path for ref in result.shards] == ["prompts/shard-00000.jsonl", "prompts/shard-00001.jsonl"]
    assert (tmp_path / "runs" / "demo" / "prompts" / "shard-00001.jsonl").is_file()
    assert (tmp_path / "runs" / "demo" / REJECTED_PATH).is_file()
    assert pickle.loads(pickle.dumps(result)) == result


def test_a_torn_jsonl_line_is_rejected_with_its_line_number_and_the_rest_goes_on(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [sharegpt(("user", f"question {i}")) for i in range(5)])
    lines = source.read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]  # a write cut off half-way
    source.write_text("\n".join([*lines, "[1, 2]"]) + "\n")
    result, store = run(tmp_path, source)
    assert (result.rows, result.accepted, result.rejected) == (6, 4, 2)
    reasons = {row["row"]: row["reason"] for row in store.read_jsonl(REJECTED_PATH)}
    assert reasons[2].startswith("q.jsonl line 3 is not valid JSON")
    assert reasons[5] == "q.jsonl line 6 is not a JSON object"
    summary = store.read_json("prompts/summary.json")
    assert summary | {"holdout": None} == {"rows": 6, "accepted_rows": 4, "rejected_rows": 2, "prompts": 4,
                                           "shards": 1, "holdout": None}
    assert summary["holdout"]["prompts"] == {"thinking": 1}  # a quarter of 4: the minimum of 20 is capped


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json", "empty.parquet"])
def test_an_empty_dataset_is_named_as_such(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(DataSourceError, match=r"(is empty|no rows were read)") as info:
        run(tmp_path, tmp_path / name)
    assert "\n" not in str(info.value)


def test_a_coarser_layout_removes_every_later_stage_file_of_the_shards_it_no_longer_has(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Their answers stay until generation has adopted them where their prompts are now, then go too."""
    from tasks.generation.records import retire_generations_beyond

    source = write_rows(tmp_path / "data.jsonl", [question(n) for n in range(6)])
    result, store = run(tmp_path, source, shard_size=2)
    assert len(result.shards) == 3
    kept = ["generations/settings.json", "generations/shard-00000.jsonl", "sequences/shard-00000.parquet",
            "rejected/prompts.jsonl"]
    answers = ["generations/shard-00001.jsonl", "generations/shard-00001.done.json",
               "generations/shard-00002.partial.jsonl", "generations/shard-00002.partial/segment-00000.jsonl",
               "rejected/generations-shard-00002.jsonl"]
    retired = ["validation/shard-00001.json", "sequences/shard-00002.parquet", "hidden_states/shard-00001/index.json"]
    for rel in kept[:-1] + answers + retired:
        store.write_bytes(rel, b"{}\n")

    with caplog.at_level("WARNING"):
        result, store = run(tmp_path, source, shard_size=6)  # the same prompts, all in shard 0 now

    assert len(result.shards) == 1
    assert [rel for rel in kept if store.exists(rel)] == kept
    assert [rel for rel in retired if store.exists(rel)] == []
    assert not store.exists("hidden_states/shard-00001")
    assert "removed 3 files and folders of shard-00001 and later shards, made for an earlier shard layout" \
        in caplog.text
    assert [rel for rel in answers if store.exists(rel)] == answers, "left for generation to adopt"
    retire_generations_beyond(store, len(result.shards), run_id=None)
    assert [rel for rel in answers if store.exists(rel)] == [] and not store.exists("generations/shard-00002.partial")
    assert [rel for rel in kept if store.exists(rel)] == kept


def test_verify_names_files_of_shards_the_prompts_no_longer_have(tmp_path: Path) -> None:
    from tasks.verify import verify_run

    _, store = run(tmp_path, write_rows(tmp_path / "data.jsonl", [question(n) for n in range(3)]))
    store.write_bytes("sequences/shard-00001.parquet", b"left by a layout of two shards")
    assert "1 files of shards the prompts no longer have, e.g. sequences/shard-00001.parquet: a folder read whole " \
           "would hold their prompts twice (run the pipeline again)" in verify_run(store).problems


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_function_calling_rows_are_read_in_the_openai_and_the_sharegpt_shapes(tmp_path: Path) -> None:
    """OpenAI `tool_calls`/`tool` messages and LLaMA-Factory's `function_call`/`observation` turns with a `tools`
    JSON column give one conversation: each result knows the function it answers, the tools are offered."""
    openai_row = {"tools": [{"type": "function", "function": WEATHER}], "messages": [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "b", "content": "sun"},
        {"role": "tool", "tool_call_id": "a", "content": "snow"},
        {"role": "assistant", "content": "Snow in Oslo, sun in Rome."}]}
    sharegpt_row = {"tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather in Lima?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Lima"}})},
        {"from": "observation", "value": "clouds"},
        {"from": "gpt", "value": "Cloudy."}]}
    store = RunStore(str(tmp_path), "run")
    result = write_prompt_shards([openai_row, sharegpt_row], store, 8, turns="rollout")
    first, second = store.read_jsonl(result.shards[0].path)
    assert first["messages"] == [{"role": "user", "content": "Weather in Oslo and Rome?"},  # in the calls' order
                                 {"role": "tool", "name": "get_weather", "content": "snow"},
                                 {"role": "tool", "name": "get_weather", "content": "sun"}]
    assert second["messages"] == [{"role": "user", "content": "Weather in Lima?"},
                                  {"role": "tool", "name": "get_weather", "content": "clouds"}]
    assert first["tools"] == second["tools"] == [{"type": "function", "function": WEATHER}]
    assert first["turns"] == second["turns"] == 1
    # asked one prompt per user turn, the dataset's calls and results stay in the history as the protocol sends them
    follow_up = {**openai_row, "messages": [*openai_row["messages"], {"role": "user", "content": "And Lima?"}]}
    prompt = normalize_messages(follow_up)
    assert prompt[1]["tool_calls"][1]["function"]["arguments"] == '{"city": "Rome"}'
    assert prompt[2] == {"role": "tool", "tool_call_id": "b", "content": "sun"}


HERMES_SYSTEM = ("You are a function calling AI model. You are provided with function signatures within "
                 "<tools></tools> XML tags. <tools> [{'type': 'function', 'function': {'name': 'get_weather', "
                 "'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}}}}] </tools> For each "
                 "function call return a json object within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
                 "{'arguments': <args-dict>, 'name': <function-name>}\n</tool_call>")


def test_hermes_function_calling_rows_are_read_with_their_parallel_calls_and_their_tools(tmp_path: Path) -> None:
    """NousResearch's Hermes shape: the tools in the system prompt's `<tools>` (Python literals, as its datasets
    write them), calls as `<tool_call>` blocks in a `gpt` turn, results as `<tool_response>` blocks: each result
    answers the next call of its function; the system prompt is the served template's to word."""
    row = {"conversations": [
        {"from": "system", "value": HERMES_SYSTEM},
        {"from": "human", "value": "Weather in Oslo and Rome?"},
        {"from": "gpt", "value": "<tool_call>\n{'arguments': {'city': 'Oslo'}, 'name': 'get_weather'}\n</tool_call>\n"
                                 "<tool_call>\n{\"arguments\": {\"city\": \"Rome\"}, \"name\": \"get_weather\"}\n"
                                 "</tool_call>"},
        {"from": "tool", "value": "<tool_response>\n{\"name\": \"get_weather\", \"content\": \"snow\"}\n"
                                  "</tool_response>\n<tool_response>\n{'name': 'get_weather', 'content': "
                                  "{'sky': 'sun'}}\n</tool_response>"},
        {"from": "gpt", "value": "Snow in Oslo, sun in Rome."}]}
    conversation = normalize_conversation(row)
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["arguments"] for c in conversation[1]["tool_calls"]] == ['{"city": "Oslo"}',
                                                                                  '{"city": "Rome"}']
    assert [(m["tool_call_id"], m["content"]) for m in conversation[2:4]] == [("call_2_0", "snow"),
                                                                              ("call_2_1", '{"sky": "sun"}')]
    assert row_tools(row) == [{"type": "function", "function": WEATHER}]
    store = RunStore(str(tmp_path), "run")
    [prompt] = store.read_jsonl(write_prompt_shards([row], store, 8, turns="rollout").shards[0].path)
    assert prompt["messages"] == [{"role": "user", "content": "Weather in Oslo and Rome?"},
                                  {"role": "tool", "name": "get_weather", "content": "snow"},
                                  {"role": "tool", "name": "get_weather", "content": '{"sky": "sun"}'}]
    assert prompt["tools"] == [{"type": "function", "function": WEATHER}]


def test_the_offered_tools_are_part_of_a_prompts_id() -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    assert prompt_id(messages) != prompt_id(messages, [{"type": "function", "function": WEATHER}])
    assert prompt_id(messages, None) == prompt_id(messages)


@pytest.mark.parametrize(("row", "reason"), [
    ({**openai(("user", "q")), "tools": "{not json"}, "tools is not JSON"),
    ({**openai(("user", "q")), "tools": [{"description": "nameless"}]}, "a tool in tools has no name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"id": "x"}]}]},
     "turn 1 tool_calls is not a list of {id, function: {name, arguments}}"),
    (sharegpt(("user", "q"), ("function_call", "not json")), "turn 1 function_call is not JSON"),
    (sharegpt(("user", "q"), ("gpt", "<tool_call>get_weather(Oslo)</tool_call>")), "turn 1 <tool_call> is not JSON"),
    (sharegpt(("user", "q"), ("gpt", "<tool_call>{'name': 'a'}</tool_call>"),
              ("tool", "<tool_response>{'name': 'b', 'content': 1}</tool_response>")),
     "turn 2 is a tool result without a call before it"),
])
def test_a_bad_function_calling_row_is_rejected_with_its_reason(tmp_path: Path, row: dict[str, Any],
                                                                  reason: str) -> None:
    store = RunStore(str(tmp_path), "run")
    write_prompt_shards([row, question(1)], store, 8, turns="rollout")
    [rejection] = store.read_jsonl(REJECTED_PATH)
    assert rejection["reason"] == reason
