"""Stage 6 on a real tiny Qwen3 (random weights, saved to disk) and real parquet/safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hidden_state_targets import AUX, HIDDEN, LAYERS, random_qwen3, random_rows, write_sequences
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

from eagle3_datagen.artifacts import ShardRef, artifact_path, blocks_sha256_hex, sha256_hex
from eagle3_datagen.config import HiddenStatesConfig, parse_config
from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.hidden_state_format import (
    STATE_TENSORS,
    HiddenStatesError,
    Sample,
    check_compression,
    final_rms_norm,
    read_final_norm,
    read_hidden_state_shard,
    safetensors_buffers,
)
from eagle3_datagen.hidden_state_format import _zstd_compress as zstd_compress
from eagle3_datagen.storage import RunLocation, RunStore
from tasks.hidden_states import ExtractionSettings, extract_hidden_states
from tasks.hidden_states.batching import plan_batches
from tasks.hidden_states.parts import read_sequences, write_shard
from tasks.hidden_states.targets import default_aux_layers, resolve_aux_layers
from tasks.hidden_states.task import HIDDEN_STATES
from tasks.hidden_states.transformers_backend import (
    TargetModel,
    capture_batch,
    extract_shard,
    fresh_target_model,
    load_target_model,
)
from tasks.run.status import ShardStatus, StageStatus, fp8_fidelity

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3")
    # layers that visibly move the residual stream, so a wrong index cannot pass
    random_qwen3(initializer_range=0.2).save_pretrained(path)
    return str(path)


@pytest.fixture
def fp32(model_dir: str) -> TargetModel:
    return load_target_model(model_dir, "float32", "cpu")


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(str(tmp_path), "run")


def test_default_aux_layers_follow_eagle3_for_8_layers() -> None:
    assert default_aux_layers(8) == [2, 4, 5]
    assert resolve_aux_layers(None, 8) == [2, 4, 5]
    assert resolve_aux_layers([1, 3, 7], 8) == [1, 3, 7]


@pytest.mark.parametrize("layers", [[0, 4, 5], [2, 4, 8], [4, 2, 5], [2, 2, 5], [2, 4], [1, 2, 3, 4]])
def test_invalid_aux_layers_give_one_line_error_with_valid_range(layers: list[int]) -> None:
    with pytest.raises(ConfigurationError, match=r"hidden_states\.aux_layers.*1\.\.7") as error:
        resolve_aux_layers(layers, 8)
    assert "\n" not in str(error.value)


def test_default_aux_layers_refused_when_they_collide_on_a_shallow_model() -> None:
    with pytest.raises(ConfigurationError, match=r"default \[2, 3, 3\].*1\.\.5"):
        resolve_aux_layers(None, 6)


def test_hooked_capture_matches_transformers_hidden_states(fp32: TargetModel) -> None:
    tokens = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(1))
    [(aux, final)] = capture_batch(fp32, AUX, [tokens])

    before_norm: list[torch.Tensor] = []
    handle = fp32.base.layers[-1].register_forward_hook(lambda m, a, out: before_norm.append(out))
    try:
        with torch.inference_mode():
            hf = fp32.base(input_ids=tokens[None].long(), output_hidden_states=True, use_cache=False).hidden_states
    finally:
        handle.remove()

    assert len(hf) == LAYERS + 1
    assert aux.shape == (23, 3 * HIDDEN) and final.shape == (23, HIDDEN)
    for k, layer in enumerate(AUX):
        torch.testing.assert_close(aux[:, k * HIDDEN : (k + 1) * HIDDEN], hf[layer][0])
        assert not torch.allclose(aux[:, k * HIDDEN : (k + 1) * HIDDEN], hf[layer + 1][0], atol=1e-3)
    # "before_norm" is the truth, not a label: the last layer's output, which the norm turns into HF's last entry
    torch.testing.assert_close(final, before_norm[0][0])
    assert not torch.allclose(final, hf[-1][0], atol=1e-3)
    torch.testing.assert_close(final_rms_norm(final, fp32.norm_weight, fp32.norm_eps), hf[-1][0])


def test_padded_batch_equals_one_at_a_time(fp32: TargetModel) -> None:
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 512, (n,), generator=gen, dtype=torch.int32) for n in (5, 31, 1, 12, 31, 9)]
    batched = capture_batch(fp32, AUX, sequences)
    for seq, (aux, final) in zip(sequences, batched, strict=True):
        [(alone_aux, alone_final)] = capture_batch(fp32, AUX, [seq])
        assert aux.shape == alone_aux.shape == (len(seq), 3 * HIDDEN)
        torch.testing.assert_close(aux, alone_aux, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, alone_final, atol=1e-4, rtol=1e-4)


def test_batches_stay_within_padded_token_budget() -> None:
    lengths = [5, 40, 9, 100, 12, 12, 3, 30]
    batches = plan_batches(lengths, max_tokens=40)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert [3] in batches  # longer than the budget: alone
    for batch in batches:
        if batch != [3]:
            assert len(batch) * max(lengths[i] for i in batch) <= 40
    assert len(plan_batches([8] * 10, max_tokens=40)) == 2


class RecordingStore(RunStore):
    """Remembers the order of whole-file writes, to check that the index comes last."""

    def __init__(self, output_uri: str, run_name: str) -> None:
        super().__init__(output_uri, run_name)
        self.written: list[str] = []

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.written.append(rel)
        super().write_bytes(rel, data)


def test_shard_splits_into_parts_and_reads_back_equal(fp32: TargetModel, tmp_path: Path) -> None:
    store = RecordingStore(str(tmp_path), "run")
    rows = random_rows([3, 40, 17, 25, 8, 33, 1, 40, 12, 20, 29, 6], seed=3)
    shard = write_sequences(store, 3, rows)
    left = ["part-00042.safetensors", "part-00000.safetensors", "part-00001.safetensors.tmp-0f3a"]  # a killed write
    for name in left:
        store.write_bytes(f"hidden_states/shard-00003/{name}", b"left by an older run")
    settings = HiddenStatesConfig(dtype="float32", max_tokens_per_batch=64, part_size_bytes=40_000)

    index = extract_shard(store, shard, fp32, settings)

    assert sorted(path.name for path in Path(store.local_path("hidden_states/shard-00003")).iterdir()) == sorted(
        ["index.json", "final_norm.safetensors", *(part["file"] for part in index["parts"])])
    assert store.written[-1] == "hidden_states/shard-00003/index.json"
    assert len(index["parts"]) >= 4
    assert index["num_samples"] == len(rows) and index["num_tokens"] == sum(len(r[1]) for r in rows)
    assert index["aux_layers"] == {"input_to_layer": AUX, "output_of_layer": [1, 3, 4]}
    assert index["final_state"] == "before_norm" and index["hidden_size"] == HIDDEN
    weight, eps = read_final_norm(store, "hidden_states/shard-00003/index.json")
    assert weight.equal(fp32.norm_weight) and eps == fp32.norm_eps == index["final_norm"]["eps"]
    largest_sample = 40 * (4 * HIDDEN * 4 + 4 + 1)
    for part in index["parts"]:
        assert part["bytes"] <= settings.part_size_bytes + largest_sample + 4096
        with safe_open(store.local_path(f"hidden_states/shard-00003/{part['file']}"), "pt") as f:
            ids = json.loads(f.metadata()["sample_ids"])
            offsets = f.get_tensor("offsets")
            assert offsets[0] == 0 and offsets[-1] == f.get_tensor("input_ids").shape[0] == part["num_tokens"]
            lengths = {r[0]: len(r[1]) for r in rows}
            assert (offsets[1:] - offsets[:-1]).tolist() == [lengths[i] for i in ids]
            assert [index["samples"][i] for i in ids] == [[index["parts"].index(part), row] for row in range(len(ids))]

    read = {sample.id: sample for sample in read_hidden_state_shard(store, "hidden_states/shard-00003/index.json")}
    assert sorted(read) == sorted(r[0] for r in rows)
    for sample_id, tokens, mask in rows:
        sample = read[sample_id]
        assert sample.input_ids.tolist() == tokens and sample.loss_mask.tolist() == mask
        [(aux, final)] = capture_batch(fp32, AUX, [torch.tensor(tokens)])
        torch.testing.assert_close(sample.aux_hidden_states, aux, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sample.final_hidden_states, final, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("compression", ["none", "zstd", "fp8"])
def test_corrupted_part_is_detected(fp32: TargetModel, store: RunStore, compression: str) -> None:
    shard = write_sequences(store, 0, random_rows([30, 30, 30, 30], seed=4))
    settings = HiddenStatesConfig(dtype="float32", part_size_bytes=20_000, compression=compression)
    extract_shard(store, shard, fp32, settings)
    index_rel = "hidden_states/shard-00000/index.json"
    assert len(list(read_hidden_state_shard(store, index_rel))) == 4

    part = Path(store.local_path("hidden_states/shard-00000/part-00001.safetensors"))
    data = bytearray(part.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    stored_aux = {"none": "aux_hidden_states", "zstd": "aux_hidden_states.zstd", "fp8": "aux_hidden_states.fp8"}
    start, end = header[stored_aux[compression]]["data_offsets"]
    data[8 + header_len + (start + end) // 2] ^= 0x01  # one flipped bit in a hidden state: the file still loads
    part.write_bytes(bytes(data))
    with pytest.raises(HiddenStatesError, match=r"part-00001\.safetensors does not match its checksum"):
        list(read_hidden_state_shard(store, index_rel))


def test_a_final_norm_that_final_rms_norm_cannot_redo_is_refused(model_dir: str, store: RunStore) -> None:
    """A Gemma-style (1 + weight) or LayerNorm target would otherwise give wrong after-norm exports, silently."""
    target = fresh_target_model(model_dir, "float32", "cpu")  # a private copy to change
    target.base.norm.register_forward_hook(lambda module, args, output: output + 1.0)
    shard = write_sequences(store, 0, random_rows([5, 9], seed=8))
    with pytest.raises(HiddenStatesError, match="not the plain RMSNorm"):
        extract_shard(store, shard, target, HiddenStatesConfig(dtype="float32"))
    assert not store.exists(artifact_path("hidden_states", 0))


def test_non_finite_states_name_the_sample_and_leave_no_index(model_dir: str, store: RunStore) -> None:
    target = fresh_target_model(model_dir, "float32", "cpu")  # a private copy to poison
    with torch.no_grad():
        target.base.get_input_embeddings().weight[7] = float("nan")
    shard = write_sequences(store, 1, [("fine", [1, 2, 3], [0, 1, 1]), ("poisoned-42", [1, 7, 3], [0, 1, 1])])
    store.write_json(artifact_path("hidden_states", 1), {"parts": []})  # an earlier run's: it must not vouch for these
    with pytest.raises(HiddenStatesError, match=r"'poisoned-42'.*NaN"):
        extract_shard(store, shard, target, HiddenStatesConfig(dtype="float32"))
    assert not store.exists(artifact_path("hidden_states", 1))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([("a", [1, 2], [0, 1]), ("a", [3], [1])], "'a' appears twice"),
        ([("a", [1, 2, 600], [0, 1, 1])], "'a' has token ids outside the target's vocabulary of 512"),
        ([("a", [1, 2, 3], [0, 1])], "'a' has 3 tokens, 2 mask values"),
        ([("a", [], [])], "'a' has 0 tokens"),
    ],
)
def test_bad_sequences_are_refused_by_name(
    store: RunStore, rows: list[tuple[str, list[int], list[int]]], message: str
) -> None:
    shard = write_sequences(store, 0, rows)
    with pytest.raises(HiddenStatesError, match=message):
        read_sequences(store, shard, vocab_size=512)


def test_bf16_bytes_per_token_are_four_hidden_states_plus_ids_and_mask(model_dir: str, store: RunStore) -> None:
    target = load_target_model(model_dir, "bfloat16", "cpu")
    shard = write_sequences(store, 0, random_rows([64] * 8, seed=5))
    index = extract_shard(store, shard, target, HiddenStatesConfig(dtype="bfloat16"))

    [part] = index["parts"]
    per_token = part["bytes"] / index["num_tokens"]
    expected = (3 * HIDDEN + HIDDEN) * 2 + 4 + 1  # bf16 states, int32 id, uint8 mask
    assert expected <= per_token <= expected * 1.03
    sample = next(read_hidden_state_shard(store, "hidden_states/shard-00000/index.json"))
    assert sample.aux_hidden_states.dtype == sample.final_hidden_states.dtype == torch.bfloat16
    assert sample.aux_hidden_states.shape == (64, 3 * HIDDEN) and index["dtype"] == "bfloat16"


def test_task_hands_on_a_ref_to_the_index(model_dir: str, tmp_path: Path) -> None:
    store = RunStore(str(tmp_path), "run")
    sequences = write_sequences(store, 2, random_rows([10, 20, 5], seed=6))

    settings = HiddenStatesConfig(dtype="float32")
    ref = extract_hidden_states.fn(sequences, ExtractionSettings(settings, model_dir, "fp", False),
                                   RunLocation(str(tmp_path), "run"))

    assert ref == ShardRef(
        stage="hidden_states",
        index=2,
        path="hidden_states/shard-00002/index.json",
        num_records=3,
        sha256=sha256_hex(store.read_bytes("hidden_states/shard-00002/index.json")),
    )
    fingerprint = load_target_model(model_dir, "float32", "cpu").fingerprint
    assert store.read_json(ref.path)["model"]["fingerprint"] == fingerprint


def test_shards_extracted_in_parallel_threads_do_not_mix_states(model_dir: str, tmp_path: Path) -> None:
    """Prefect runs mapped shards in threads over one cached model: each must get its own states."""
    from concurrent.futures import ThreadPoolExecutor

    store = RunStore(str(tmp_path), "run")
    settings = HiddenStatesConfig(dtype="float32", max_tokens_per_batch=64)  # many forward passes per shard
    lengths = {i: [(7 * i + 13 * k) % 60 + 3 for k in range(12)] for i in range(6)}
    refs = [write_sequences(store, index, random_rows(sizes, seed=index)) for index, sizes in lengths.items()]
    import time

    from tasks.hidden_states.transformers_backend import load_target_model

    base = load_target_model(model_dir, settings.dtype, settings.device_map).base
    slow = base.layers[0].register_forward_hook(lambda *_: time.sleep(0.01))  # let the threads' passes overlap
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            extract = lambda ref: extract_hidden_states.fn(  # noqa: E731
                ref, ExtractionSettings(settings, model_dir, "fp", False), RunLocation(str(tmp_path), "run"))
            list(pool.map(extract, refs))
    finally:
        slow.remove()
    for index, sizes in lengths.items():
        samples = list(read_hidden_state_shard(store, artifact_path("hidden_states", index)))
        assert sorted(len(s.input_ids) for s in samples) == sorted(sizes)


def test_shards_in_threads_load_the_target_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapped shards start at once in threads: one copy of the weights, not one per shard."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import tasks.hidden_states.transformers_backend as backend

    random_qwen3().save_pretrained(tmp_path / "target")
    loads: list[str] = []
    real = backend.AutoModelForCausalLM.from_pretrained

    def slow_counted_load(path: str, **kwargs: Any) -> Any:
        loads.append(path)
        time.sleep(0.2)  # long enough for every thread to miss the cache together
        return real(path, **kwargs)

    monkeypatch.setattr(backend.AutoModelForCausalLM, "from_pretrained", slow_counted_load)
    with ThreadPoolExecutor(4) as pool:
        targets = list(pool.map(lambda _: load_target_model(str(tmp_path / "target"), "float32", "cpu"), range(4)))
    assert len(loads) == 1 and all(target is targets[0] for target in targets)


def test_a_part_file_is_the_same_bytes_in_every_process(tmp_path: Path) -> None:
    """safetensors writes its metadata in a per-process hash order: without sorting it, a shard extracted on
    another machine (a Ray worker) or in another run would be a different file with the same tensors."""
    import subprocess
    import sys

    script = ("import sys, torch; from eagle3_datagen.hidden_state_format import save_safetensors; "
              "sys.stdout.buffer.write(save_safetensors({'x': torch.arange(4.0)}, "
              "{'format': 'f', 'sample_ids': '[\"é\"]', 'aux_layers': '{}', 'final_state': 'before_norm'}))")
    files = {subprocess.run([sys.executable, "-c", script], capture_output=True, check=True).stdout for _ in range(4)}
    assert len(files) == 1
    (tmp_path / "part.safetensors").write_bytes(files.pop())
    with safe_open(tmp_path / "part.safetensors", "pt") as part:
        assert part.get_tensor("x").tolist() == [0.0, 1.0, 2.0, 3.0] and part.metadata()["sample_ids"] == '["é"]'


def test_a_part_written_from_pieces_is_what_safetensors_reads(store: RunStore) -> None:
    """Parts are written as their samples' buffers in turn (never joined): the file must still be plain
    safetensors, each tensor the pieces' concatenation, bit for bit, and its checksum that of the file."""
    gen = torch.Generator().manual_seed(3)
    pieces = {
        "states": [torch.randn(n, 6, generator=gen).to(torch.bfloat16) for n in (3, 0, 5)],
        "half": [torch.randn(n, 2, 3, generator=gen).half() for n in (2, 4)],
        "wide": [torch.randn(n, generator=gen) for n in (7, 1)],
        "input_ids": [torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32) for n in (3, 0, 5)],
        "loss_mask": [torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8) for n in (3, 0, 5)],
        "offsets": [torch.tensor([0, 3, 3, 8], dtype=torch.int64)],
        "fp8": [torch.randn(4, 6, generator=gen).to(torch.float8_e4m3fn)],
        "scale": [torch.rand((), generator=gen)],
    }
    buffers = safetensors_buffers(pieces, {"sample_ids": '["a", "b", "c"]', "format": "f"})
    store.write_buffers("part.safetensors", list(buffers))
    data = store.read_bytes("part.safetensors")
    assert data == b"".join(buffers) and sha256_hex(data) == sha256_hex(*buffers)
    assert int.from_bytes(data[:8], "little") % 8 == 0, "the data starts 8-byte aligned"
    loaded = safetensors_load(data)
    assert sorted(loaded) == sorted(pieces)
    for name, tensor_pieces in pieces.items():
        expected = torch.cat(tensor_pieces) if tensor_pieces[0].dim() else tensor_pieces[0]
        assert loaded[name].dtype == expected.dtype and loaded[name].shape == expected.shape, name
        assert loaded[name].reshape(-1).view(torch.uint8).equal(expected.reshape(-1).view(torch.uint8)), name
    with safe_open(store.local_path("part.safetensors"), "pt") as part:
        assert part.metadata() == {"sample_ids": '["a", "b", "c"]', "format": "f"}


def extract_with(store: RunStore, target: TargetModel, compression: str, shard: int = 0) -> tuple[dict, list[Sample]]:
    """One shard of mixed lengths in several parts, extracted with `compression`, its index and samples read back."""
    sequences = write_sequences(store, shard, random_rows([3, 40, 17, 25, 1, 33, 12], seed=9))
    settings = HiddenStatesConfig(dtype="bfloat16", part_size_bytes=15_000, compression=compression)
    index = extract_shard(store, sequences, target, settings)
    return index, list(read_hidden_state_shard(store, artifact_path("hidden_states", shard)))


@pytest.fixture(scope="module")
def bf16(model_dir: str) -> TargetModel:
    return load_target_model(model_dir, "bfloat16", "cpu")


def test_zstd_reads_back_bit_exact_and_smaller(bf16: TargetModel, tmp_path: Path) -> None:
    plain_index, plain = extract_with(RunStore(str(tmp_path), "plain"), bf16, "none")
    index, packed = extract_with(RunStore(str(tmp_path), "zstd"), bf16, "zstd")

    assert index["compression"] == "zstd" and plain_index["compression"] == "none" and "fp8_cosine" not in index
    assert len(index["parts"]) == len(plain_index["parts"]) >= 3
    assert sum(p["bytes"] for p in index["parts"]) < 0.9 * sum(p["bytes"] for p in plain_index["parts"])
    assert [s.id for s in packed] == [s.id for s in plain]
    for got, expected in zip(packed, plain, strict=True):
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states"):
            a, b = getattr(got, name), getattr(expected, name)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name  # bits, not values: -0.0 is kept


def state_rows(sample: Sample) -> torch.Tensor:
    """A sample's stored rows, one per token and layer: [t, 4, H] in float64."""
    tokens = len(sample.input_ids)
    aux = sample.aux_hidden_states.view(tokens, 3, HIDDEN)
    return torch.cat([aux, sample.final_hidden_states[:, None]], 1).double()


def test_fp8_reads_back_in_the_model_dtype_within_its_tolerance_and_the_index_holds_its_cosines(
        bf16: TargetModel, tmp_path: Path) -> None:
    _, plain = extract_with(RunStore(str(tmp_path), "plain"), bf16, "none")
    index, quantized = extract_with(RunStore(str(tmp_path), "fp8"), bf16, "fp8")

    assert index["compression"] == "fp8"
    cosines = []
    for got, expected in zip(quantized, plain, strict=True):
        assert got.id == expected.id
        assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.loss_mask, expected.loss_mask)
        assert got.aux_hidden_states.dtype == got.final_hidden_states.dtype == torch.bfloat16
        decoded, original = state_rows(got), state_rows(expected)
        # e4m3 keeps 3 mantissa bits (within 1/16 of a value), steps of 2^-9 of the row's scale near zero, and
        # the value is rounded to bf16 again (1/256)
        scale = original.abs().amax(-1, keepdim=True) / 448
        assert ((decoded - original).abs() <= original.abs() * (1 / 16 + 1 / 256) + scale / 1024 * 1.01).all()
        assert not torch.equal(decoded, original)
        dot = (decoded * original).sum(-1)
        cosines.append((dot / (decoded.norm(dim=-1) * original.norm(dim=-1))).flatten())
    cosine = torch.cat(cosines)

    stats = index["fp8_cosine"]
    assert stats["rows"] == len(cosine) == 4 * index["num_tokens"]
    assert stats["min"] == pytest.approx(cosine.min().item(), abs=1e-6)
    assert stats["p1"] == pytest.approx(torch.quantile(cosine, 0.01).item(), abs=1e-6)
    assert stats["p50"] == pytest.approx(torch.quantile(cosine, 0.5).item(), abs=1e-6)
    assert stats["mean"] == pytest.approx(cosine.mean().item(), abs=1e-6)
    assert stats["under_0.999"] == int((cosine < 0.999).sum())
    assert sum(p["bytes"] for p in index["parts"]) < 0.6 * index["num_tokens"] * 4 * HIDDEN * 2


def test_fp8_quantized_on_the_model_device_writes_the_part_the_writer_would_from_plain_states(
        bf16: TargetModel, tmp_path: Path) -> None:
    """The transformers backend quantizes before the copy; the vLLM backend's plain states are quantized by the
    writer: one stored encoding either way, byte for byte."""
    settings = HiddenStatesConfig(dtype="bfloat16", part_size_bytes=10 << 20, compression="fp8")
    rows = random_rows([3, 40, 17, 25, 1, 33, 12], seed=9)
    on_device = RunStore(str(tmp_path), "on-device")
    index = extract_shard(on_device, write_sequences(on_device, 0, rows), bf16, settings)
    _, plain = extract_with(RunStore(str(tmp_path), "plain"), bf16, "none")
    in_writer = RunStore(str(tmp_path), "in-writer")  # the plain states in the order the batches made them
    replayed = write_shard(in_writer, write_sequences(in_writer, 0, rows), bf16, settings,
                           lambda sequences, layers: (sample for sample in plain))
    assert len(index["parts"]) == len(replayed["parts"]) == 1
    part = f"hidden_states/shard-00000/{index['parts'][0]['file']}"
    assert on_device.read_bytes(part) == in_writer.read_bytes(part)
    assert index["fp8_cosine"] == replayed["fp8_cosine"]


def test_a_zstd_part_of_format_3_one_stream_per_state_stays_readable(bf16: TargetModel, store: RunStore) -> None:
    """/4 compresses each sample's states on its own (on several threads); /3 compressed a part's states as one
    stream, and a run written then still reads bit for bit."""
    index, expected = extract_with(store, bf16, "none")
    folder = "hidden_states/shard-00000"
    parts = []
    for part in index["parts"]:
        tensors = safetensors_load(store.read_bytes(f"{folder}/{part['file']}"))
        stored = {name: [tensor] for name, tensor in tensors.items() if name not in STATE_TENSORS}
        stored |= {f"{name}.zstd": [zstd_compress(tensors[name])] for name in STATE_TENSORS}
        encoded = {name: {"dtype": "bfloat16", "shape": list(tensors[name].shape)} for name in STATE_TENSORS}
        data = b"".join(safetensors_buffers(stored, {"compression": "zstd", "encoded": json.dumps(encoded)}))
        store.write_bytes(f"{folder}/{part['file']}", data)
        parts.append({"file": part["file"], "num_samples": part["num_samples"], "num_tokens": part["num_tokens"],
                      "bytes": len(data), "sha256": sha256_hex(data)})
    store.write_json(artifact_path("hidden_states", 0), {**index, "format": "eagle3-hidden-states/3",
                                                         "compression": "zstd", "parts": parts})
    got = list(read_hidden_state_shard(store, artifact_path("hidden_states", 0)))
    assert [s.id for s in got] == [s.id for s in expected]
    for a, b in zip(got, expected, strict=True):
        assert all(torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8))
                   for name in STATE_TENSORS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/README.md: the GPU phase)")
@pytest.mark.parametrize("compression", ["none", "fp8"])
def test_a_shard_extracted_on_a_gpu_is_the_host_shard_its_copies_crossing_beside_the_next_forward(
        model_dir: str, tmp_path: Path, compression: str) -> None:
    """On a GPU each batch's states cross to pinned host memory on a copy stream of their own while the next
    forward runs; the shard must read back as the one extracted on the host."""
    from tasks.hidden_states.transformers_backend import launch_batch

    gpu = load_target_model(model_dir, "bfloat16", "cuda")
    crossing = launch_batch(gpu, AUX, [torch.arange(9)], fp8=compression == "fp8")
    assert crossing.crossing
    assert all(not tensor.is_cuda for tensor in crossing.rows()[0] if isinstance(tensor, torch.Tensor))
    _, on_gpu = extract_with(RunStore(str(tmp_path), "gpu"), gpu, compression)
    _, on_host = extract_with(RunStore(str(tmp_path), "host"), load_target_model(model_dir, "bfloat16", "cpu"),
                              compression)
    assert [sample.id for sample in on_gpu] == [sample.id for sample in on_host]
    for a, b in zip(on_gpu, on_host, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        for name in STATE_TENSORS:  # bf16 kernels differ between devices, not the states' layout
            cosine = torch.nn.functional.cosine_similarity(getattr(a, name).float(), getattr(b, name).float(), -1)
            assert cosine.min() > 0.99, (a.id, name)


def test_the_run_report_says_what_fp8_cost_over_its_shards() -> None:
    stats = [{"rows": 400, "min": 0.9981, "p1": 0.9993, "p50": 0.9997, "mean": 0.9996, "under_0.999": 3},
             {"rows": 800, "min": 0.9994, "p1": 0.9995, "p50": 0.9996, "mean": 0.9996, "under_0.999": 0}]
    prompts = StageStatus("done", {"records": 4})
    shards = {f"shard-{i:05d}": ShardStatus(prompts, hidden_states=StageStatus("done", {"fp8_cosine": stat}))
              for i, stat in enumerate(stats)}
    assert fp8_fidelity(shards) == "min 0.9981, p1 0.9993, p50 0.9996 (lowest shard); 3 of 1200 rows under 0.999"
    zstd = ShardStatus(prompts, hidden_states=StageStatus("done", {"compression": "zstd"}))
    assert fp8_fidelity({"shard-00000": zstd, "shard-00001": ShardStatus(prompts)}) is None


def test_a_shard_of_the_format_before_compression_is_refused_by_name(bf16: TargetModel, store: RunStore) -> None:
    """Its parts have no compression in their metadata: refused with the fix rather than guessed at."""
    extract_with(store, bf16, "none")
    index_rel = artifact_path("hidden_states", 0)
    store.write_json(index_rel, {**store.read_json(index_rel), "format": "eagle3-hidden-states/2"})
    with pytest.raises(HiddenStatesError, match=r"is 'eagle3-hidden-states/2' with its final state 'before_norm', "
                                                r"this version reads 'eagle3-hidden-states/3', "
                                                r"'eagle3-hidden-states/4' and 'eagle3-hidden-states/5' "
                                                r"\(before_norm\): run hidden_states again"):
        list(read_hidden_state_shard(store, index_rel))


OLDER_CHECKSUMS = {
    "eagle3-hidden-states/3": lambda data: {"sha256": sha256_hex(data)},
    "eagle3-hidden-states/4": lambda data: {"sha256_blocks": {"block_bytes": 1000,
                                                              "digest": blocks_sha256_hex(data, block_bytes=1000)}},
}


@pytest.mark.parametrize("old_format", OLDER_CHECKSUMS)
def test_a_shard_of_a_format_with_an_older_part_checksum_stays_readable(old_format: str, bf16: TargetModel,
                                                                         store: RunStore) -> None:
    """/3 parts were checked by one sha256 each, /4 parts by their blocks' sha256s: a run written then reads (and
    refuses a changed byte) as it did."""
    extract_with(store, bf16, "none")
    index_rel = artifact_path("hidden_states", 0)
    now = store.read_json(index_rel)
    assert all(set(part) & {"blake3", "sha256", "sha256_blocks"} == {"blake3"} for part in now["parts"])
    parts = [{**{key: value for key, value in part.items() if key != "blake3"},
              **OLDER_CHECKSUMS[old_format](store.read_bytes(f"hidden_states/shard-00000/{part['file']}"))}
             for part in now["parts"]]
    part_rel = f"hidden_states/shard-00000/{parts[-1]['file']}"
    data = store.read_bytes(part_rel)
    store.write_json(index_rel, {**now, "format": old_format, "parts": parts})
    assert [s.id for s in read_hidden_state_shard(store, index_rel)] == sorted(now["samples"], key=now["samples"].get)
    store.write_bytes(part_rel, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(HiddenStatesError, match="does not match its checksum"):
        list(read_hidden_state_shard(store, index_rel))


def test_a_block_checksum_follows_the_bytes_not_the_buffers_they_were_written_as() -> None:
    data = bytes(range(256)) * 41
    whole = blocks_sha256_hex(data, block_bytes=1000)
    assert blocks_sha256_hex(data[:7], data[7:2500], data[2500:], block_bytes=1000) == whole
    assert blocks_sha256_hex(data[:-1] + b"\x00", block_bytes=1000) != whole
    assert blocks_sha256_hex(data, block_bytes=2000) != whole, "the block size is part of the checksum"
    assert blocks_sha256_hex(b"abc", block_bytes=1000) == sha256_hex(bytes.fromhex(sha256_hex(b"abc"))), \
        "one block: sha256 of sha256"


def test_fp8_on_a_torch_without_float8_is_one_line_naming_the_fix() -> None:
    old_torch = SimpleNamespace(__version__="2.0.1")
    fix = r"hidden_states\.compression: fp8 needs .* torch 2\.0\.1 .* use compression zstd"
    with pytest.raises(ConfigurationError, match=fix) as error:
        check_compression("fp8", old_torch)
    assert "\n" not in str(error.value)
    check_compression("zstd", old_torch)
    check_compression("fp8")  # this torch has float8


def test_an_unknown_compression_is_one_config_line() -> None:
    tree = {"run_name": "r", "data": {"source": "d.jsonl"},
            "model": {"name": "m", "profile": "qwen3", "tokenizer": "t"}, "hidden_states": {"compression": "gzip"}}
    with pytest.raises(ConfigurationError) as error:
        parse_config(tree)
    assert str(error.value) == "config key hidden_states.compression: Input should be 'none', 'zstd' or 'fp8'"


def test_changing_the_compression_changes_the_cache_key() -> None:
    """A cached shard of another compression must not be handed on as if it were this one."""
    def extraction(compression: str) -> ExtractionSettings:
        return ExtractionSettings(HiddenStatesConfig(compression=compression), "target", "fp", False)

    sequences = ShardRef("sequences", 0, "sequences/shard-00000.parquet", 2, "a" * 64)
    key = {compression: HIDDEN_STATES.key(sequences=sequences, extraction=extraction(compression))
           for compression in ("none", "zstd", "fp8")}
    assert len(set(key.values())) == 3
