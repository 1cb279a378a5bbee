"""The pure cores behind what the Prefect UI shows: artifact keys, outputs made absolute, the live shard table,
and the latency the report plots."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eagle3_datagen.artifacts import ShardRef, ui_key
from eagle3_datagen.config import PipelineConfig, ServerConfig, absolute_uri
from eagle3_datagen.errors import ConfigurationError, OneLineFormatter, UserError
from tasks.generation.progress import shard_rows
from tasks.run.plots import latency_over_time
from tasks.run.report import where_outputs_are


def test_artifact_keys_fit_prefect_and_keep_runs_apart() -> None:
    assert ui_key("my-run", "report") == "my-run-report"
    odd = ui_key("My_Run.v2", "report")
    assert odd.startswith("my-run-v2-") and odd.endswith("-report") and odd != ui_key("my-run-v2", "report")
    assert set(odd) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


def test_a_relative_output_is_made_absolute_where_the_run_started_or_refused_without_one(tmp_path: Path) -> None:
    assert absolute_uri("runs", tmp_path, "output_uri") == str(tmp_path / "runs")
    assert absolute_uri("s3://bucket/x", None, "output_uri") == "s3://bucket/x"
    assert absolute_uri("/data/runs", None, "output_uri") == "/data/runs"
    with pytest.raises(ConfigurationError, match="set output_uri to an absolute path or s3://bucket/prefix"):
        absolute_uri("./runs", None, "output_uri")


def _prompts(index: int, count: int) -> ShardRef:
    return ShardRef("prompts", index, f"prompts/shard-{index:05d}.jsonl", count, "0" * 64)


def test_local_inputs_given_relative_are_recorded_absolute_and_hub_ids_as_written(tmp_path: Path) -> None:
    """A `rerun-failed` from another folder, or a deployment run, reads what the first run read."""
    from eagle3_datagen.config import parse_config
    from tasks.run.lifecycle import local_paths_made_absolute

    (tmp_path / "data.jsonl").write_text("{}\n")
    (tmp_path / "tok").mkdir()
    config = parse_config({"run_name": "r", "data": {"source": "data.jsonl"}, "server": {"endpoints": ["http://x:1"]},
                           "model": {"name": "m", "profile": "qwen3", "tokenizer": "tok"},
                           "hidden_states": {"model": "org/target"}})
    settled = config.model_copy(update=local_paths_made_absolute(config, tmp_path))
    assert settled.data.source == str(tmp_path / "data.jsonl")
    assert settled.model.tokenizer == str(tmp_path / "tok")
    assert settled.hidden_states.model == "org/target", "a hub id is not a local path"
    assert config.model_copy(update=local_paths_made_absolute(config, None)) == config, "a worker has no folder"


def test_the_shard_table_says_where_each_shard_stands() -> None:
    shards = [_prompts(0, 10), _prompts(1, 10), _prompts(2, 10)]
    counts = {0: {"records": 16}, 1: {"answered": 3, "refused": 1}}  # shard 0 written with n=2 samples a prompt
    rows = {row["shard"]: row for row in shard_rows(shards, counts, samples_per_prompt=2, ended=False)}
    assert rows["shard-00000"] == {"shard": "shard-00000", "status": "written", "prompts": 10, "answered": 8,
                                   "refused": 2, "remaining": 0}
    assert (rows["shard-00001"]["status"], rows["shard-00001"]["remaining"]) == ("generating", 6)
    assert rows["shard-00002"]["status"] == "waiting"
    ended = {row["shard"]: row["status"] for row in shard_rows(shards, counts, 2, ended=True)}
    assert ended == {"shard-00000": "written", "shard-00001": "unfinished", "shard-00002": "unfinished"}


def test_latency_follows_littles_law_per_attempt() -> None:
    # 4 requests always in flight, 2 finishing a second: each took 2 s; then a slower second attempt (8 s)
    first = [{"started_at": 1.0, "t": float(t), "done": 2 * t, "in_flight": 4.0} for t in range(6)]
    second = [{"started_at": 9.0, "t": float(t), "done": 10 + t // 2, "in_flight": 4.0} for t in range(0, 9, 2)]
    curve = latency_over_time(first + second)
    assert [latency for _, latency in curve] == [2.0] * 5 + [8.0] * 4
    assert latency_over_time(first[:1]) == [], "one sample has no interval"


def _failed(error: Exception) -> logging.LogRecord:
    try:
        raise error
    except Exception:
        return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed: %r", (error,),
                                 sys.exc_info())


def test_the_ui_log_stream_gets_a_user_error_as_one_line_and_a_bug_with_its_traceback() -> None:
    ui = OneLineFormatter(None, user_errors_only=True)
    known = _failed(UserError("data.source absent.jsonl not found: fix data.source"))
    assert ui.format(known) == ("Task run failed: UserError('data.source absent.jsonl not found: fix data.source') "
                                "(UserError)")
    assert known.exc_info is not None, "the record keeps its traceback for the run's log file"
    bug = ui.format(_failed(KeyError("shard")))
    assert bug.startswith("Task run failed: KeyError('shard')\nTraceback (most recent call last):")
    assert "Traceback" not in OneLineFormatter(None).format(_failed(KeyError("shard"))), "the console: none"


def test_the_output_is_shown_as_a_path_to_copy_with_the_commands_that_list_and_check_it() -> None:
    assert where_outputs_are("s3://team/runs/nightly") == (
        "`s3://team/runs/nightly` (list it: `aws s3 ls s3://team/runs/nightly/`; check it: "
        "`eagle3-datagen verify s3://team/runs/nightly`)")
    assert where_outputs_are("/data/runs/a").startswith("`/data/runs/a` (list it: `ls /data/runs/a`;")


def _fields(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for section in [schema, *schema["$defs"].values()]:
        yield from section.get("properties", {}).items()


def test_the_form_titles_every_field_in_words_and_offers_auto_from_a_list() -> None:
    schema = PipelineConfig.model_json_schema()
    titles = {name: field["title"] for name, field in _fields(schema)}
    assert titles["startup_timeout_s"] == "Startup timeout (seconds)" and titles["api_key_env"] == "API key variable"
    raw = [title for name, title in titles.items() if title == name.replace("_", " ").title() and "_" in name]
    assert raw == [], "titles that read as Python names"
    branches = schema["$defs"]["ServerConfig"]["properties"]["max_in_flight"]["anyOf"]
    assert {"type": "string", "enum": ["auto"], "title": "auto"} in branches
    assert not [branch for branch in branches if "const" in branch], "Prefect's form shows a const as unchangeable"
    assert ServerConfig.model_validate({"max_in_flight": "auto"}).max_in_flight == "auto"


def test_the_custom_profiles_example_in_the_form_is_a_valid_profile() -> None:
    description = PipelineConfig.model_json_schema()["properties"]["profiles"]["description"]
    example = json.loads(re.search(r"`(\{.*\})`", description).group(1))  # type: ignore[union-attr]
    config = PipelineConfig.model_validate({
        "run_name": "r", "output_uri": "/runs", "data": {"source": "d.jsonl"}, "profiles": example,
        "model": {"name": "m", "profile": next(iter(example)), "tokenizer": "t"}})
    assert config.profile.reasoning_parser == "deepseek_r1"


def test_a_shortfall_names_the_shards_and_says_others_went_on_only_when_some_did(tmp_path: Path) -> None:
    from eagle3_datagen.storage import RunStore
    from tasks.run.report import run_shortfall
    from tasks.run.status import PENDING, ShardStatus, StageStatus

    store = RunStore(str(tmp_path), "r")
    done = ShardStatus(prompts=StageStatus("done", {"records": 4}), sequences=StageStatus("done"))
    short = ShardStatus(prompts=StageStatus("done", {"records": 4}), generations=PENDING)
    one_short = run_shortfall({"shard-00000": done, "shard-00001": short}, "sequences", 2, 0.5, store, "refused")
    assert one_short == "refused; 1 of 2 shards did not finish (shard-00001; the others went on to sequences)"
    all_short = run_shortfall({"shard-00000": short, "shard-00001": short}, "sequences", 2, 0.5, store, "refused")
    assert all_short == "refused; 2 of 2 shards did not finish (shard-00000, shard-00001)"
