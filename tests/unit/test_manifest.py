"""The manifest's format: runs written by an older version stay readable, a newer one's are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_datagen.artifacts import MANIFEST_FORMAT, RunTotals
from eagle3_datagen.errors import ConfigurationError
from tasks.run.lifecycle import recorded_config

CONFIG = {"run_name": "old", "output_uri": "/data/runs", "data": {"source": "/data/prompts.jsonl"},
          "model": {"name": "m", "profile": "qwen3", "tokenizer": "/models/m"},
          "server": {"endpoints": ["http://127.0.0.1:8000"]}}


def test_a_run_of_the_first_format_is_re_run_from_its_manifest(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({  # format 1: no version, the report's labels
        "status": "failed", "config": CONFIG, "totals": {"input rows": 24, "reasoning coverage": "100.0%"}}))
    assert recorded_config(str(tmp_path / "old")).run_name == "old"


def test_a_run_of_a_newer_format_is_refused_in_one_line_naming_the_fix(tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "manifest.json").write_text(json.dumps({
        "format_version": MANIFEST_FORMAT + 1, "package_version": "9.0.0", "config": CONFIG}))
    with pytest.raises(ConfigurationError, match="written by a newer eagle3-datagen") as refused:
        recorded_config(str(tmp_path / "new"))
    assert "\n" not in str(refused.value) and "upgrade eagle3-datagen" in str(refused.value)


def test_totals_are_machine_keys_in_the_manifest_and_words_in_the_report() -> None:
    totals = RunTotals(input_rows=24, rejected=1, shards=3, shards_finished=3, records_generated=23,
                       reasoning_coverage=0.95, sequence_tokens=4000, hidden_state_bytes=10)
    assert totals.as_manifest()["reasoning_coverage"] == 0.95 and "conversations" not in totals.as_manifest()
    assert totals.labelled()["reasoning coverage"] == "95.0%"
    assert totals.labelled()["hidden-state bytes"] == 10 and totals.labelled()["input rows"] == 24
