"""Stage 7: exported files load with plain torch/safetensors/datasets and hold what SpecForge and speculators read."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
import torch
from hidden_state_targets import AUX, HIDDEN, LAYERS, random_qwen3, random_rows, write_sequences
from safetensors.torch import load, load_file

from cli.main import main
from eagle3_datagen.artifacts import MANIFEST
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.storage import RunStore
from eagle3_datagen.training_reader import TrainingReader
from flows.pipeline import export
from tasks.export import ExportError, export_run
from tasks.hidden_states.transformers_backend import TargetModel, extract_shard, load_target_model

torch.set_num_threads(1)

SHARDS = {0: [7, 30, 12], 1: [25, 3], 2: [18, 40, 9, 2]}


@pytest.fixture(scope="module")
def bf16(model_dir: str) -> TargetModel:
    return load_target_model(model_dir, "bfloat16", "cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3-export")
    random_qwen3(initializer_range=0.2).save_pretrained(path)
    return str(path)


def shard_rows(shard: int, lengths: list[int]) -> list[tuple[str, list[int], list[int]]]:
    return [(f"{shard}-{k}", *row[1:]) for k, row in enumerate(random_rows(lengths, seed=shard))]


def make_run(output_uri: str, target: TargetModel, shards: dict[int, list[int]] = SHARDS,
             dtype: str = "bfloat16", compression: str = "none", held_out: set[str] | None = None) -> RunStore:
    """A run whose every shard has hidden states, as the pipeline leaves it (manifest, sequences, parts)."""
    store = RunStore(output_uri, "run")
    store.write_json(
        MANIFEST,
        {
            "config": {"hidden_states": {"backend": "transformers"}},
            "shards": {f"shard-{i:05d}": {} for i in shards},
            "status": "completed",
        },
    )
    for shard, lengths in shards.items():
        sequences = write_sequences(store, shard, shard_rows(shard, lengths), held_out)
        settings = HiddenStatesConfig(dtype=dtype, part_size_bytes=20_000, compression=compression)
        extract_shard(store, sequences, target, settings)
    return store


def reference(target: TargetModel, tokens: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """transformers' own hidden_states (index i = input to layer i; the last entry after the norm) and the last
    layer's output (before the norm), for one sequence."""
    before: list[torch.Tensor] = []
    handle = target.base.layers[-1].register_forward_hook(lambda m, a, out: before.append(out))
    try:
        with torch.inference_mode():
            out = target.base(input_ids=tokens[None].long(), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    return out.hidden_states, before[0][0]


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The same state up to bf16 rounding (a padded batch rounds differently from one sequence): every token points
    the same way and has the same length."""
    got, expected = got.float(), expected.float()
    assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() >= 0.999
    assert ((got.norm(dim=-1) / expected.norm(dim=-1)) - 1).abs().max() <= 0.01


def test_specforge_files_load_with_weights_only_and_hold_the_after_norm_state(
    tmp_path: Path, bf16: TargetModel
) -> None:
    make_run(str(tmp_path), bf16)
    summary = export_run(str(tmp_path / "run"), "specforge")

    out = tmp_path / "run" / "exports" / "specforge"
    assert summary["num_samples"] == 9 and summary["final_state"] == "after_norm"
    assert summary["aux_layers"] == {"input_to_layer": AUX, "output_of_layer": [1, 3, 4]}
    files = sorted(str(f) for f in out.rglob("*.ckpt"))  # SpecForge's listing: every *.ckpt, in string order
    assert len(files) == 9
    ids = RunStore.at(str(out)).read_json("export.json")["samples"]
    rows = {row[0]: row for shard, lengths in SHARDS.items() for row in shard_rows(shard, lengths)}
    assert sorted(ids) == sorted(rows) and [i.split("-")[0] for i in ids] == sorted(i.split("-")[0] for i in ids)
    for i, sample_id in enumerate(ids):
        path = Path(files[i])  # the string order is the sample order of export.json
        assert path.name == f"data_{i:09d}.ckpt"
        data = torch.load(path, weights_only=True)
        tokens = len(data["input_ids"])
        assert data["input_ids"].tolist() == rows[sample_id][1] and data["loss_mask"].tolist() == rows[sample_id][2]
        assert set(data) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert data["input_ids"].dtype == data["loss_mask"].dtype == torch.int64
        assert data["loss_mask"].shape == (tokens,)
        assert data["aux_hidden_state"].shape == (1, tokens, 3 * HIDDEN)
        assert data["hidden_state"].shape == (1, tokens, HIDDEN)
        assert data["aux_hidden_state"].dtype == data["hidden_state"].dtype == torch.bfloat16
        assert path.stat().st_size < tokens * 4 * HIDDEN * 2 + tokens * 16 + 4096, "one sample, not its whole part"

        hf, before_norm = reference(bf16, data["input_ids"])
        for k, layer in enumerate(AUX):
            close(data["aux_hidden_state"][0, :, k * HIDDEN : (k + 1) * HIDDEN], hf[layer][0])
        close(data["hidden_state"][0], hf[LAYERS][0])  # after the norm: what lm_head reads
        with pytest.raises(AssertionError):
            close(data["hidden_state"][0], before_norm)

        # what SpecForge's OfflineEagle3Dataset.process_data does with it
        loss_mask = data["loss_mask"][:2048][None, :]
        loss_mask[0, -1] = 0
        assert data["aux_hidden_state"].squeeze(0)[:2048][None, :].shape == (1, tokens, 3 * HIDDEN)


def test_speculators_files_and_dataset_pair_up_with_the_before_norm_state(tmp_path: Path, bf16: TargetModel) -> None:
    make_run(str(tmp_path), bf16)
    out = tmp_path / "for-speculators"
    summary = export_run(str(tmp_path / "run"), "speculators", str(out))
    assert summary["final_state"] == "before_norm" and summary["num_samples"] == 9

    rows = datasets.load_from_disk(str(out))  # what speculators' ArrowDataset does with the folder
    assert len(rows) == 9 and set(rows.column_names) == {"input_ids", "loss_mask", "seq_len"}
    for i in range(9):
        loaded = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        tokens = int(rows[i]["seq_len"])
        assert loaded["token_ids"].dtype == torch.int64 and loaded["token_ids"].shape == (tokens,)
        assert torch.equal(loaded["token_ids"], rows[i]["input_ids"])  # speculators' own pairing check
        assert torch.equal(loaded["loss_mask"], rows[i]["loss_mask"])
        assert loaded["hidden_states"].shape == (tokens, 4, HIDDEN)
        assert loaded["hidden_states"].dtype == torch.bfloat16

        hf, before_norm = reference(bf16, loaded["token_ids"])
        for k, layer in enumerate(AUX):
            close(loaded["hidden_states"][:, k], hf[layer][0])
        close(loaded["hidden_states"][:, 3], before_norm)  # before the norm, as vLLM captures it
        # speculators' split: three aux layers flattened, the last as verifier_last_hidden_states
        assert loaded["hidden_states"][:, :-1].flatten(1).shape == (tokens, 3 * HIDDEN)


def test_specforge_features_are_bf16_from_a_float32_run_and_speculators_gets_token_frequencies(
        tmp_path: Path, model_dir: str) -> None:
    """SpecForge trains only on bf16 features; speculators sizes its draft vocabulary from token_freq.pt."""
    make_run(str(tmp_path), load_target_model(model_dir, "float32", "cpu"), {0: [7, 12], 1: [9]}, dtype="float32")
    summary = export_run(str(tmp_path / "run"), "specforge")
    assert (summary["dtype"], summary["source_dtype"]) == ("bfloat16", "float32")
    for path in (tmp_path / "run" / "exports" / "specforge").rglob("*.ckpt"):
        data = torch.load(path, weights_only=True)
        assert data["aux_hidden_state"].dtype == data["hidden_state"].dtype == torch.bfloat16

    out = tmp_path / "for-speculators"
    export_run(str(tmp_path / "run"), "speculators", str(out))
    frequencies = torch.load(out / "token_freq.pt", weights_only=True)
    expected: dict[int, int] = {}
    for shard, lengths in {0: [7, 12], 1: [9]}.items():
        for _, ids, mask in shard_rows(shard, lengths):
            for token, masked in zip(ids, mask, strict=True):
                if masked:
                    expected[token] = expected.get(token, 0) + 1
    assert frequencies == expected and sum(frequencies.values()) > 0


@pytest.mark.parametrize("export_format", ["specforge", "speculators"])
def test_every_compression_exports_the_same_samples(tmp_path: Path, bf16: TargetModel, export_format: str) -> None:
    """Export decodes: zstd gives the very files of an uncompressed run, fp8 the same samples, every state row
    within cosine 0.999 of the uncompressed one (not its length to 1%: e4m3 keeps 3 mantissa bits)."""
    files: dict[str, dict[str, bytes]] = {}
    for compression in ("none", "zstd", "fp8"):
        make_run(str(tmp_path / compression), bf16, compression=compression)
        out = tmp_path / compression / "run" / "exports" / export_format
        export_run(str(tmp_path / compression / "run"), export_format)
        files[compression] = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
                              if p.suffix in (".ckpt", ".safetensors")}  # the samples' files

    assert len(files["none"]) == 9
    assert files["zstd"] == files["none"]
    assert files["fp8"].keys() == files["none"].keys()
    for name, data in files["none"].items():
        if name.endswith(".ckpt"):
            plain = torch.load(io.BytesIO(data), weights_only=True)
            quantized = torch.load(io.BytesIO(files["fp8"][name]), weights_only=True)
            states = ("aux_hidden_state", "hidden_state")
        else:
            plain, quantized = load(data), load(files["fp8"][name])
            states = ("hidden_states",)
        assert plain.keys() == quantized.keys()
        for key in plain:
            if key in states:
                got, expected = quantized[key].flatten(0, -2).float(), plain[key].flatten(0, -2).float()
                assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() >= 0.999, (name, key)
            else:
                assert torch.equal(quantized[key], plain[key]), (name, key)


def test_a_second_export_redoes_only_changed_shards(tmp_path: Path, bf16: TargetModel) -> None:
    make_run(str(tmp_path), bf16)
    run = str(tmp_path / "run")
    export_run(run, "specforge")
    out = tmp_path / "run" / "exports" / "specforge"
    times = {p.name: p.stat().st_mtime_ns for p in out.rglob("*.ckpt")}

    store = RunStore(str(tmp_path), "run")
    grown = write_sequences(store, 1, shard_rows(1, [25, 3, 11]))  # shard 1 grew by one sample: shard 2's numbers move
    extract_shard(store, grown, bf16, HiddenStatesConfig(dtype="bfloat16"))
    summary = export_run(run, "specforge")

    assert summary["num_samples"] == 10
    after = {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*.ckpt")}
    assert len(after) == 10
    assert all(after[f"shard-00000/{name}"] == times[name] for name in (f"data_{i:09d}.ckpt" for i in range(3)))
    assert sorted(after) == sorted(
        [f"shard-00000/data_{i:09d}.ckpt" for i in range(3)]
        + [f"shard-00001/data_{i:09d}.ckpt" for i in range(3, 6)]
        + [f"shard-00002/data_{i:09d}.ckpt" for i in range(6, 10)]
    )
    ids = RunStore.at(str(out)).read_json("export.json")["samples"]
    assert sorted(ids[3:6]) == ["1-0", "1-1", "1-2"]


def test_unfinished_run_is_refused_with_the_fix_and_nothing_written(tmp_path: Path, bf16: TargetModel) -> None:
    store = make_run(str(tmp_path), bf16, {0: [5, 6]})
    store.write_json(MANIFEST, {**store.read_json(MANIFEST), "shards": {"shard-00000": {}, "shard-00001": {}}})
    with pytest.raises(
        ExportError, match=r"hidden_states/shard-00001 is not finished: run `eagle3-datagen rerun-failed"
    ):
        export_run(str(tmp_path / "run"), "speculators")
    assert not (tmp_path / "run" / "exports").exists()


def test_cli_exports_and_prints_one_line_errors(
    tmp_path: Path, bf16: TargetModel, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(str(tmp_path), bf16, {0: [4, 8]})
    assert main(["export", str(tmp_path / "run"), "--format", "speculators"]) == 0
    assert "2 train samples" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "nothing-here"), "--format", "specforge"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "give the folder of a run" in error


@pytest.mark.usefixtures("prefect_api")
def test_export_flow_runs_shards_as_tasks(tmp_path: Path, bf16: TargetModel) -> None:
    make_run(str(tmp_path), bf16)
    summary = export(str(tmp_path / "run"), "specforge")
    assert summary["num_samples"] == 9
    assert len(list((tmp_path / "run" / "exports" / "specforge").rglob("*.ckpt"))) == 9


HELD_OUT = {"0-1", "2-0", "2-3"}


@pytest.mark.parametrize("export_format", ["specforge", "speculators"])
def test_held_out_samples_are_their_own_parts_and_reach_no_training_export(
        tmp_path: Path, bf16: TargetModel, export_format: str) -> None:
    store = make_run(str(tmp_path), bf16, held_out=HELD_OUT)
    for shard in (0, 2):
        parts = store.read_json(f"hidden_states/shard-{shard:05d}/index.json")["parts"]
        assert any(part.get("split") == "holdout" for part in parts)
    every = {f"{shard}-{k}" for shard, lengths in SHARDS.items() for k in range(len(lengths))}

    train = export_run(store.uri, export_format)
    held = export_run(store.uri, export_format, split="holdout")

    assert (train["split"], train["num_samples"], held["split"], held["num_samples"]) == (
        "train", len(every) - len(HELD_OUT), "holdout", len(HELD_OUT))
    exported = {split: set(RunStore.at(f"{store.uri}/exports/{folder}").read_json("export.json")["samples"])
                for split, folder in (("train", export_format), ("holdout", f"{export_format}-holdout"))}
    assert exported == {"train": every - HELD_OUT, "holdout": HELD_OUT}
    if export_format == "speculators":
        assert len(datasets.load_from_disk(f"{store.uri}/exports/speculators")) == len(every) - len(HELD_OUT)
    readers = {split: {bytes(s["input_ids"].flatten().numpy()) for s in TrainingReader(store.uri, export_format,
                                                                                    split=split)}
               for split in ("train", "holdout")}
    rows = {f"{shard}-{k}": bytes(torch.tensor(row[1], dtype=torch.int64).numpy())
            for shard, lengths in SHARDS.items() for k, row in enumerate(shard_rows(shard, lengths))}
    assert readers == {"train": {rows[i] for i in every - HELD_OUT}, "holdout": {rows[i] for i in HELD_OUT}}


def test_a_run_without_held_out_samples_says_so_when_they_are_asked_for(tmp_path: Path, bf16: TargetModel) -> None:
    store = make_run(str(tmp_path), bf16, shards={0: [5, 6]})
    with pytest.raises(ExportError, match="has no holdout samples to export"):
        export_run(store.uri, "speculators", split="holdout")
