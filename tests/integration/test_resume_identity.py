"""Resume can never mix or lose data: every kept answer is tied to its prompt, its settings and its run.

Each run here stops short on purpose (a question the scripted server refuses to answer, a kill, a failed write),
then changes something between attempts, and checks what the next attempt asks and keeps.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_generation_faults import assert_exactly_once, run_generation, settings, write_prompt_shards

from eagle3_datagen.artifacts import ShardRef, artifact_path, sha256_hex
from eagle3_datagen.config import ValidationConfig
from eagle3_datagen.storage import ArtifactChanged, RunLocation, RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer, expected_reasoning
from tasks.generation import GenerationError
from tasks.generation.records import SETTINGS_FILE, segment_folder

FIRST_ANSWER_PASSES = ValidationConfig(early_abort_after=1)  # the window passes on the first answer


def stop_short(store: RunStore, refs: list[ShardRef], unanswered: str) -> None:
    """One attempt, in prompt order, that answers every prompt but those whose question contains `unanswered`."""
    with ScriptedServer(Script(unavailable_for=unanswered)) as server, pytest.raises(GenerationError):
        run_generation(store, refs, [server.url], budget=1, max_retries=0, validation=FIRST_ANSWER_PASSES)


def asked(server: ScriptedServer) -> list[str]:
    return sorted(body["messages"][-1]["content"] for body in server.log.bodies)


def answers_logged(log: Path) -> int:
    return sum("records" in json.loads(line) for line in log.read_text().splitlines())


@pytest.fixture
def object_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunStore]:
    """A run in (in-memory) object storage, its local spool under tmp_path: partial logs go both ways."""
    monkeypatch.setenv("EAGLE3_SPOOL_DIR", str(tmp_path / "spool"))
    store = RunStore(f"memory://{tmp_path.name}", "run")
    yield store
    bucket = posixpath.dirname(store.root)
    if store.fs.exists(bucket):
        store.fs.rm(bucket, recursive=True)


def test_answers_follow_their_prompt_when_the_dataset_gains_a_row(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    [ref] = write_prompt_shards(store, 1, 6)
    stop_short(store, [ref], "question 0-5")
    rows = store.read_jsonl(ref.path)
    new = {"id": "p-new", "row": 0, "messages": [{"role": "user", "content": "question new"}]}
    grown = store.write_shard("prompts", 0, [new, *rows])  # every logged prompt moved one place on
    with ScriptedServer(Script()) as server:
        run_generation(store, [grown], [server.url])
        assert asked(server) == ["question 0-5", "question new"], "only the prompts never answered are asked"
    assert_exactly_once(store, [grown])
    for record in store.read_jsonl(artifact_path("generations", 0)):
        assert record["id"] == next(r["id"] for r in [new, *rows] if r["messages"] == record["messages"])
        assert record["reasoning"] == expected_reasoning(record["messages"][-1]["content"])


def test_a_prompt_that_moved_to_another_shard_is_answered_once_there(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`shard_size` changed between attempts: answers logged for prompts now in another shard are kept there, not
    asked again, never kept in two shards nor placed at another prompt."""
    store = RunStore(str(tmp_path), "run")
    [ref] = write_prompt_shards(store, 1, 6)
    stop_short(store, [ref], "question 0-5")
    rows = store.read_jsonl(ref.path)
    smaller = [store.write_shard("prompts", 0, rows[:3]), store.write_shard("prompts", 1, rows[3:])]
    with ScriptedServer(Script()) as server, caplog.at_level(logging.WARNING, "test"):
        run_generation(store, smaller, [server.url])
        assert asked(server) == ["question 0-5"], "only the prompt never answered is asked"
    assert assert_exactly_once(store, smaller) == (6, 0)
    assert any("shard 00000: 2 logged answers are of prompts no longer in this shard" in r.getMessage()
               for r in caplog.records)
    for record in store.read_jsonl(artifact_path("generations", 1)):
        assert record["reasoning"] == expected_reasoning(record["messages"][-1]["content"]), "its own answer"


def test_a_partial_log_of_an_older_version_is_refused_with_one_line(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 2)
    log = tmp_path / "run" / "generations" / "shard-00000.partial.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text('{"position": 0, "rejected": {"id": "p0-0", "stage": "generations", "reason": "x"}}\n')
    with ScriptedServer(Script()) as server, pytest.raises(GenerationError, match="older eagle3-datagen"):
        run_generation(store, refs, [server.url])


def test_window_answers_of_a_run_that_gave_up_are_never_kept(tmp_path: Path) -> None:
    """The server dies inside the first-answers window: its answers were never judged, so none is kept, nothing
    pins the settings, and a re-run under other settings asks every prompt under them."""
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 20)
    dying = Script(faults=["ok"] * 3 + ["http-500"] * 1000)
    with ScriptedServer(dying) as server, pytest.raises(GenerationError, match="gave up"):
        run_generation(store, refs, [server.url], budget=1, max_retries=0, max_consecutive_errors=3,
                       validation=ValidationConfig(early_abort_after=10))
    assert not store.exists(SETTINGS_FILE)
    with ScriptedServer(Script()) as server:
        run_generation(store, refs, [server.url], gen=settings(temperature=0.3))
        assert server.log.requests == 20, "no answer of the other settings was kept"


KILLED_IN_THE_WINDOW = """
import logging, sys
from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import ServerConfig, ValidationConfig
from eagle3_datagen.storage import RunStore
from tasks.generation import generate_shards
sys.path.insert(0, {tests!r})
from test_generation_faults import settings
server = ServerConfig(endpoints=[{url!r}], max_in_flight=1)
generate_shards(RunStore({root!r}, "run"), {refs!r}, settings(), server, ValidationConfig(early_abort_after=50),
                logging.getLogger("child"))
"""


def test_a_run_killed_inside_the_window_is_pinned_to_its_settings(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 20)
    log = tmp_path / "run" / "generations" / "shard-00000.partial.jsonl"
    with ScriptedServer(Script(latency_s=0.2)) as server:
        code = KILLED_IN_THE_WINDOW.format(tests=str(Path(__file__).parent), url=server.url, root=str(tmp_path),
                                           refs=refs)
        child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        deadline = time.monotonic() + 60
        while not (log.exists() and answers_logged(log)):
            assert child.poll() is None and time.monotonic() < deadline, "child ended before it could be killed"
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        with pytest.raises(GenerationError, match="generated with other settings"):
            run_generation(store, refs, [server.url], gen=settings(temperature=0.3))


def test_a_fresh_run_never_replays_the_spool_of_a_deleted_run_of_its_name(
        object_store: RunStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    refs = write_prompt_shards(object_store, 1, 6)
    stop_short(object_store, refs, "question 0-5")
    [old_spool] = (tmp_path / "spool").glob("*/*")
    object_store.fs.rm(object_store.root, recursive=True)  # the run folder is deleted; the local spool outlives it
    refs = write_prompt_shards(object_store, 1, 6)
    with ScriptedServer(Script()) as server, caplog.at_level(logging.WARNING, "test"):
        run_generation(object_store, refs, [server.url], gen=settings(temperature=0.3))
        assert server.log.requests == 6, "nothing of the deleted run was replayed"
    assert not old_spool.exists()
    assert any("local spool of another run" in r.getMessage() for r in caplog.records)


def test_segments_of_another_run_identity_are_removed_not_replayed(
        object_store: RunStore, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    refs = write_prompt_shards(object_store, 1, 6)
    stop_short(object_store, refs, "question 0-5")
    assert object_store.list(segment_folder(0), ".jsonl")
    object_store.remove(SETTINGS_FILE)  # the run's identity is gone: its segments are another run's now
    monkeypatch.setenv("EAGLE3_SPOOL_DIR", str(tmp_path / "another-machine"))
    with ScriptedServer(Script()) as server, caplog.at_level(logging.WARNING, "test"):
        run_generation(object_store, refs, [server.url], gen=settings(temperature=0.3))
        assert server.log.requests == 6
    assert any("partial logs of another run" in r.getMessage() for r in caplog.records)


def test_a_shard_edited_to_the_same_size_heals_once_a_stage_finds_it_changed(tmp_path: Path) -> None:
    """The marker vouched for the old bytes; the stage that read the new ones dropped it, so generation looks at
    the shard again (its records still answer the prompts, by id) and hands on its true hash."""
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 4)
    with ScriptedServer(Script()) as server:
        [written] = run_generation(store, refs, [server.url])
        shard = tmp_path / "run" / written.path
        shard.write_bytes(shard.read_bytes().replace(b"question 0-1", b"question 0-9"))
        with pytest.raises(ArtifactChanged, match="run the pipeline again"):
            store.read_shard(written)
        assert store.read_marker(written.path) is None, "the marker no longer vouches for the changed shard"
        from tasks.generation import unmarked_shards

        run = RunLocation(str(tmp_path), "run")
        assert unmarked_shards(refs, run) == refs, "the flow looks past generation's cache"
        [healed] = run_generation(store, refs, [server.url])
        assert server.log.requests == 4, "nothing asked again"
    assert healed.sha256 == sha256_hex(shard.read_bytes())
    store.read_shard(healed)
    assert unmarked_shards(refs, run) == [], "marked again: the flow trusts generation's cache again"


def test_one_failed_shard_write_never_skips_the_rest_of_shutdown(
        object_store: RunStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two finished shards fail to be written: the third's answers still reach run storage, the first error
    ends the run and the second is logged."""
    from tasks.generation import scheduler

    def broken(store: RunStore, state: object) -> ShardRef:
        raise OSError(f"write of shard {state.ref.index} failed")  # type: ignore[attr-defined]

    monkeypatch.setattr(scheduler, "finalize_shard", broken)
    refs = write_prompt_shards(object_store, 3, 3)
    with (ScriptedServer(Script(unavailable_for="question 2-2")) as server, caplog.at_level(logging.ERROR, "test"),
          pytest.raises(OSError, match="write of shard 0 failed")):
        run_generation(object_store, refs, [server.url], budget=1, max_retries=0, validation=FIRST_ANSWER_PASSES)
    [segment] = object_store.list(segment_folder(2), ".jsonl")
    assert len(object_store.read_text(segment).splitlines()) == 1 + 2, "a header and shard 2's two answers"
    assert any("write of shard 1 failed" in r.getMessage() for r in caplog.records)


def test_a_torn_last_line_never_swallows_the_next_attempts_first_entry(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    refs = write_prompt_shards(store, 1, 12)
    stop_short(store, refs, "question 0-1")  # 0-1, 0-10 and 0-11 unanswered
    log = tmp_path / "run" / "generations" / "shard-00000.partial.jsonl"
    with log.open("a") as torn:
        torn.write('{"id": "p0-1", "position": 1, "reco')  # killed mid-write
    stop_short(store, refs, "question 0-11")  # answers 0-1 and 0-10
    with ScriptedServer(Script()) as server:
        run_generation(store, refs, [server.url])
        assert asked(server) == ["question 0-11"]
    assert assert_exactly_once(store, refs) == (12, 0)
