"""Stage 6's vllm backend: the file protocol against a fake server, then a real vLLM CPU extraction server compared
with the transformers backend on the tiny model.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from hidden_state_targets import AUX, HIDDEN, LAYERS, random_qwen3, write_sequences
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from cli.demo import demo_questions
from eagle3_datagen.artifacts import artifact_path
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.hidden_state_format import (
    HiddenStatesError,
    final_rms_norm,
    read_final_norm,
    read_hidden_state_shard,
)
from eagle3_datagen.storage import RunLocation, RunStore
from eagle3_datagen.testing.vllm_server import VLLM_CPU_DIR, LocalVLLMServer
from tasks.hidden_states import ExtractionSettings, extract_hidden_states
from tasks.hidden_states.parts import TokenSequence
from tasks.hidden_states.transformers_backend import extract_shard, load_target_model
from tasks.hidden_states.vllm_backend import ServedTarget, load_served_target, served_samples, vllm_extraction_args

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def served_target(tmp_path_factory: pytest.TempPathFactory) -> ServedTarget:
    """A random tiny Qwen3 saved in several shards, so the final norm is found through the sharded index."""
    model = random_qwen3()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("sharded-qwen3")
    model.save_pretrained(path, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file()
    return load_served_target(str(path))


def test_served_target_reads_shapes_and_the_final_norm_from_the_checkpoint(served_target: ServedTarget) -> None:
    model = Qwen3ForCausalLM.from_pretrained(served_target.path)
    assert (served_target.num_layers, served_target.hidden_size, served_target.vocab_size) == (LAYERS, HIDDEN, 512)
    torch.testing.assert_close(served_target.norm_weight, model.model.norm.weight.detach(), rtol=0, atol=0)
    assert served_target.norm_eps == model.config.rms_norm_eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_rms_norm_is_transformers_norm(served_target: ServedTarget, dtype: torch.dtype) -> None:
    norm = Qwen3RMSNorm(HIDDEN, eps=served_target.norm_eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(served_target.norm_weight)
    states = (torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(0)) * 30).to(dtype)
    with torch.no_grad():
        expected = norm(states)
    got = final_rms_norm(states, served_target.norm_weight, served_target.norm_eps)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_vllm_backend_needs_an_endpoint() -> None:
    with pytest.raises(ValueError, match=r"backend vllm needs hidden_states\.endpoint"):
        HiddenStatesConfig(backend="vllm")
    assert HiddenStatesConfig(backend="vllm", endpoint="http://gpu-0:8100/v1/").endpoint == "http://gpu-0:8100"


def test_served_target_refuses_a_hub_id() -> None:
    with pytest.raises(ConfigurationError, match=r"hidden_states\.model: org/model is not a local model folder"):
        load_served_target("org/model")


class FakeExtractionServer:
    """The connector's protocol without vLLM: each response names a file under a server-side folder whose lock is
    held exclusively until a timer writes the file, as vLLM writes it a step after answering.
    """

    def __init__(self, folder: Path, states: Callable[[list[int]], torch.Tensor], delay_s: float = 0.05) -> None:
        self.folder, self.states, self.delay_s = folder, states, delay_s
        self.token_ids: Callable[[list[int]], list[int]] = lambda ids: ids
        self.count = 0
        self._lock = threading.Lock()

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["max_tokens"] == 1 and all(isinstance(i, int) for i in body["prompt"])
        with self._lock:
            self.count += 1
            path = self.folder / f"cmpl-{self.count}.safetensors"
        lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        ids = body["prompt"]
        tensors = {"hidden_states": self.states(ids).contiguous(), "token_ids": torch.tensor(self.token_ids(ids))}

        def write() -> None:
            try:
                save_file(tensors, path)
            finally:
                os.close(lock_fd)

        threading.Timer(self.delay_s, write).start()
        return httpx.Response(200, json={"kv_transfer_params": {"hidden_states_path": f"/server/hs/{path.name}"}})


def fake_states(ids: list[int]) -> torch.Tensor:
    """[T, 4, H] whose values encode (token, layer), so a mixed-up row or layer shows."""
    tokens = torch.tensor(ids, dtype=torch.float32)[:, None, None]
    return tokens + torch.arange(4, dtype=torch.float32)[None, :, None] / 10 + torch.zeros(1, 1, HIDDEN)


def sequences_of(lengths: list[int]) -> list[TokenSequence]:
    return [
        TokenSequence(f"s{k}", torch.arange(100 * k, 100 * k + n, dtype=torch.int32), torch.ones(n, dtype=torch.uint8))
        for k, n in enumerate(lengths)
    ]


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeExtractionServer, httpx.Client, HiddenStatesConfig]]:
    folder = tmp_path / "shared"
    folder.mkdir()
    server = FakeExtractionServer(folder, fake_states)
    settings = HiddenStatesConfig(
        backend="vllm", endpoint="http://extract", dtype="float32", shared_path=str(folder), max_in_flight=3
    )
    with httpx.Client(base_url="http://extract", transport=httpx.MockTransport(server.handle)) as client:
        yield server, client, settings


def test_files_are_read_in_order_after_the_write_and_removed(
    fake: tuple[FakeExtractionServer, httpx.Client, HiddenStatesConfig], served_target: ServedTarget
) -> None:
    server, client, settings = fake
    sequences = sequences_of([5, 1, 12, 7, 3, 9, 2])
    samples = list(served_samples(client, sequences, served_target, AUX, settings))

    assert [s.id for s in samples] == [s.id for s in sequences]
    for seq, sample in zip(sequences, samples, strict=True):
        states = fake_states(seq.input_ids.tolist())
        torch.testing.assert_close(sample.aux_hidden_states, states[:, :3].reshape(len(seq.input_ids), 3 * HIDDEN))
        assert sample.aux_hidden_states[:, HIDDEN:2 * HIDDEN].equal(states[:, 1])  # layers side by side, in order
        assert sample.final_hidden_states.equal(states[:, 3])  # the server's pre-norm final state, as it came
        assert sample.input_ids is seq.input_ids and sample.loss_mask is seq.loss_mask
    assert list(server.folder.iterdir()) == []


def test_token_id_mismatch_is_a_clear_error_and_leaves_no_files(
    fake: tuple[FakeExtractionServer, httpx.Client, HiddenStatesConfig], served_target: ServedTarget
) -> None:
    server, client, settings = fake
    server.token_ids = lambda ids: ids[:-1] if ids[0] == 300 else ids  # states short by one token for s3
    with pytest.raises(HiddenStatesError, match=r"'s3'.*not for its input ids \(6 tokens for a sequence of 7\)"):
        list(served_samples(client, sequences_of([5, 1, 12, 7, 3, 9, 2, 4]), served_target, AUX, settings))
    assert list(server.folder.iterdir()) == []


def test_wrong_layer_count_or_dtype_names_the_server_flags(
    fake: tuple[FakeExtractionServer, httpx.Client, HiddenStatesConfig], served_target: ServedTarget
) -> None:
    server, client, settings = fake
    server.states = lambda ids: fake_states(ids)[:, :3]
    with pytest.raises(HiddenStatesError, match=r"eagle_aux_hidden_state_layer_ids \[2, 4, 5, 8\]"):
        list(served_samples(client, sequences_of([4]), served_target, AUX, settings))
    server.states = lambda ids: fake_states(ids).bfloat16()
    with pytest.raises(HiddenStatesError, match="--dtype float32"):
        list(served_samples(client, sequences_of([4]), served_target, AUX, settings))


def test_a_server_without_the_connector_is_named(served_target: ServedTarget) -> None:
    settings = HiddenStatesConfig(backend="vllm", endpoint="http://extract")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"choices": []}))
    with (
        httpx.Client(base_url="http://extract", transport=transport) as client,
        pytest.raises(HiddenStatesError, match=r"names no kv_transfer_params\.hidden_states_path"),
    ):
        list(served_samples(client, sequences_of([3]), served_target, AUX, settings))


# A real vLLM CPU extraction server (bf16) on the tiny model, compared with the transformers backend.


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hidden-states-shared")


@pytest.fixture(scope="module")
def extraction_server(tiny_model: Path, shared_dir: Path) -> Iterator[LocalVLLMServer]:
    args = vllm_extraction_args(AUX, LAYERS, str(shared_dir), cpu_connector=True)
    # LocalVLLMServer runs float32; the last --dtype wins. Without chunked prefill a batch must hold a whole prompt.
    args += ["--dtype", "bfloat16", "--max-num-batched-tokens", "2048"]
    server = LocalVLLMServer(tiny_model, "tiny-extract", reasoning_parser=None, extra_args=args)
    with pytest.MonkeyPatch.context() as env:  # the server imports the connector from this repo
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(VLLM_CPU_DIR), os.environ.get("PYTHONPATH")])))
        server.start()
    try:
        yield server
    finally:
        server.stop()


def conversations(model_dir: Path) -> list[list[int]]:
    """Token ids of 1 to 3 demo conversations in the tiny model's format, 1 to ~130 tokens.

    Text the model was trained on, not random ids: on random ids this model amplifies bf16 rounding so much that
    transformers' own bf16 and fp32 states differ (per-token cosine down to 0.99), whatever the backend.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [json.loads(line)["conversations"][0]["value"] for line in demo_questions().open()]
    reply = {"content": "The answer is short.", "reasoning_content": "This is a small question. I will answer."}
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", **reply}], tokenize=False)
        for q in questions
    ]
    texts = [rendered[0], rendered[1] + rendered[2], rendered[3], "".join(rendered[4:7]), rendered[7] + rendered[8]]
    return [tokenizer(text)["input_ids"] for text in texts] + [tokenizer(questions[9])["input_ids"][:1]]


def sequence_rows(ids: list[list[int]]) -> list[tuple[str, list[int], list[int]]]:
    """Rows of a sequences shard, the loss on the second half of each sequence."""
    return [(f"s{k}", t, [int(i >= len(t) // 2) for i in range(len(t))]) for k, t in enumerate(ids)]


def per_token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.mark.vllm
def test_vllm_backend_gives_the_transformers_tensors_in_bf16(
    extraction_server: LocalVLLMServer, tiny_model: Path, shared_dir: Path, tmp_path: Path
) -> None:
    ids = conversations(tiny_model)
    assert max(map(len, ids)) > 100 and min(map(len, ids)) == 1
    hf_store, vllm_store = RunStore(str(tmp_path), "hf"), RunStore(str(tmp_path), "vllm")
    hf_shard, sequences = (write_sequences(store, 0, sequence_rows(ids)) for store in (hf_store, vllm_store))
    hf_index = extract_shard(
        hf_store, hf_shard, load_target_model(str(tiny_model), "bfloat16", "cpu"), HiddenStatesConfig(dtype="bfloat16")
    )
    settings = HiddenStatesConfig(
        backend="vllm", endpoint=extraction_server.url, dtype="bfloat16", max_in_flight=4, part_size_bytes=20_000
    )
    ref = extract_hidden_states.fn(sequences, ExtractionSettings(settings, str(tiny_model), "fp", False),
                                   RunLocation(str(tmp_path), "vllm"))

    index = vllm_store.read_json(ref.path)
    assert ref.num_records == len(ids) and len(index["parts"]) > 1
    assert index["backend"] == "vllm" and index["final_state"] == hf_index["final_state"] == "before_norm"
    assert index["aux_layers"] == hf_index["aux_layers"] == {"input_to_layer": AUX, "output_of_layer": [1, 3, 4]}
    assert list(shared_dir.iterdir()) == [], "per-request files are removed once packed"
    assert read_final_norm(vllm_store, ref.path)[0].bfloat16().equal(read_final_norm(hf_store, ref.path)[0])

    hf = {s.id: s for s in read_hidden_state_shard(hf_store, artifact_path("hidden_states", 0))}
    served = {s.id: s for s in read_hidden_state_shard(vllm_store, ref.path)}
    assert sorted(served) == sorted(hf)
    neighbour_cosines = []
    for sample_id, sample in served.items():
        expected = hf[sample_id]
        assert sample.input_ids.equal(expected.input_ids) and sample.loss_mask.equal(expected.loss_mask)
        assert sample.aux_hidden_states.dtype == sample.final_hidden_states.dtype == torch.bfloat16
        for k in range(3):
            got = sample.aux_hidden_states[:, k * HIDDEN : (k + 1) * HIDDEN]
            assert per_token_cosine(got, expected.aux_hidden_states[:, k * HIDDEN : (k + 1) * HIDDEN]).min() >= 0.999
            if k < 2:
                neighbour = expected.aux_hidden_states[:, (k + 1) * HIDDEN : (k + 2) * HIDDEN]
                neighbour_cosines.append(per_token_cosine(got, neighbour).min())
        assert per_token_cosine(sample.final_hidden_states, expected.final_hidden_states).min() >= 0.999
    assert min(neighbour_cosines) < 0.99, "the layers differ enough that a wrong layer id would fail"
