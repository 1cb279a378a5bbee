"""The whole flow through Prefect, against an OpenAI-protocol server that tokenizes with the tiny model's
tokenizer: every stage, the cache, the one-line errors, and secrets kept out of every artifact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file
from trainer_files import assert_the_trainers_read_every_sample

from cli.demo import DEMO_MODEL_NAME, demo_questions
from cli.main import main
from cli.runner import run_pipeline
from eagle3_datagen.artifacts import prompt_id_of
from eagle3_datagen.config import PipelineConfig, parse_config
from eagle3_datagen.errors import UserError
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.processes import as_from_a_terminal
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.think_tokens import load_tokenizer
from tasks.export import export_run
from tasks.health import ServerCheckFailed
from tasks.verify import verify_run

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture
def server(tiny_model: Path) -> Iterator[ScriptedServer]:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as running:
        yield running


def config(tiny_model: Path, url: str, output: Path, **changes: Any) -> PipelineConfig:
    tree: dict[str, Any] = {
        "run_name": "flow",
        "output_uri": str(output),
        "data": {"source": str(demo_questions()), "shard_size": 16, "limit": 24},
        "model": {"name": DEMO_MODEL_NAME, "profile": "qwen3", "tokenizer": str(tiny_model)},
        "server": {"endpoints": [url], "max_in_flight": 8, "startup_timeout_s": 10},
        "hidden_states": {"model": str(tiny_model), "dtype": "float32", "part_size_bytes": 200_000},
    }
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        tree.setdefault(section, {})[key] = value
    return parse_config(tree)


def write_config(path: Path, cfg: PipelineConfig) -> str:
    """The config as the YAML file a user passes to `eagle3-datagen run --config`."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return str(path)


def test_every_stage_runs_and_a_second_run_is_all_cached(tiny_model: Path, server: ScriptedServer,
                                                         tmp_path: Path) -> None:
    first = run_pipeline(config(tiny_model, server.url, tmp_path))
    run = tmp_path / "flow"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    assert manifest["format_version"] == 2
    assert manifest["totals"]["input_rows"] == 24 and manifest["totals"]["rejected"] == 0
    assert manifest["think_tokens"]["template_writes_start_tag"] is False
    assert [p["reasoning_field"] for p in manifest["probe"]] == ["reasoning"]
    shard = manifest["shards"]["shard-00000"]
    assert shard["sequences"]["text_rebuild_agreement"] == 1.0
    assert shard["generations"]["reasoning_coverage"] == 1.0

    hf_config = json.loads((tiny_model / "config.json").read_text())
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    index = json.loads((run / "hidden_states" / "shard-00000" / "index.json").read_text())
    assert index["aux_layers"] == {"input_to_layer": [2, layers // 2, layers - 3],
                                   "output_of_layer": [1, layers // 2 - 1, layers - 4]}
    assert len(index["parts"]) > 1, "a shard larger than part_size_bytes is split"
    part = load_file(run / "hidden_states" / "shard-00000" / index["parts"][0]["file"])
    tokens = part["input_ids"].shape[0]
    assert part["aux_hidden_states"].shape == (tokens, 3 * hidden)
    assert part["final_hidden_states"].shape == (tokens, hidden)
    assert part["aux_hidden_states"].dtype == torch.float32 and int(part["offsets"][-1]) == tokens

    assert first["stages"][-1] == f"trainer files: eagle3-datagen export {run} --format specforge (or speculators)"
    exported = export_run(str(run), "specforge")
    samples = sum(json.loads(p.read_text())["num_samples"] for p in run.glob("hidden_states/*/index.json"))
    held = manifest["holdout"]["prompts"]["thinking"]
    assert held == 6, "24 prompts: 1 % is none, the minimum of 20 is capped at a quarter"
    assert exported["num_samples"] == samples - held == len(list((run / "exports" / "specforge").rglob("data_*.ckpt")))
    assert export_run(str(run), "specforge", split="holdout")["num_samples"] == held
    assert "| refused | held-out prompts |" in (run / "report.md").read_text()

    requests = server.log.requests
    second = run_pipeline(config(tiny_model, server.url, tmp_path))
    assert server.log.requests == requests, "a cached run sent requests"
    assert any("work tasks cached" in line for line in second["stages"])
    assert second["totals"] == first["totals"]


def test_verify_checks_the_structure_without_reading_data_and_deep_reads_every_byte(
        tiny_model: Path, server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_pipeline(config(tiny_model, server.url, tmp_path))
    run, store = tmp_path / "flow", RunStore.at(str(tmp_path / "flow"))
    data = sum(f.stat().st_size for stage in ("generations", "sequences", "hidden_states")
               for f in (run / stage).rglob("*") if f.suffix in (".jsonl", ".parquet", ".safetensors"))
    structure, deep = verify_run(store), verify_run(store, deep=True)
    assert structure.complete and deep.complete, (structure.problems, deep.problems)
    assert (structure.prompts, structure.accepted, structure.samples) == (deep.prompts, deep.accepted, deep.samples)
    assert structure.bytes_read < 0.05 * data <= deep.bytes_read, "markers and indexes only, then every byte"

    part = sorted((run / "hidden_states" / "shard-00001").glob("part-*.safetensors"))[-1]
    flipped = bytearray(part.read_bytes())
    flipped[-1] ^= 0xFF
    part.write_bytes(bytes(flipped))
    assert verify_run(store).complete, "a byte changed in place is for --deep: the structure holds"
    assert main(["verify", "--deep", str(run)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"verify: 2/2 shards, [\d.]+ GB read", out)
    assert f"problem: shard-00001 hidden_states: hidden_states/shard-00001/{part.name} does not match its " \
           "checksum in hidden_states/shard-00001/index.json: re-run hidden_states" in out

    flipped[-1] ^= 0xFF
    part.write_bytes(bytes(flipped))  # as it was
    index_rel = next(path for path in sorted(run.glob("hidden_states/*/index.json"))
                     if '"split": "holdout"' in path.read_text())
    written = index_rel.read_text()
    index = json.loads(written)
    for entry in index["parts"]:
        entry.pop("split", None)  # held-out samples left where training reads
    index_rel.write_text(json.dumps(index))
    assert main(["verify", "--deep", str(run)]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"problem: {index_rel.parent.name} hidden_states: \d+ samples are in parts of another "
                     r"split than their sequences say", out), out
    index_rel.write_text(written)
    flipped[-1] ^= 0xFF

    part.write_bytes(bytes(flipped[:-100]))
    (run / "sequences" / "shard-00000.parquet").write_bytes(b"replaced")
    assert main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"problem: hidden_states/shard-00001/{part.name} has {len(flipped) - 100} bytes, " \
           f"hidden_states/shard-00001/index.json says {len(flipped)}: run the pipeline again" in out
    assert "problem: sequences: sequences/shard-00000.parquet does not match the checksum in the manifest" in out
    assert "problem: shard-00000: sequences/shard-00000.parquet cannot be read (" in out
    assert re.fullmatch(r"NOT complete: the run ended completed; \d+ problems", out.strip().splitlines()[-1])


def test_a_mixed_run_records_and_reports_each_mode(tiny_model: Path, server: ScriptedServer, tmp_path: Path) -> None:
    """Each record, sequence and hidden-state sample names its mode; the report counts each mode; other weights
    are other settings (a resume under them is refused, naming the modes)."""
    mix = [{"mode": "thinking", "weight": 0.6}, {"mode": "instant", "weight": 0.4}]
    run_pipeline(config(tiny_model, server.url, tmp_path, generation__modes=mix, sequences__cross_check_rate=1.0))
    run = tmp_path / "flow"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed", manifest.get("cause")
    records = [json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()]
    modes = {record["id"]: record["mode"] for record in records}
    assert all(bool(r["reasoning"]) is (r["mode"] == "thinking") for r in records)
    rows = {row["mode"]: row for row in manifest["modes"]}
    for mode, share in (("thinking", "60%"), ("instant", "40%")):
        count = sum(m == mode for m in modes.values())
        assert count and (rows[mode]["records"], rows[mode]["kept"], rows[mode]["refused"]) == (count, count, 0)
        assert rows[mode]["share asked"] == share
    assert (rows["thinking"]["with reasoning"], rows["instant"]["with reasoning"]) == ("100.0%", "0.0%")
    assert manifest["totals"]["reasoning_coverage"] == 1.0, "coverage is of the modes that think"
    assert "| reasoning coverage | 100.0% |" in (run / "report.md").read_text()
    assert "| mode | share asked | records | kept | refused |" in (run / "report.md").read_text()
    sequences = [row for f in sorted((run / "sequences").glob("shard-*.parquet"))
                 for row in pq.read_table(f).to_pylist()]
    assert {row["id"]: row["mode"] for row in sequences} == modes
    assert all(row["agrees"] for row in sequences), "each mode's text rebuild equals the server's ids"
    indexed = {k: v for f in run.glob("hidden_states/*/index.json") for k, v in json.loads(f.read_text())
               ["sample_modes"].items()}
    assert indexed == modes

    other = [{"mode": "thinking", "weight": 0.5}, {"mode": "instant", "weight": 0.5}]
    requests, manifest = server.log.requests, (run / "manifest.json").read_bytes()
    with pytest.raises(UserError, match=r"generated with other settings \(model, sampling, modes"):
        run_pipeline(config(tiny_model, server.url, tmp_path, generation__modes=other, sequences__cross_check_rate=1.0))
    assert server.log.requests == requests
    assert (run / "manifest.json").read_bytes() == manifest, "a refused attempt leaves the finished run as it was"


def test_a_rollout_regenerates_each_turn_on_its_own_answers_through_every_stage(
        tiny_model: Path, server: ScriptedServer, tmp_path: Path) -> None:
    """Every turn of a conversation is a sample of exact ids, asked on the answers before it; verify accounts for
    conversations, turns and samples, and the trainers' export holds every turn."""
    mix = [{"mode": "thinking", "weight": 0.5}, {"mode": "instant", "weight": 0.5}]
    server.script.refused_for = "And what is that times 2?"  # the second turn of one of the two conversations
    run_pipeline(config(tiny_model, server.url, tmp_path, data__turns="rollout", data__limit=40,
                        generation__modes=mix, sequences__cross_check_rate=1.0))
    run = tmp_path / "flow"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    records = [json.loads(line) for f in sorted((run / "generations").glob("shard-*.jsonl"))
               for line in f.read_text().splitlines()]
    for deep in (False, True):  # the markers' counts and the records' own agree
        verification = verify_run(RunStore.at(str(run)), deep=deep)
        assert verification.complete, verification.problems
        assert verification.prompts == 40 and verification.samples == len(records) == 41, "two rows of two turns"
        assert (verification.accepted, verification.rejected) == (40, 0), "the refused turn ends, not rejects"
    assert (manifest["totals"]["conversations"], manifest["totals"]["conversations_answered_in_full"]) == (40, 39)
    ends = {"ended: refused": 0, "ended: tool_result_missing": 0}
    assert manifest["turns"] == [
        {"user turn": 0, "samples": 40, "with tool calls": 0, "answered in full": 38, **ends},
        {"user turn": 1, "samples": 1, "with tool calls": 0, "answered in full": 1, **ends, "ended: refused": 1}]
    assert "| user turn | samples | with tool calls | answered in full | ended: refused |" in \
        (run / "report.md").read_text()
    second_turns = [r for r in records if r["turn"] == 1]
    for second in second_turns:
        first = next(r for r in records if r["id"] == second["id"].replace(":turn1", ":turn0"))
        assert second["messages"][-2] == {"role": "assistant", "content": first["content"]}
        assert second.get("mode") == first.get("mode"), "a conversation keeps its mode"
    sequences = [row for f in sorted((run / "sequences").glob("shard-*.parquet"))
                 for row in pq.read_table(f).to_pylist()]
    assert len(second_turns) == 1 and all(row["agrees"] for row in sequences)
    assert sorted(row["id"] for row in sequences) == sorted(r["id"] for r in records)
    splits: dict[str, set[str]] = {}
    for row in sequences:
        splits.setdefault(prompt_id_of(row["id"]), set()).add(row["split"])
    assert all(len(split) == 1 for split in splits.values()), "a conversation is held out whole"
    held_conversations = [conversation for conversation, split in splits.items() if split == {"holdout"}]
    assert len(held_conversations) == sum(manifest["holdout"]["prompts"].values()) > 0
    held = sum(row["split"] == "holdout" for row in sequences)
    assert export_run(str(run), "speculators")["num_samples"] == 41 - held
    assert export_run(str(run), "specforge")["num_samples"] == 41 - held
    assert export_run(str(run), "speculators", split="holdout")["num_samples"] == held
    assert_the_trainers_read_every_sample(run, 41 - held)


def test_a_cached_re_run_loads_no_tokenizer_and_draws_no_plot_until_what_they_show_changes(
        tiny_model: Path, server: ScriptedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for file in [*tiny_model.glob("tokenizer*"), tiny_model / "chat_template.jinja"]:
        (tokenizer / file.name).write_bytes(file.read_bytes())
    cfg = config(tiny_model, server.url, tmp_path / "runs", hidden_states__backend="none",
                 model__tokenizer=str(tokenizer))
    run_pipeline(cfg)
    run = tmp_path / "runs" / "flow"
    first = json.loads((run / "manifest.json").read_text())
    pngs = {file: (run / file).read_bytes() for file in first["plots"]}
    assert len(pngs) >= 2

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cached re-run loaded a tokenizer or drew a plot")

    with monkeypatch.context() as patched:
        patched.setattr("tasks.run.lifecycle.load_tokenizer", refused)
        patched.setattr("tasks.run.plots.png", refused)
        again = run_pipeline(cfg)
    manifest = json.loads((run / "manifest.json").read_text())
    assert again["totals"] == manifest["totals"] and manifest["status"] == "completed"
    assert manifest["think_tokens"] == first["think_tokens"] and manifest["plots"] == first["plots"]
    assert {file: (run / file).read_bytes() for file in pngs} == pngs
    assert all(f"]({file})" in (run / "report.md").read_text() for file in pngs)

    config_file = tokenizer / "tokenizer_config.json"  # the same tags, another file: proven again
    config_file.write_text(config_file.read_text() + "\n")
    loads: list[str] = []
    monkeypatch.setattr("tasks.run.lifecycle.load_tokenizer", lambda path: loads.append(path) or load_tokenizer(path))
    run_pipeline(cfg)
    changed = json.loads((run / "manifest.json").read_text())
    assert loads == [str(tokenizer)] and changed["think_token_proof"] != first["think_token_proof"]
    assert changed["think_tokens"] == first["think_tokens"]


def test_changing_a_later_stage_reruns_only_that_stage(tiny_model: Path, server: ScriptedServer,
                                                       tmp_path: Path) -> None:
    run_pipeline(config(tiny_model, server.url, tmp_path, hidden_states__backend="none"))
    requests = server.log.requests
    summary = run_pipeline(config(tiny_model, server.url, tmp_path, hidden_states__backend="none",
                                  sequences__supervise_template_start_tag=True))
    assert server.log.requests == requests
    states = {line.split()[1]: line for line in summary["stages"] if line.startswith("stage")}
    assert "Cached" in states["generate"] and "Cached" in states["validate"]
    assert "Completed" in states["build-sequences"] and "Cached" not in states["build-sequences"]


def test_a_new_compression_extracts_again_and_the_report_says_what_fp8_cost(tiny_model: Path, server: ScriptedServer,
                                                                            tmp_path: Path) -> None:
    run_pipeline(config(tiny_model, server.url, tmp_path))
    requests = server.log.requests
    summary = run_pipeline(config(tiny_model, server.url, tmp_path, hidden_states__compression="fp8"))
    assert server.log.requests == requests
    states = {line.split()[1]: line for line in summary["stages"] if line.startswith("stage")}
    assert "Cached" in states["build-sequences"]
    assert "Completed" in states["extract-hidden-states"] and "Cached" not in states["extract-hidden-states"]

    run = tmp_path / "flow"
    manifest = json.loads((run / "manifest.json").read_text())
    for name, shard in manifest["shards"].items():
        index = json.loads((run / "hidden_states" / name / "index.json").read_text())
        assert shard["hidden_states"]["compression"] == index["compression"] == "fp8"
        assert shard["hidden_states"]["fp8_cosine"] == index["fp8_cosine"]
    fidelity = manifest["totals"]["fp8_fidelity"]
    assert re.fullmatch(r"min 0\.99\d\d, p1 0\.99\d\d, p50 0\.99\d\d \(lowest shard\); \d+ of \d+ rows under 0\.999",
                        fidelity)
    assert f"| fp8 cosine to the model-dtype states | {fidelity} |" in (run / "report.md").read_text()


def test_a_server_without_reasoning_parser_stops_the_run_at_its_first_answer(tiny_model: Path,
                                                                             tmp_path: Path) -> None:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, shape="inline", latency_s=0.05)) as inline:
        with pytest.raises(ServerCheckFailed, match="--reasoning-parser qwen3"):
            run_pipeline(config(tiny_model, inline.url, tmp_path))
        assert inline.log.requests <= 8, "no more than one budget's worth (max_in_flight 8) was sent"
    generations = tmp_path / "flow" / "generations"
    assert not list(generations.glob("shard-*")), "no record of a broken server is kept"


@pytest.mark.parametrize("where", ["environment", "secret-block"])
def test_the_api_key_is_sent_but_never_reaches_an_artifact(tiny_model: Path, server: ScriptedServer, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    from prefect.blocks.system import Secret

    from eagle3_datagen.redaction import redact

    secret = f"sk-very-secret-{where}-4f1d9c"
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    if where == "environment":
        monkeypatch.setenv("VLLM_API_KEY", secret)
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none")
    else:
        Secret(value=secret).save("vllm-api-key", overwrite=True)
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none",
                     server__api_key_secret="vllm-api-key")
    run_pipeline(cfg)
    assert server.log.authorizations and set(server.log.authorizations) == {f"Bearer {secret}"}
    for file in (tmp_path / "flow").rglob("*"):
        if file.is_file():
            assert secret.encode() not in file.read_bytes(), f"secret leaked into {file}"
    assert secret not in redact(f"connection failed with key {secret}")


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("run_name: ok\ndata: {source: x}\nmodel: {name: m, profile: qwen3, tokenizer: t}\nbogus: 1\n",
         "config key bogus: unknown key"),
        ("run_name: ok\ndata: {source: x, shard_size: many}\nmodel: {name: m, profile: qwen3, tokenizer: t}\n",
         "config key data.shard_size:"),
        ("run_name: ../escape\ndata: {source: x}\nmodel: {name: m, profile: qwen3, tokenizer: t}\n",
         "run_name '../escape' must be"),
        ("run_name: ok\ndata: {source: x}\nmodel: {name: m, profile: nope, tokenizer: t}\n",
         "model.profile 'nope' is unknown"),
        ("run_name: ok\nmodel: {name: m, profile: qwen3, tokenizer: t}\n", "config key data: Field required"),
        ("run_name: [unclosed\n", "is not valid YAML"),
        ("data: {source: x}\nmodel: {name: m, profile: qwen3, tokenizer: t}\n", "config key run_name: name the run"),
    ],
    ids=["unknown-key", "wrong-type", "path-in-run-name", "unknown-profile", "missing-section", "bad-yaml",
         "no-run-name"],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               yaml_text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_config_file_and_unreachable_server_are_one_line(tiny_model: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert "not found: pass --config" in capsys.readouterr().err
    cfg = config(tiny_model, "http://127.0.0.1:9", tmp_path)
    assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing listens at http://127.0.0.1:9 (connection refused for" in err


def test_a_dataset_without_a_prompt_column_is_one_line(tiny_model: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "hi"}\n')
    cfg = config(tiny_model, "http://127.0.0.1:9", tmp_path, data__source=str(data))
    assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "question" in err and "conversations" in err


def test_a_quarantined_shard_is_kept_marked_and_kept_out_until_redone_on_request(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Empty reasoning in one shard only (past the early-abort window): that shard is quarantined, not trained on,
    and generated again only when `rerun-failed --redo-quarantined` asks for it."""
    from eagle3_datagen.storage import RunStore
    from tasks.prompts import build_prompt_shards

    cfg = config(tiny_model, "http://127.0.0.1:9", tmp_path, hidden_states__backend="none",
                 validation__early_abort_after=4)
    store = RunStore(str(tmp_path), "flow")
    shards = build_prompt_shards(cfg.data, store).shards
    shard_1 = {r["messages"][-1]["content"] for r in store.read_jsonl(shards[1].path)}
    original = ScriptedServer._chat

    async def thinking_off_for_shard_1(self: ScriptedServer, request: Any) -> Any:
        body = await request.json()
        self.script.shape = "none" if body["messages"][-1]["content"] in shard_1 else "reasoning"
        return await original(self, request)

    monkeypatch.setattr(ScriptedServer, "_chat", thinking_off_for_shard_1)
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as server:
        # one request at a time: the scripted shape is switched per request
        cfg = parse_config({**cfg.model_dump(mode="json"), "server": {"endpoints": [server.url], "max_in_flight": 1}})
        with pytest.raises(Exception, match="did not finish"):
            run_pipeline(cfg)
    run = tmp_path / "flow"
    report = json.loads((run / "validation" / "shard-00001.json").read_text())
    assert report["status"] == "quarantine" and "empty_reasoning rate" in report["reasons"][0]
    assert (run / "generations" / "shard-00001.jsonl").exists(), "its records are kept"
    assert not (run / "sequences" / "shard-00001.parquet").exists(), "and never reach the training set"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "did not finish" in manifest["cause"]
    assert manifest["shards"]["shard-00001"]["validation"]["status"] == "quarantine"
    assert manifest["shards"]["shard-00000"]["sequences"]["status"] == "done"
    assert (run / "report.md").exists() and (run / "reasoning_lengths.png").read_bytes()[:4] == b"\x89PNG"

    monkeypatch.undo()  # the server is fixed: thinking is on for every question
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as server:
        endpoint = f"server.endpoints=[{server.url}]"
        assert main(["rerun-failed", str(run), "--set", endpoint]) == 1, "a quarantined shard is not redone unasked"
        assert "quarantined shard-00001 stay as they are (add --redo-quarantined" in capsys.readouterr().out
        assert main(["rerun-failed", str(run), "--set", endpoint, "--redo-quarantined"]) == 0
        assert "generate quarantined shard-00001 again" in capsys.readouterr().out
    assert manifest_of(run)["status"] == "completed"
    assert list(run.glob("quarantine/*/generations/shard-00001.jsonl")), "the quarantined records are kept aside"
    assert main(["verify", str(run)]) == 0


def test_rerun_failed_reads_the_manifest_and_redoes_only_what_failed(tiny_model: Path, tmp_path: Path) -> None:
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), unavailable_for="France")
    with ScriptedServer(script) as server:
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none", server__max_retries=0)
        with pytest.raises(Exception, match="run again to resume"):
            run_pipeline(cfg)
        sent = server.log.requests
        script.unavailable_for = None
        assert main(["rerun-failed", str(tmp_path / "flow")]) == 0
        asked_again = [b["messages"][-1]["content"] for b in server.log.bodies[sent:]]
    assert asked_again == ["What is the capital of France?"], "only the prompt that failed is asked again"
    assert main(["verify", str(tmp_path / "flow")]) == 0


def manifest_of(run: Path) -> dict[str, Any]:
    return json.loads((run / "manifest.json").read_text())


def test_max_tokens_beyond_the_served_context_fails_before_any_request(tiny_model: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), max_model_len=2048)
    with ScriptedServer(script) as server:
        cfg = config(tiny_model, server.url, tmp_path, generation__max_tokens=4096, hidden_states__backend="none")
        assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
        assert server.log.requests == 0, "refused from /v1/models alone"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert re.search(r"(\d+) of \1 prompts do not fit with generation.max_tokens 4096", err)
    assert re.search(r"set generation.max_tokens <= \d+ or serve with --max-model-len >= \d+", err)
    manifest = manifest_of(tmp_path / "flow")
    assert manifest["status"] == "failed" and "max_model_len" in manifest["cause"]


def test_a_run_whose_every_request_is_refused_ends_failed_and_recovers_after_the_fix(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A server that does not report its context refuses every request: the run stops once refusals are certain
    to exceed what validation.min_accepted_rate allows."""
    script = Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)), max_model_len=400,
                    report_max_model_len=False)
    with ScriptedServer(script) as server:
        cfg = config(tiny_model, server.url, tmp_path, generation__max_tokens=4096, hidden_states__backend="none",
                     validation__early_abort_after=8)
        assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
        assert server.log.requests == 8, "the early-abort window, then nothing"
        err = capsys.readouterr().err
        assert "early abort: the server refused 5 of the first 5 requests" in err and "maximum context" in err
        assert manifest_of(tmp_path / "flow")["status"] == "failed"
        assert main(["verify", str(tmp_path / "flow")]) == 1
        fixed = config(tiny_model, server.url, tmp_path, generation__max_tokens=64, hidden_states__backend="none")
        assert main(["run", "--config", write_config(tmp_path / "c.yaml", fixed)]) == 0, "same run, fixed setting"
    assert manifest_of(tmp_path / "flow")["status"] == "completed"
    assert not list((tmp_path / "flow" / "rejected").glob("generations-*")), "the refused window was asked again"
    assert main(["verify", str(tmp_path / "flow")]) == 0


def test_a_run_that_keeps_too_few_samples_ends_failed_with_the_common_reason(
        tiny_model: Path, server: ScriptedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tiny_model, server.url, tmp_path, sequences__max_seq_len=16, hidden_states__backend="none")
    assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
    err = capsys.readouterr().err
    assert re.search(r"only 0 of \d+ prompts reached the training set \(0% < validation.min_accepted_rate 50%\); "
                     r"most common reason \(\d+×\): \d+ tokens > sequences.max_seq_len 16", err)
    assert manifest_of(tmp_path / "flow")["status"] == "failed"
    assert list((tmp_path / "flow" / "rejected").glob("sequences-*.jsonl")), "every dropped sample is listed"


def _temporary_apis() -> set[int]:
    """Processes serving Prefect's API app the way local mode starts it."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"\x00-m\x00cli.local_api\x00" in cmdline.read_bytes():
                found.add(int(cmdline.parent.name))
        except OSError:
            pass
    return found


def test_a_clean_run_in_local_mode_is_quiet_and_leaves_no_server_behind(tiny_model: Path, server: ScriptedServer,
                                                                       tmp_path: Path) -> None:
    """The command as a new user runs it: no Prefect server configured, so it starts and stops its own."""
    cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    before = _temporary_apis()
    with (tmp_path / "out.txt").open("w") as out, (tmp_path / "err.txt").open("w") as err:
        command = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "run", "--config", write_config(tmp_path / "c.yaml", cfg)],
            env=env, stdout=out, stderr=err, cwd=Path(__file__).resolve().parents[2])
        seen: set[int] = set()  # watched while it runs: a check only after the exit could not tell "never found"
        deadline = time.monotonic() + 300
        try:
            while command.poll() is None and time.monotonic() < deadline:
                seen |= _temporary_apis() - before
                time.sleep(0.1)
        finally:
            if command.poll() is None:
                command.kill()
            command.wait()
    stdout = (tmp_path / "out.txt").read_text()
    printed = stdout + (tmp_path / "err.txt").read_text()
    assert command.returncode == 0, printed[-3000:]
    assert "ERROR" not in printed and "Traceback" not in printed, printed[-3000:]
    assert "View at" not in printed, "no link to a UI the temporary API does not serve"
    assert stdout.strip().splitlines()[-1] == f"artifacts: {tmp_path / 'flow'}"
    assert seen, "the command ran its own temporary Prefect API"
    assert not seen & _temporary_apis(), "the temporary Prefect API was stopped"


def test_an_unwritable_output_uri_is_one_line_naming_it(tiny_model: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    cfg = config(tiny_model, "http://127.0.0.1:9", tmp_path / "a-file" / "runs")
    assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output_uri: cannot write the run folder" in err


def test_a_server_check_error_is_the_last_line_and_its_traceback_is_in_the_run_log(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, return_token_ids=False)) as server:
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none", sequences__source="server")
        assert main(["run", "--config", write_config(tmp_path / "c.yaml", cfg)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "returns no token ids" in err
    log = re.search(r"\(details: (\S+\.log)\)$", err.strip())
    assert log and "Traceback" in Path(log.group(1)).read_text()
    assert manifest_of(tmp_path / "flow")["status"] == "failed"


def start_cli_until(config_path: str, server: ScriptedServer, requests: int) -> subprocess.Popen[str]:
    """The command as a user runs it, in its own process against this module's Prefect API, once the server has
    seen `requests` requests (it must not end before)."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or ""}
    child = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--config", config_path], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             cwd=Path(__file__).resolve().parents[2], preexec_fn=as_from_a_terminal)
    deadline = time.monotonic() + 120
    while server.log.requests < requests:
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.05)
    return child

def test_a_server_killed_mid_run_ends_the_process_failed_within_give_up_after_s(
        tiny_model: Path, tmp_path: Path) -> None:
    server = ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)),
                                   latency_s=0.1)).__enter__()
    cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none", server__give_up_after_s=3,
                 server__max_in_flight=2, validation__early_abort_after=4)
    try:
        child = start_cli_until(write_config(tmp_path / "c.yaml", cfg), server, 10)
    finally:
        server.__exit__(None, None, None)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 1
    assert err.strip().splitlines()[-1].startswith("error: gave up: "), err[-2000:]
    assert "Traceback" not in err
    assert manifest_of(tmp_path / "flow")["status"] == "failed"


def test_verify_after_a_kill_says_what_is_missing_and_the_next_run_says_it_was_interrupted(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)),
                               latency_s=0.2)) as server:
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none", server__max_in_flight=2)
        child = start_cli_until(write_config(tmp_path / "c.yaml", cfg), server, 12)
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        capsys.readouterr()
        assert main(["verify", str(tmp_path / "flow")]) == 1
        out = capsys.readouterr().out
        assert "missing: generations/shard-00000.jsonl" in out
        assert out.strip().splitlines()[-1].startswith("NOT complete: the run did not end")
        assert main(["run", "--config", str(tmp_path / "c.yaml")]) == 0
    manifest = manifest_of(tmp_path / "flow")
    assert manifest["status"] == "completed" and len(manifest["interrupted"]) == 1
    logs = sorted((tmp_path / "flow" / "logs").glob("run-*.log"))
    assert "did not end" in logs[-1].read_text()
    assert main(["verify", str(tmp_path / "flow")]) == 0
    assert capsys.readouterr().out.strip().endswith("run complete and consistent (structure; --deep reads every byte)")


def test_ctrl_c_ends_the_run_cancelled_with_one_line(tiny_model: Path, tmp_path: Path) -> None:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)),
                               latency_s=0.2)) as server:
        cfg = config(tiny_model, server.url, tmp_path, hidden_states__backend="none", server__max_in_flight=1)
        child = start_cli_until(write_config(tmp_path / "c.yaml", cfg), server, 6)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    assert child.returncode == 130
    assert err.strip().splitlines()[-1].startswith("cancelled: stopped by Ctrl-C; run again to resume")
    assert "Traceback" not in err
    assert manifest_of(tmp_path / "flow")["status"] == "cancelled"


def _sequences(run: Path) -> dict[str, tuple[list[int], str]]:
    rows = [row for f in sorted((run / "sequences").glob("shard-*.parquet")) for row in pq.read_table(f).to_pylist()]
    return {row["id"]: (row["input_ids"], row["source"]) for row in rows}


def test_a_server_without_token_ids_gets_exact_sequences_from_text_and_a_lossy_parser_fails_the_run(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang and hosted APIs send no token ids: the sequences are rebuilt from text and each is checked against the
    server's usage counts. A parser that strips the reasoning's trailing whitespace (vLLM's kimi_k2) loses a token
    the ids kept: every such sample is refused with that cause and the run ends Failed saying so."""
    tokenizer = load_tokenizer(str(tiny_model))
    runs = {}
    for name, script in (("ids", Script(model=DEMO_MODEL_NAME, tokenizer=tokenizer)),
                         ("text", Script(model=DEMO_MODEL_NAME, tokenizer=tokenizer, return_token_ids=False)),
                         ("stripped", Script(model=DEMO_MODEL_NAME, tokenizer=tokenizer, return_token_ids=False,
                                             strip_reasoning_whitespace=True))):
        with ScriptedServer(script) as server:
            cfg = config(tiny_model, server.url, tmp_path / name, hidden_states__backend="none")
            runs[name] = main(["run", "--config", write_config(tmp_path / f"{name}.yaml", cfg)])
    assert (runs["ids"], runs["text"], runs["stripped"]) == (0, 0, 1), capsys.readouterr().err
    from_ids, from_text = _sequences(tmp_path / "ids" / "flow"), _sequences(tmp_path / "text" / "flow")
    assert len(from_text) == 24 and {source for _, source in from_text.values()} == {"text"}
    assert {i: ids for i, (ids, _) in from_text.items()} == {i: ids for i, (ids, _) in from_ids.items()}
    assert [p["sequence_source"] for p in manifest_of(tmp_path / "text" / "flow")["probe"]] == ["text"]

    stripped = manifest_of(tmp_path / "stripped" / "flow")
    assert stripped["status"] == "failed" and "text rebuild disagrees with the server's counts" in stripped["cause"]
    assert "stripped whitespace from the end of the reasoning" in stripped["cause"], "the cause, in one line"
    rejected = [json.loads(line) for line in
                (tmp_path / "stripped" / "flow" / "rejected" / "sequences-shard-00000.jsonl").read_text().splitlines()]
    assert len(rejected) == 16 and all("stripped whitespace from the end of the reasoning" in r["reason"]
                                       for r in rejected)
    assert not _sequences(tmp_path / "stripped" / "flow"), "no sample of a shard over the threshold is kept"
    err = capsys.readouterr().err.strip().splitlines()
    assert "text rebuild disagrees with the server's counts" in err[-1]
