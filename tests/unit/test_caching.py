"""Cache keys follow the code: a change anywhere in a stage module (not only its @task function) re-runs it."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import tasks.sequences
import tasks.validation
from eagle3_datagen import fingerprints
from eagle3_datagen.caching import code_version, source_digest, stage_files
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.think_tokens import think_token_proof


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


def test_a_stage_package_is_hashed_whole() -> None:
    """A fix in the batching module of the hidden-state package re-runs extraction, not only one in its task."""
    import tasks.hidden_states.task  # noqa: F401

    names = {file.name for file in stage_files("tasks.hidden_states.task")}
    assert {"batching.py", "parts.py", "transformers_backend.py", "vllm_backend.py", "task.py"} <= names
    assert [file.name for file in stage_files("tasks.sequences")] == ["sequences.py"]



def test_a_stage_key_is_computed_without_parsing_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys are computed in task threads, where CPython 3.11's ast module fails a parse that overlaps one in another
    thread (a traceback being formatted): a re-run that hit it could not cache, and its log showed the traceback."""
    from eagle3_datagen.caching import StageCode

    policy = next(p for p in tasks.sequences.build_sequence_shard.cache_policy.policies if isinstance(p, StageCode))
    code_version.cache_clear()

    def parse(*args: object, **kwargs: object) -> None:
        raise SystemError("AST constructor recursion depth mismatch (before=66, after=88)")

    monkeypatch.setattr(ast, "parse", parse)
    assert policy.compute_key(None, {}, {}) == policy.version  # type: ignore[arg-type]
    monkeypatch.undo()
    assert policy.version == code_version("tasks.sequences")

_STAGE = '''"""A stage."""
from pydantic import BaseModel, Field

LIMIT = 3  # the most


class Settings(BaseModel):
    """Its settings."""

    size: int = Field(default=4, gt=0, description="How many.", title="Size")


def core(x):
    """Adds the limit."""
    return x + LIMIT
'''


@pytest.mark.parametrize(("old", "new", "same"), [
    ("# the most", "# the most, reworded", True),
    ('"""Adds the limit."""', '"""Adds the limit, said otherwise."""', True),
    ('"""A stage."""', '"""A stage, said otherwise."""', True),
    ('description="How many."', 'description="How many, said otherwise."', True),
    ('title="Size"', 'title="Count"', True),
    ("LIMIT = 3", "LIMIT = 4", False),
    ("x + LIMIT", "x - LIMIT", False),
    ("gt=0", "ge=0", False),
])
def test_only_a_change_to_the_code_changes_the_digest(tmp_path: Path, old: str, new: str, same: bool) -> None:
    """A comment, docstring or field description changes no output, so it keeps every cached stage."""
    before, after = tmp_path / "before" / "stage.py", tmp_path / "after" / "stage.py"
    for file, text in ((before, _STAGE), (after, _STAGE.replace(old, new))):
        file.parent.mkdir()
        file.write_text(text)
    assert after.read_text() != _STAGE
    assert (source_digest([before]) == source_digest([after])) is same


STAGE_INPUTS = """
from prefect.cache_policies import INPUTS
from eagle3_datagen.config import parse_config
from eagle3_datagen.storage import RunLocation
from tasks.generation import GenerationJob
from tasks.hidden_states import ExtractionSettings
from eagle3_datagen.holdout import NO_HOLDOUT
from tasks.sequences import SequenceSettings
from tasks.validation import ValidationSettings

config = parse_config({"run_name": "r", "data": {"source": "d.jsonl"}, "server": {"endpoints": ["http://x:1"]},
                       "model": {"name": "m", "profile": "qwen3", "tokenizer": "t"}})
settings = [GenerationJob.from_config(config), ValidationSettings.from_config(config),
            SequenceSettings.from_config(config, "tokenizer-fp", NO_HOLDOUT),
            ExtractionSettings.from_config(config, "target-fp")]
print(" ".join(INPUTS.compute_key(None, {"settings": s, "run": RunLocation("/runs", "r")}, {}) for s in settings))
"""


def test_stage_settings_hash_the_same_in_every_process() -> None:
    """A stage's settings and run are its cache key: a key that differed between processes (a worker, a re-run)
    would redo every stage."""
    import os
    import subprocess

    keys = {subprocess.run([sys.executable, "-c", STAGE_INPUTS], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(keys) == 1 and len(set(keys.pop().split())) == 4


def test_a_cached_shard_result_counts_only_while_its_output_was_made_from_the_same_input(tmp_path: Path) -> None:
    from eagle3_datagen.artifacts import ShardRef, artifact_path
    from eagle3_datagen.caching import OutputMadeFrom
    from eagle3_datagen.storage import RunLocation, marker_path

    run = RunLocation(str(tmp_path), "run")
    store = run.store()
    policy = OutputMadeFrom(input_name="generations", record=lambda i: marker_path(artifact_path("sequences", i)),
                            key="generations_sha256", output=lambda i: artifact_path("sequences", i))
    a, b = (ShardRef("generations", 2, artifact_path("generations", 2), 4, sha) for sha in ("a" * 64, "b" * 64))

    def key(ref: ShardRef) -> str | None:
        return policy.compute_key(None, {"generations": ref, "run": run}, None)  # type: ignore[arg-type]

    assert key(a) is None, "no output yet: the key stays that of the inputs and the code"
    store.write_shard_bytes("sequences", 2, b"parquet of a", 4, generations_sha256=a.sha256)
    assert key(a) is None, "made from this input: a re-run stays cached"
    assert key(b) is not None, "made from other input: the stage runs again"
    store.remove(marker_path(artifact_path("sequences", 2)))
    assert key(a) is not None, "an output nothing vouches for runs again"


def test_a_data_file_edited_in_place_to_the_same_size_is_another_source(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the size where a weight file is known by name and size, a prompt file is still hashed whole: an edit
    that keeps its size must not leave the prompt stage cached on the old prompts."""
    monkeypatch.setattr(fingerprints, "_SMALL_FILE_BYTES", 8)  # the file below counts as big
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is 2+2?"}\n')
    before = fingerprints.data_fingerprint(str(data))
    data.write_text('{"prompt": "What is 3+3?"}\n')
    assert fingerprints.data_fingerprint(str(data)) != before
    assert fingerprints.data_fingerprint(f"file://{data}") == fingerprints.data_fingerprint(str(data))
    small = tmp_path / "small.jsonl"  # below the threshold both fingerprints hash the content, and agree
    monkeypatch.setattr(fingerprints, "_SMALL_FILE_BYTES", 64 << 20)
    small.write_text('{"prompt": "hi"}\n')
    assert fingerprints.data_fingerprint(str(small)) == fingerprints.fingerprint(str(small))


def test_the_flow_and_the_command_import_neither_torch_nor_transformers() -> None:
    """They load with the first tokenizer, target or tensor: a re-run whose stages are all cached needs none."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, cli.main, cli.runner, flows.pipeline; "
         "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'transformers', 'datasets'}))"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert loaded.stdout.strip() == "[]"


def test_recorded_think_tokens_hold_for_the_same_tokenizer_files_and_profile_only(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    qwen3, deepseek = BUILTIN_PROFILES["qwen3"], BUILTIN_PROFILES["deepseek-r1"]
    proof = think_token_proof(str(tmp_path), fingerprint(str(tmp_path)), qwen3)
    assert proof == think_token_proof(str(tmp_path), fingerprint(str(tmp_path)), qwen3)
    assert proof != think_token_proof(str(tmp_path), fingerprint(str(tmp_path)), deepseek)
    (tmp_path / "tokenizer.json").write_text('{"edited": true}')
    assert proof != think_token_proof(str(tmp_path), fingerprint(str(tmp_path)), qwen3)
    assert think_token_proof("org/hub-model", fingerprint("org/hub-model"), qwen3) is None, "no files to vouch"
