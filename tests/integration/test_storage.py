"""The storage layer on a local folder and on a real S3 server (Ceph RGW on loopback, started here)."""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from bad_images import png

from eagle3_datagen.artifacts import REJECTED_PATH, sha256_hex
from eagle3_datagen.config import DataConfig
from eagle3_datagen.fingerprints import data_fingerprint
from eagle3_datagen.images import as_sent, image_names, image_path
from eagle3_datagen.storage import OutputNotWritable, RunStore, StoragePathError
from tasks.prompts import build_prompt_shards

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> RunStore:
    if request.param == "local":
        return RunStore(str(tmp_path), "run")
    request.getfixturevalue("s3_endpoint")
    return RunStore(f"s3://eagle3-test/{tmp_path.name}", "run")


def test_round_trip_listing_and_removal(store: RunStore) -> None:
    store.write_json("validation/shard-00000.json", {"status": "pass", "text": "ünï ✓"})
    store.write_jsonl("prompts/shard-00000.jsonl", [{"id": "a"}, {"id": "b"}])
    store.write_bytes("prompts/shard-00001.jsonl", b'{"id": "c"}\n')
    assert store.read_json("validation/shard-00000.json") == {"status": "pass", "text": "ünï ✓"}
    assert [r["id"] for r in store.read_jsonl("prompts/shard-00000.jsonl")] == ["a", "b"]
    assert store.list("prompts", ".jsonl") == ["prompts/shard-00000.jsonl", "prompts/shard-00001.jsonl"]
    store.remove("prompts/shard-00001.jsonl")
    assert not store.exists("prompts/shard-00001.jsonl") and store.list("absent") == []


def test_a_dataset_rewritten_to_the_same_size_is_another_source_locally_and_in_s3(store: RunStore) -> None:
    """The prompt stage's cache follows the data's content: on S3 through each object's ETag."""
    store.write_bytes("data/prompts.jsonl", b'{"prompt": "What is 2+2?"}\n')
    source = store.uri.rstrip("/") + "/data"
    before = data_fingerprint(source)
    assert data_fingerprint(source) == before
    store.write_bytes("data/prompts.jsonl", b'{"prompt": "What is 3+3?"}\n')
    assert data_fingerprint(source) != before


def test_overwrite_is_whole_and_leaves_no_temporary_file(store: RunStore) -> None:
    store.write_bytes("generations/shard-00000.jsonl", b"old\n" * 1000)
    store.write_bytes("generations/shard-00000.jsonl", b"new\n")
    assert store.read_bytes("generations/shard-00000.jsonl") == b"new\n"
    assert store.list("generations") == ["generations/shard-00000.jsonl"]


def test_large_streamed_write_reads_back(store: RunStore) -> None:
    payload = os.urandom(1 << 20) * 12  # 12 MiB: a multipart upload on S3 with 5 MiB blocks
    with store.open("hidden_states/shard-00000/part-00000.safetensors", "wb", block_size=5 << 20) as handle:
        handle.write(payload)
    assert store.read_bytes("hidden_states/shard-00000/part-00000.safetensors") == payload


def test_a_file_written_as_buffers_is_their_bytes_in_turn_never_joined_in_memory(
        store: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hidden-state part is written from its tensors' buffers: on S3 as a multipart upload whose chunks cut
    across them, each request reading its window of the buffers, so the file is never held twice."""
    import tracemalloc

    monkeypatch.setattr("eagle3_datagen.s3_upload.PART_BYTES", 5 << 20)  # the least S3 takes: 3 chunks here
    payload = os.urandom(12 << 20)
    cuts = [0, 8, 3 << 20, (3 << 20) + 1, 7 << 20, 12 << 20]  # a header, then pieces across the chunks' edges
    buffers = [memoryview(payload)[start:end] for start, end in itertools.pairwise(cuts)]
    tracemalloc.start()
    try:
        store.write_buffers("hidden_states/shard-00000/part-00000.safetensors", buffers)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.read_bytes("hidden_states/shard-00000/part-00000.safetensors") == payload
    assert peak < len(payload) // 2, f"{peak:,} bytes allocated at once to write {len(payload):,}"


def test_an_s3_upload_that_fails_midway_leaves_neither_the_object_nor_its_chunks(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from s3fs.core import S3FileSystem

    store = RunStore(f"s3://eagle3-test/{tmp_path.name}", "run")
    monkeypatch.setattr("eagle3_datagen.s3_upload.PART_BYTES", 5 << 20)
    call = S3FileSystem._call_s3

    async def refuse_the_second_chunk(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part" and kwargs["PartNumber"] == 2:
            raise PermissionError("refused by the test")
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(S3FileSystem, "_call_s3", refuse_the_second_chunk)
    with pytest.raises(PermissionError, match="refused by the test"):
        store.write_bytes("hidden_states/shard-00000/part-00000.safetensors", os.urandom(12 << 20))
    monkeypatch.setattr(S3FileSystem, "_call_s3", call)
    assert not store.exists("hidden_states/shard-00000/part-00000.safetensors")
    from fsspec.asyn import sync

    uploads = sync(store.fs.loop, store.fs._call_s3, "list_multipart_uploads", Bucket="eagle3-test",
                   Prefix=tmp_path.name)
    assert uploads.get("Uploads", []) == []


def test_one_writer_holds_a_run_locally_and_on_s3_and_a_taken_over_one_is_fenced(store: RunStore) -> None:
    """The lease's file is created exclusively: an exclusive link locally, a conditional PUT (If-None-Match) on
    Ceph's RGW, which answers 412 when the object exists."""
    from eagle3_datagen.artifacts import lease_file
    from eagle3_datagen.lease import Lease, RunBusy
    from eagle3_datagen.storage import WriterFenced

    assert store.create_exclusive("lease/probe.json", b"first")
    assert not store.create_exclusive("lease/probe.json", b"second")
    assert store.read_bytes("lease/probe.json") == b"first"
    store.remove("lease")
    lease = Lease.take(store)
    with pytest.raises(RunBusy):
        Lease.take(store)
    store.write_bytes(lease_file(lease.holder.epoch + 1), b"{}")  # a successor took it over
    with pytest.raises(WriterFenced):
        lease.run.store().write_text("manifest.json", "{}")
    lease.release()
    assert not store.exists("manifest.json")


@pytest.mark.parametrize("bad", ["../other-run/manifest.json", "/etc/passwd", "a/../../b", "..", "a\\..\\b"])
def test_paths_cannot_leave_the_run_folder(store: RunStore, bad: str) -> None:
    with pytest.raises(StoragePathError, match="leaves the run folder"):
        store.write_bytes(bad, b"x")


def test_an_existing_run_is_found_from_its_folder(store: RunStore) -> None:
    store.write_json("manifest.json", {"ok": True})
    again = RunStore.at(store.uri)
    assert again.read_json("manifest.json") == {"ok": True} and again.uri == store.uri


KIMI_DIR = REPO.parent / "shared" / "tokenizers" / "kimi-k2.5"


@pytest.mark.skipif(not KIMI_DIR.is_dir(), reason="../shared/tokenizers/kimi-k2.5 is absent")
def test_a_run_on_s3_writes_every_artifact_and_its_cache_there(s3_endpoint: str, tmp_path: Path) -> None:
    from prefect.testing.utilities import prefect_test_harness

    from cli.runner import run_pipeline
    from eagle3_datagen.config import parse_config
    from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
    from eagle3_datagen.think_tokens import load_tokenizer

    data = tmp_path / "q.jsonl"
    data.write_text("".join(f'{{"messages": [{{"role": "user", "content": "question {i}"}}]}}\n' for i in range(80)))
    script = Script(model="kimi", tokenizer=load_tokenizer(str(KIMI_DIR)), reasoning_chars=20_000)
    with prefect_test_harness(server_startup_timeout=120), ScriptedServer(script) as server:
        config = parse_config({
            "run_name": "s3run", "output_uri": "s3://eagle3-test/runs",
            "data": {"source": str(data), "shard_size": 40},
            "model": {"name": "kimi", "profile": "kimi-k2.5", "tokenizer": str(KIMI_DIR)},
            "server": {"endpoints": [server.url]}, "generation": {"max_tokens": 32768},
            "hidden_states": {"backend": "none"},
        })
        run_pipeline(config)
        requests = server.log.requests
        with counted_s3_reads() as reads:
            second = run_pipeline(config)
        assert server.log.requests == requests
    assert any("work tasks cached" in line for line in second["stages"])
    store = RunStore.at("s3://eagle3-test/runs/s3run")
    written = sum(store.fs.du(store.root, total=False).values())
    print(f"re-run of a finished run on S3: {reads['bytes']:,} bytes read in {reads['gets']} GETs, "
          f"{reads['requests']} requests in all; the first run wrote {written:,} bytes")
    shards_read = [key for key in reads["keys"] if re.search(r"shard-\d{5}(\.jsonl|\.parquet|/)", key)]
    assert not shards_read, "a re-run learns what is finished from markers, not by reading shards"
    plots = {key: size for key, size in reads["bytes_of"].items() if key.endswith(".png")}
    assert sorted(plots) == sorted(f"runs/s3run/{file}" for file in store.read_json("manifest.json")["plots"])
    assert reads["bytes"] - sum(plots.values()) < 0.02 * written, \
        "what a re-run reads is the manifest, markers, cached results and the report's plots (read, not drawn)"
    assert store.read_json("manifest.json")["status"] == "completed"
    assert store.list("sequences", ".parquet") == ["sequences/shard-00000.parquet", "sequences/shard-00001.parquet"]
    assert store.list(".prefect-results"), "the task cache lives in the run's own storage"
    from tasks.verify import verify_run

    with counted_s3_reads() as reads:
        verification = verify_run(store)
    assert verification.complete, verification.problems
    assert not [key for key in reads["keys"] if re.search(r"shard-\d{5}(\.jsonl|\.parquet)", key)], \
        "the structural check reads markers, not shards"
    listings = reads["requests"] - reads["gets"]
    print(f"structural verify on S3: {reads['gets']} GETs ({reads['bytes']:,} bytes), {listings} other requests")
    assert reads["bytes"] < 0.02 * written
    assert verify_run(store, deep=True).complete


@contextmanager
def counted_s3_reads() -> Iterator[dict[str, Any]]:
    """Every S3 request this process makes, the object bytes its GETs return (whole objects and ranges), and the
    keys they read with the bytes read of each."""
    from s3fs.core import S3FileSystem

    counts: dict[str, Any] = {"requests": 0, "gets": 0, "bytes": 0, "keys": [], "bytes_of": defaultdict(int)}
    call = S3FileSystem._call_s3

    async def counted_call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        response = await call(self, method, *args, **kwargs)
        counts["requests"] += 1
        if method == "get_object":
            counts["gets"] += 1
            counts["bytes"] += int(response.get("ContentLength") or 0)
            counts["keys"].append(kwargs.get("Key", ""))
            counts["bytes_of"][kwargs.get("Key", "")] += int(response.get("ContentLength") or 0)
        return response

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(S3FileSystem, "_call_s3", counted_call)
        yield counts


@pytest.mark.parametrize(("credentials", "fix"), [
    ({}, "no credentials for it in this process's environment: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    ({"AWS_ACCESS_KEY_ID": "eagle3test", "AWS_SECRET_ACCESS_KEY": "not-the-secret"},
     "the store refuses these credentials: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
])
def test_s3_credentials_missing_or_refused_fail_the_start_in_one_line_naming_output_uri_and_the_variables(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, credentials: dict[str, str],
        fix: str) -> None:
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))  # nor a profile of this machine's
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(OutputNotWritable) as failure:
            RunStore("s3://eagle3-test/runs", "no-keys").check_writable()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    line = failure.value.one_line()
    assert line.startswith("output_uri: cannot write the run folder s3://eagle3-test/runs/no-keys (") and fix in line
    assert "not-the-secret" not in line


def test_a_restarted_s3_gateway_costs_a_retry_not_an_artifact(s3_endpoint: str, ceph_folder: Path,
                                                              tmp_path: Path) -> None:
    """The gateway goes down mid-run and comes back: writes wait for it, nothing already written is lost."""
    import threading
    import time

    store = RunStore(f"s3://eagle3-test/{tmp_path.name}", "run")
    store.write_json("manifest.json", {"written": "before the outage"})
    conf = ceph_folder / "ceph.conf"
    subprocess.run(["pkill", "-f", f"radosgw -n client.rgw.a -c {conf}"], check=False)
    time.sleep(1)
    import httpx

    with pytest.raises(httpx.ConnectError):
        httpx.get(s3_endpoint, timeout=2)

    def restart() -> None:
        time.sleep(3)
        subprocess.run(["radosgw", "-n", "client.rgw.a", "-c", str(conf)], check=True)

    comeback = threading.Thread(target=restart)
    comeback.start()
    store.write_json("generations/shard-00000.json", {"written": "during the outage"})
    comeback.join()
    assert store.read_json("manifest.json") == {"written": "before the outage"}
    assert store.read_json("generations/shard-00000.json") == {"written": "during the outage"}


def test_hidden_states_export_from_s3_to_s3_loads_back(s3_endpoint: str, tmp_path: Path) -> None:
    """The export reads parts and the final norm from S3 and writes trainer files and a datasets folder there."""
    import datasets
    from hidden_state_targets import HIDDEN, random_qwen3
    from safetensors.torch import load as load_safetensors
    from test_export import make_run

    from tasks.export import export_run
    from tasks.hidden_states.transformers_backend import load_target_model

    random_qwen3().save_pretrained(tmp_path / "model")
    target = load_target_model(str(tmp_path / "model"), "bfloat16", "cpu")
    output_uri = f"s3://eagle3-test/{tmp_path.name}"
    make_run(output_uri, target, {0: [5, 9], 1: [7]})

    summary = export_run(f"{output_uri}/run", "speculators")

    out = RunStore.at(summary["out"])
    assert summary["out"] == f"{output_uri}/run/exports/speculators" and summary["num_samples"] == 3
    local = tmp_path / "downloaded"
    out.fs.get(out.root + "/", str(local), recursive=True)
    rows = datasets.load_from_disk(str(local))
    for i in range(3):
        loaded = load_safetensors(out.read_bytes(f"hidden_states/hs_{i}.safetensors"))
        assert loaded["hidden_states"].shape == (int(rows[i]["seq_len"]), 4, HIDDEN)
        assert loaded["token_ids"].equal(rows[i]["input_ids"])


def test_a_run_in_s3_resumes_on_another_machine_from_its_partial_log_segments(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation stops short with shards half done; the local spool is gone (another machine, a lost disk):
    the re-run finds the answered prompts in the run's own storage and asks only the others."""
    from test_generation_faults import run_generation, write_prompt_shards

    from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
    from tasks.generation import GenerationError
    from tasks.generation.records import segment_folder

    store = RunStore(f"s3://eagle3-test/{tmp_path.name}", "run")
    refs = write_prompt_shards(store, 2, 12)
    monkeypatch.setenv("EAGLE3_SPOOL_DIR", str(tmp_path / "first-machine"))
    with ScriptedServer(Script(unavailable_for="question 1-1")) as server:
        with pytest.raises(GenerationError):
            run_generation(store, refs, [server.url], budget=4, give_up_after_s=1, max_consecutive_errors=3,
                           max_retries=0)
        answered = server.log.requests
    assert store.list(segment_folder(1), ".jsonl"), "shard 1's answered prompts are in run storage"
    monkeypatch.setenv("EAGLE3_SPOOL_DIR", str(tmp_path / "second-machine"))
    with ScriptedServer(Script()) as server:
        run_generation(store, refs, [server.url], budget=4)
        asked_again = [body["messages"][-1]["content"] for body in server.log.bodies]
    assert len(asked_again) < 12 and "question 1-1" in asked_again, (answered, asked_again)
    assert not store.list(segment_folder(1)), "a finished shard's segments are removed"
    ids = [r["id"] for ref in refs for r in store.read_jsonl(f"generations/shard-{ref.index:05d}.jsonl")]
    assert len(ids) == len(set(ids)) == 24, "every prompt answered exactly once"


def test_image_prompts_read_from_s3_are_stored_in_the_run_and_sent_from_there(s3_endpoint: str, store: RunStore,
                                                                              tmp_path: Path) -> None:
    """An image at an s3:// URL is read with the environment's credentials, stored once in the run (local or S3)
    under its hash, and sent from the run's copy; one that does not exist rejects its row."""
    import s3fs

    picture = png("blue")
    bucket = s3fs.S3FileSystem()
    bucket.pipe(f"eagle3-test/{tmp_path.name}-data/pic.png", picture)
    rows = [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"s3://eagle3-test/{tmp_path.name}-data/{name}"}},
        {"type": "text", "text": "Which colour?"}]}]} for name in ("pic.png", "none.png")]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = build_prompt_shards(DataConfig(source=str(source), holdout=0), store)

    [prompt] = [p for ref in result.shards for p in store.read_shard_records(ref)]
    name = f"{sha256_hex(picture)}.png"
    assert image_names(prompt["messages"]) == [name] and store.read_bytes(image_path(name)) == picture
    sent = as_sent(prompt["messages"], store.read_bytes)[0]["content"][0]["image_url"]["url"]
    assert sent == "data:image/png;base64," + base64.b64encode(picture).decode()
    [refused] = store.read_jsonl(REJECTED_PATH)
    assert refused["reason"] == f"image s3://eagle3-test/{tmp_path.name}-data/none.png does not exist"
