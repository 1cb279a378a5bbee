"""Cache keys follow the code: a change anywhere in a stage module (not only its @task function) re-runs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import tasks.sequences
import tasks.validation  # noqa: F401
from eagle3_datagen.caching import code_version


def test_a_change_in_a_stage_core_function_changes_the_code_version(tmp_path: Path) -> None:
    module = tmp_path / "stage_under_test.py"
    module.write_text("def core(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("stage_under_test", module)
    assert spec and spec.loader
    sys.modules["stage_under_test"] = importlib.util.module_from_spec(spec)
    try:
        before = code_version("stage_under_test")
        assert code_version("stage_under_test") == before
        module.write_text("def core(x):\n    return x + 2\n")
        code_version.cache_clear()
        assert code_version("stage_under_test") != before
        assert code_version("tasks.sequences") != code_version("tasks.validation")
    finally:
        del sys.modules["stage_under_test"]
        code_version.cache_clear()
