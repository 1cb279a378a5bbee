"""One truth for "done": a stage's output counts only while storage records it under the key computed now."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from eagle3_datagen import fingerprints
from eagle3_datagen.artifacts import ShardRef, artifact_path
from eagle3_datagen.caching import StageOutput, handed_on
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunLocation
from eagle3_datagen.think_tokens import think_token_proof

SEQUENCES_LIKE = StageOutput("sequences", version=1, record=lambda ref: artifact_path("sequences", ref.index),
                             marked=True)


def test_settings_a_then_b_then_a_again_runs_the_stage_again(tmp_path: Path) -> None:
    """Settings A, then B (which rewrites the same output from the same input), then A: storage holds B's output,
    so A is not done and runs again, whatever a cache of the first A run would say."""
    store = RunLocation(str(tmp_path), "run").store()
    ref = ShardRef("generations", 2, artifact_path("generations", 2), 4, "a" * 64)
    key_a, key_b = (SEQUENCES_LIKE.key(generations=ref, settings=settings) for settings in ("A", "B"))
    assert SEQUENCES_LIKE.done(store, ref, key_a) is None, "no output yet: the task runs"
    store.write_shard_bytes("sequences", 2, b"made under A", 4, stage_key=key_a)
    assert SEQUENCES_LIKE.done(store, ref, key_a) is not None, "made under this key: handed on"
    assert SEQUENCES_LIKE.done(store, ref, key_b) is None, "other settings: the task runs"
    store.write_shard_bytes("sequences", 2, b"made under B", 4, stage_key=key_b)
    assert SEQUENCES_LIKE.done(store, ref, key_a) is None, "storage holds B's output: A runs again"
    store.remove("sequences")
    assert SEQUENCES_LIKE.done(store, ref, key_b) is None, "a deleted folder is rebuilt"


def test_an_output_found_done_is_handed_on_as_itself_outside_a_task_run() -> None:
    """Inside a task run it becomes Prefect's Cached state (tests/e2e/test_pipeline.py counts the stage lines)."""
    assert handed_on("the stored output", "k" * 64) == "the stored output"


def test_an_output_changed_behind_its_marker_is_not_done(tmp_path: Path) -> None:
    store = RunLocation(str(tmp_path), "run").store()
    ref = ShardRef("generations", 0, artifact_path("generations", 0), 1, "a" * 64)
    key = SEQUENCES_LIKE.key(generations=ref, settings="A")
    store.write_shard_bytes("sequences", 0, b"parquet", 1, stage_key=key)
    assert SEQUENCES_LIKE.done(store, ref, key) is not None
    store.write_bytes(artifact_path("sequences", 0), b"another parquet, longer")
    assert SEQUENCES_LIKE.done(store, ref, key) is None


def test_the_key_follows_inputs_settings_and_output_version_but_not_an_unset_new_setting() -> None:
    class Old(BaseModel):
        size: int = 4

    class New(BaseModel):
        size: int = 4
        colour: str = "none"  # a setting added by an upgrade, left unset

    @dataclasses.dataclass(frozen=True)
    class Settings:
        config: BaseModel
        limit: int = 0

    ref = ShardRef("generations", 0, artifact_path("generations", 0), 1, "a" * 64)
    key = SEQUENCES_LIKE.key(generations=ref, settings=Settings(Old()))
    assert key == SEQUENCES_LIKE.key(generations=ref, settings=Settings(New()))
    assert key != SEQUENCES_LIKE.key(generations=ref, settings=Settings(New(colour="red")))
    assert key != SEQUENCES_LIKE.key(generations=ref, settings=Settings(Old(size=5)))
    assert key != SEQUENCES_LIKE.key(generations=ref, settings=Settings(Old(), limit=1))
    assert key != SEQUENCES_LIKE.key(generations=dataclasses.replace(ref, sha256="b" * 64), settings=Settings(Old()))
    bumped = dataclasses.replace(SEQUENCES_LIKE, version=2)
    assert key != bumped.key(generations=ref, settings=Settings(Old()))


STAGE_INPUTS = """
from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import parse_config
from tasks.generation.records import GENERATIONS
from tasks.hidden_states.task import HIDDEN_STATES
from tasks.sequences import SEQUENCES
from tasks.validation import VALIDATION
from tasks.generation import GenerationJob
from tasks.hidden_states import ExtractionSettings
from eagle3_datagen.holdout import NO_HOLDOUT
from tasks.sequences import SequenceSettings
from tasks.validation import ValidationSettings

config = parse_config({"run_name": "r", "data": {"source": "d.jsonl"}, "server": {"endpoints": ["http://x:1"]},
                       "model": {"name": "m", "profile": "qwen3", "tokenizer": "t"}})
ref = ShardRef("generations", 0, "generations/shard-00000.jsonl", 3, "a" * 64)
print(GENERATIONS.key(prompt_shards=[ref], job=GenerationJob.from_config(config)),
      VALIDATION.key(generations=ref, settings=ValidationSettings.from_config(config)),
      SEQUENCES.key(generations=ref, settings=SequenceSettings.from_config(config, "tokenizer-fp", NO_HOLDOUT)),
      HIDDEN_STATES.key(sequences=ref, extraction=ExtractionSettings.from_config(config, "target-fp")))
"""


def test_stage_settings_hash_the_same_in_every_process() -> None:
    """A stage's settings are in its key: a key that differed between processes (a worker, a re-run) would redo
    every stage."""
    import os

    keys = {subprocess.run([sys.executable, "-c", STAGE_INPUTS], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(keys) == 1 and len(set(keys.pop().split())) == 4


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
