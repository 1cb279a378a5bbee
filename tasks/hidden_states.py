"""Stage 6: the target model's hidden states for every training sequence.

Two backends write the same output. `transformers` loads the target in this process and hooks its layers. `vllm`
asks an extraction server (vLLM with the `extract_hidden_states` speculative method and a hidden-states KV connector,
see infra/vllm-gpu/) for targets too large for one process: one token-id prompt per sequence with max_tokens=1, and
the server writes the states to a file on a shared path that this process reads, checks, packs and removes.

Layer ids: "input to layer i" (EAGLE reference, vLLM's `eagle_aux_hidden_state_layer_ids`, speculators) equals
transformers' `hidden_states[i]` (0 = embeddings); SpecForge/Model-Optimizer name the same tensor "output of layer
i-1". The index and every part record both. The final state is the last layer's output BEFORE the final norm, for
both backends (vLLM's id N, the input of transformers' `model.norm`): speculators trains on it, and the norm's weight
and eps are kept beside it so the after-norm state SpecForge trains on is exact too (`final_rms_norm`). The reverse
is impossible: the norm discards each token's scale.

Output per shard, under `hidden_states/shard-NNNNN/`:
  part-NNNNN.safetensors  input_ids [T] int32, loss_mask [T] uint8, aux_hidden_states [T, 3H] (the three aux
                          layers concatenated in order), final_hidden_states [T, H] (before the final norm),
                          offsets [n+1] int64 (sample k is rows offsets[k]:offsets[k+1]); metadata names ids and
                          layers.
  final_norm.safetensors  the final RMSNorm's weight [H]; its eps in the metadata and the index.
  index.json              parts with checksums, sample id -> [part, row], layer ids in both conventions, model
                          fingerprint. Written last: its presence means the shard is complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import posixpath
import re
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from prefect import task
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from transformers import AutoConfig, AutoModelForCausalLM

from eagle3_datagen.artifacts import ShardRef, artifact_path, sha256_hex, shard_name
from eagle3_datagen.caching import STAGE_CACHE
from eagle3_datagen.config import ConfigError, HiddenStatesConfig
from eagle3_datagen.errors import UserError
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.storage import RunStore

FORMAT = "eagle3-hidden-states/2"
FINAL_STATE = "before_norm"
FINAL_NORM_FILE = "final_norm.safetensors"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_PART_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states")
# The final norm's weight in a checkpoint: `model.norm.weight`, or under `language_model.` in multimodal
# checkpoints such as Kimi-K2.5's.
_FINAL_NORM_KEY = re.compile(r"^(?:language_model\.)?model\.norm\.weight$")


class HiddenStatesError(UserError):
    """Hidden states that must not reach a trainer: non-finite values, wrong shapes, corrupted parts."""


@dataclass(frozen=True)
class TokenSequence:
    """One row of the sequences stage: what the target reads and what the trainer supervises."""

    id: str
    input_ids: torch.Tensor  # [t] int32
    loss_mask: torch.Tensor  # [t] uint8


@dataclass(frozen=True)
class Sample:
    """One sequence's training features, padding removed."""

    id: str
    input_ids: torch.Tensor  # [t] int32
    loss_mask: torch.Tensor  # [t] uint8
    aux_hidden_states: torch.Tensor  # [t, 3H], model dtype
    final_hidden_states: torch.Tensor  # [t, H], before the final norm

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in _PART_TENSORS)


@dataclass(frozen=True)
class TargetInfo:
    """What every backend knows of the target: the shapes to check states against, and what the index records."""

    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    fingerprint: str
    norm_weight: torch.Tensor  # [H], the final RMSNorm's scale
    norm_eps: float


@dataclass(frozen=True)
class TargetModel(TargetInfo):
    """The target's base model (decoder layers + final norm, no lm_head: logits are never needed here)."""

    base: torch.nn.Module
    dtype: torch.dtype


@dataclass(frozen=True)
class ServedTarget(TargetInfo):
    """A target that a vLLM server runs: only its config and final norm are read here, never its weights."""


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features as input-to-layer ids (= transformers' hidden_states index)."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layers(configured: Sequence[int] | None, num_layers: int) -> list[int]:
    """The configured ids, or the default, refused unless they are three increasing inputs of real layers.

    Id 0 is the embedding output and id N would be after the final norm (the final state), so 1..N-1.
    """
    layers = list(configured) if configured is not None else default_aux_layers(num_layers)
    if len(layers) == 3 and layers == sorted(set(layers)) and all(1 <= i < num_layers for i in layers):
        return layers
    what = f"{layers} is invalid" if configured is not None else f"the default {layers} does not fit"
    raise ConfigError(
        f"config key hidden_states.aux_layers: {what}; give 3 increasing input-to-layer ids in "
        f"1..{num_layers - 1} (the valid range for this {num_layers}-layer target)"
    )


def target_num_layers(path: str) -> int:
    """Decoder layer count from the config alone, to validate aux layers before loading any weights."""
    return AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers


@lru_cache(maxsize=1)
def load_target_model(path: str, dtype: str, device_map: str) -> TargetModel:
    """Load once per process (a run has many shards); one entry, so a new target replaces the old in memory."""
    # "cpu" is where from_pretrained loads anyway; any device_map at all would make accelerate a requirement.
    placement = {} if device_map == "cpu" else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], **placement).eval()
    base = model.get_decoder()
    if not (hasattr(base, "layers") and hasattr(base, "norm")):
        raise HiddenStatesError(f"{path}: {type(base).__name__} has no .layers/.norm to hook; unsupported model")
    config = model.config.get_text_config()
    eps = getattr(base.norm, "variance_epsilon", getattr(base.norm, "eps", None))
    if eps is None:
        raise HiddenStatesError(f"{path}: {type(base.norm).__name__} has no eps: not an RMSNorm final_rms_norm redoes")
    return TargetModel(
        path=path,
        base=base,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=base.get_input_embeddings().num_embeddings,
        dtype=_DTYPES[dtype],
        fingerprint=fingerprint(path),
        norm_weight=base.norm.weight.detach().to("cpu", copy=True),
        norm_eps=float(eps),
    )


def vllm_layer_ids(aux_layers: Sequence[int], num_layers: int) -> list[int]:
    """The server's `eagle_aux_hidden_state_layer_ids`: the aux ids (same convention) plus N, the pre-norm final."""
    return [*aux_layers, num_layers]


def vllm_extraction_args(
    aux_layers: Sequence[int], num_layers: int, shared_storage_path: str, cpu_connector: bool = False
) -> list[str]:
    """The `vllm serve` flags of an extraction server for this backend (infra/vllm-gpu/ has them for a GPU host).

    Prefix caching and chunked prefill off: either one gives a request states for only part of its prompt.
    `cpu_connector` loads this repo's synchronous connector (repo root on the server's PYTHONPATH) in place of
    vLLM's stock one, which needs CUDA streams and pinned memory.
    """
    layers = {"eagle_aux_hidden_state_layer_ids": vllm_layer_ids(aux_layers, num_layers)}
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": layers},
    }
    connector: dict[str, Any] = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": shared_storage_path},
    }
    if cpu_connector:
        connector["kv_connector"] = "CPUHiddenStatesConnector"
        connector["kv_connector_module_path"] = "eagle3_datagen.vllm_cpu_hidden_states_connector"
    return [
        *("--speculative-config", json.dumps(speculative)),
        *("--kv-transfer-config", json.dumps(connector)),
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
    ]


@lru_cache(maxsize=1)
def load_served_target(path: str) -> ServedTarget:
    """Config and final-norm weight of a local checkpoint folder (a 1 T-parameter one too: one small tensor is read)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"config key hidden_states.model: {path} is not a local model folder; the vllm backend reads the "
            "target's config and final-norm weight from its checkpoint"
        )
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    if str(text.get("model_type", "")).startswith("gemma"):
        raise HiddenStatesError(f"{path}: Gemma's final norm scales by (1 + weight); final_rms_norm does not")
    return ServedTarget(
        path=path,
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        fingerprint=fingerprint(path),
        norm_weight=_final_norm_weight(folder),
        norm_eps=float(text["rms_norm_eps"]),
    )


def _final_norm_weight(folder: Path) -> torch.Tensor:
    """The one tensor named like a final norm, found through the sharded index or the safetensors headers."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    else:
        files = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as handle:
                files.update(dict.fromkeys(handle.keys(), file.name))
    keys = [key for key in files if _FINAL_NORM_KEY.match(key)]
    if len(keys) != 1:
        raise HiddenStatesError(f"{folder}: expected one final-norm weight ({_FINAL_NORM_KEY.pattern}), found {keys}")
    with safe_open(folder / files[keys[0]], "pt") as handle:
        return handle.get_tensor(keys[0])


def final_rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm, computed as transformers does (fp32 statistics, scale in the states' dtype).

    Why: the stored final state is before the norm (what vLLM captures and speculators trains on); SpecForge
    trains on the state after it, which `lm_head` reads. Extraction checks this against the model's own norm.
    """
    hidden = states.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(states.dtype) * hidden.to(states.dtype)


def plan_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence positions so batch_size x longest stays within max_tokens; one too long runs alone.

    Longest first: similar lengths waste little padding, and an out-of-memory shows on the first batch.
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


_FORWARD_LOCK = threading.Lock()


def capture_batch(
    target: TargetModel, aux_layers: Sequence[int], sequences: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward pass over a right-padded batch; per sequence (aux [t, 3H], final [t, H]) on CPU, unpadded.

    Hooks keep only the needed states: output_hidden_states would hold all N+1 of them for the whole batch.
    """
    base = target.base
    longest = max(len(seq) for seq in sequences)
    input_ids = torch.zeros((len(sequences), longest), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1

    captured: dict[int, torch.Tensor] = {}

    def keep_input(layer_id: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    normed: list[torch.Tensor] = []
    device = base.get_input_embeddings().weight.device
    with _FORWARD_LOCK:  # shards run in threads over one cached model: one set of hooks at a time
        handles = [base.layers[i].register_forward_pre_hook(keep_input(i), with_kwargs=True) for i in aux_layers]
        handles.append(base.norm.register_forward_pre_hook(keep_input(target.num_layers), with_kwargs=True))
        handles.append(base.norm.register_forward_hook(lambda module, args, output: normed.append(output)))
        try:
            with torch.inference_mode():
                base(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()

    expected = (len(sequences), longest, target.hidden_size)
    for layer_id, states in captured.items():
        if tuple(states.shape) != expected or states.dtype != target.dtype:
            raise HiddenStatesError(
                f"layer {layer_id} state is {tuple(states.shape)} {states.dtype}, expected {expected} "
                f"{target.dtype} from the model config"
            )
    final = captured[target.num_layers]
    _check_final_norm(final, normed[0], base.norm.weight, target.norm_eps)
    return [
        (
            torch.cat([captured[i][row, : len(seq)].cpu() for i in aux_layers], dim=-1),
            final[row, : len(seq)].to("cpu", copy=True),
        )
        for row, seq in enumerate(sequences)
    ]


def _check_final_norm(before: torch.Tensor, after: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """The stored before-norm state must give the model's own after-norm state, or a SpecForge export would be off."""
    try:
        torch.testing.assert_close(final_rms_norm(before, weight, eps), after, equal_nan=True)  # NaN: named later
    except AssertionError:
        raise HiddenStatesError(
            "the target's final norm is not the plain RMSNorm (weight * x / rms(x)) that final_rms_norm redoes for "
            "the after-norm export; this model needs its own norm there"
        ) from None


def read_sequences(store: RunStore, rel: str, vocab_size: int) -> list[TokenSequence]:
    """The sequences shard, checked for what would break a forward pass or the index (ids, lengths, vocab)."""
    with store.open(rel, "rb") as handle:
        table = pq.read_table(handle, columns=["id", "input_ids", "loss_mask"])
    ids = table.column("id").to_pylist()
    input_ids = _list_column(table.column("input_ids"), torch.int32)
    loss_masks = _list_column(table.column("loss_mask"), torch.uint8)
    sequences: list[TokenSequence] = []
    seen: set[str] = set()
    for sample_id, tokens, mask in zip(ids, input_ids, loss_masks, strict=True):
        if sample_id in seen:
            raise HiddenStatesError(f"{rel}: sample id {sample_id!r} appears twice")
        if len(tokens) == 0 or len(tokens) != len(mask):
            raise HiddenStatesError(f"{rel}: sample {sample_id!r} has {len(tokens)} tokens, {len(mask)} mask values")
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
            raise HiddenStatesError(
                f"{rel}: sample {sample_id!r} has token ids outside the target's vocabulary of {vocab_size}"
                " (tokenized for another model?)"
            )
        seen.add(sample_id)
        sequences.append(TokenSequence(sample_id, tokens, mask))
    return sequences


def _list_column(column: pa.ChunkedArray, dtype: torch.dtype) -> list[torch.Tensor]:
    """A list<int> column as one tensor per row, without a Python int per token."""
    array = column.combine_chunks()
    lengths = array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).tolist()
    flat = torch.tensor(array.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    return list(torch.split(flat, lengths))


class _PartWriter:
    """Buffers samples and writes a part as soon as it holds part_size_bytes, so a shard never sits in memory."""

    def __init__(self, store: RunStore, folder: str, part_size_bytes: int, metadata: dict[str, str]) -> None:
        self.store, self.folder, self.part_size_bytes, self.metadata = store, folder, part_size_bytes, metadata
        self.parts: list[dict[str, Any]] = []
        self.rows: dict[str, list[int]] = {}
        self._pending: list[Sample] = []
        self._pending_bytes = 0

    def add(self, sample: Sample) -> None:
        for name in ("aux_hidden_states", "final_hidden_states"):
            if not torch.isfinite(getattr(sample, name)).all():
                raise HiddenStatesError(f"sample {sample.id!r}: {name} has NaN or Inf values")
        self._pending.append(sample)
        self._pending_bytes += sample.nbytes
        if self._pending_bytes >= self.part_size_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        samples, self._pending, self._pending_bytes = self._pending, [], 0
        ids = [sample.id for sample in samples]
        lengths = [len(sample.input_ids) for sample in samples]
        tensors = {name: torch.cat([getattr(sample, name) for sample in samples]) for name in _PART_TENSORS}
        del samples
        tensors["offsets"] = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
        data = save_safetensors(tensors, metadata={**self.metadata, "sample_ids": json.dumps(ids)})
        del tensors
        name = f"part-{len(self.parts):05d}.safetensors"
        self.store.write_bytes(posixpath.join(self.folder, name), data)
        for row, sample_id in enumerate(ids):
            self.rows[sample_id] = [len(self.parts), row]
        part = {"file": name, "num_samples": len(ids), "num_tokens": sum(lengths)}
        self.parts.append({**part, "bytes": len(data), "sha256": sha256_hex(data)})


def extract_shard(
    store: RunStore, shard_index: int, target: TargetModel, settings: HiddenStatesConfig
) -> dict[str, Any]:
    """Stage 6 for one shard with the transformers backend, without Prefect; returns the index."""

    def samples(sequences: list[TokenSequence], aux_layers: list[int]) -> Generator[Sample, None, None]:
        for batch in plan_batches([len(seq.input_ids) for seq in sequences], settings.max_tokens_per_batch):
            states = capture_batch(target, aux_layers, [sequences[i].input_ids for i in batch])
            for i, (aux, final) in zip(batch, states, strict=True):
                seq = sequences[i]
                yield Sample(seq.id, seq.input_ids, seq.loss_mask, aux, final)

    return _write_shard(store, shard_index, target, settings, samples)


def extract_shard_vllm(
    store: RunStore, shard_index: int, target: ServedTarget, settings: HiddenStatesConfig
) -> dict[str, Any]:
    """Stage 6 for one shard with the vllm backend (settings.endpoint), without Prefect; returns the index."""
    limits = httpx.Limits(max_connections=settings.max_in_flight)
    with httpx.Client(base_url=str(settings.endpoint), timeout=settings.request_timeout_s, limits=limits) as client:

        def samples(sequences: list[TokenSequence], aux_layers: list[int]) -> Generator[Sample, None, None]:
            return served_samples(client, sequences, target, aux_layers, settings)

        return _write_shard(store, shard_index, target, settings, samples)


def _write_shard(
    store: RunStore,
    shard_index: int,
    target: TargetInfo,
    settings: HiddenStatesConfig,
    samples: Callable[[list[TokenSequence], list[int]], Generator[Sample, None, None]],
) -> dict[str, Any]:
    """What both backends share: read the sequences, pack `samples(sequences, aux_layers)` into parts as they come,
    then write the index.
    """
    aux_layers = resolve_aux_layers(settings.aux_layers, target.num_layers)
    sequences = read_sequences(store, artifact_path("sequences", shard_index), target.vocab_size)
    folder = f"hidden_states/{shard_name(shard_index)}"
    store.remove(folder)  # the old index goes first: a crash below must not leave it vouching for new parts
    layer_ids = {"input_to_layer": aux_layers, "output_of_layer": [i - 1 for i in aux_layers]}
    writer = _PartWriter(
        store,
        folder,
        settings.part_size_bytes,
        {"format": FORMAT, "aux_layers": json.dumps(layer_ids), "final_state": FINAL_STATE},
    )
    with contextlib.closing(samples(sequences, aux_layers)) as stream:  # closed now, also when add() raises
        for sample in stream:
            writer.add(sample)
    writer.flush()
    norm_file = save_safetensors({"weight": target.norm_weight.contiguous()}, metadata={"eps": repr(target.norm_eps)})
    store.write_bytes(posixpath.join(folder, FINAL_NORM_FILE), norm_file)
    index = {
        "format": FORMAT,
        "shard": shard_index,
        "backend": settings.backend,
        "num_samples": len(writer.rows),
        "num_tokens": sum(part["num_tokens"] for part in writer.parts),
        "hidden_size": target.hidden_size,
        "num_layers": target.num_layers,
        "dtype": settings.dtype,
        "aux_layers": layer_ids,
        "final_state": FINAL_STATE,
        "final_norm": {"file": FINAL_NORM_FILE, "eps": target.norm_eps, "sha256": sha256_hex(norm_file)},
        "model": {"path": target.path, "fingerprint": target.fingerprint},
        "parts": writer.parts,
        "samples": writer.rows,
    }
    store.write_json(artifact_path("hidden_states", shard_index), index)
    return index


def served_samples(
    client: httpx.Client,
    sequences: Sequence[TokenSequence],
    target: ServedTarget,
    aux_layers: Sequence[int],
    settings: HiddenStatesConfig,
) -> Generator[Sample, None, None]:
    """Samples in sequence order from the extraction server, max_in_flight requests at a time.

    Each file is removed once read; on an error or an early close the files of requests already sent are
    waited for and removed too, so a failed shard leaves nothing on the shared path.
    """
    dtype = _DTYPES[settings.dtype]
    pending: deque[tuple[TokenSequence, Future[str]]] = deque()
    with ThreadPoolExecutor(settings.max_in_flight, thread_name_prefix="hidden-states") as pool:
        try:
            for seq in sequences:
                pending.append((seq, pool.submit(request_state_file, client, seq)))
                if len(pending) >= settings.max_in_flight:
                    yield _take_sample(*pending.popleft(), target, aux_layers, dtype, settings.shared_path)
            while pending:
                yield _take_sample(*pending.popleft(), target, aux_layers, dtype, settings.shared_path)
        finally:
            for _seq, future in pending:
                if not future.cancel() and future.exception() is None:
                    with contextlib.suppress(HiddenStatesError):
                        take_state_file(future.result(), settings.shared_path)


def _take_sample(
    seq: TokenSequence,
    future: Future[str],
    target: ServedTarget,
    aux_layers: Sequence[int],
    dtype: torch.dtype,
    shared_path: str | None,
) -> Sample:
    """Wait for the request, then read, remove and check its file."""
    return served_sample(seq, take_state_file(future.result(), shared_path), target, aux_layers, dtype)


def request_state_file(client: httpx.Client, seq: TokenSequence) -> str:
    """One prefill of the sequence's token ids on the extraction server; the path of the file it wrote."""
    try:
        response = client.post("/v1/completions", json={"prompt": seq.input_ids.tolist(), "max_tokens": 1})
    except httpx.TransportError as error:
        raise HiddenStatesError(f"sample {seq.id!r}: extraction server {client.base_url}: {error!r}") from None
    if response.status_code != 200:
        raise HiddenStatesError(
            f"sample {seq.id!r}: extraction server {client.base_url} answered {response.status_code}: "
            f"{response.text[:300]}"
        )
    path = (response.json().get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise HiddenStatesError(
            f"extraction server {client.base_url} names no kv_transfer_params.hidden_states_path: start it with the "
            "extract_hidden_states speculative config and a hidden-states KV connector (infra/vllm-gpu/README.md)"
        )
    return str(path)


def take_state_file(server_path: str, shared_path: str | None) -> dict[str, torch.Tensor]:
    """Read one request's file once the server has finished it, then remove it and its lock.

    The connector takes an exclusive flock on `<file>.lock` before the response leaves and writes the file
    afterwards; a shared flock waits for that write. `shared_path` maps the server's folder to this machine's.
    """
    local = Path(shared_path, PurePosixPath(server_path).name) if shared_path else Path(server_path)
    lock = local.with_name(f"{local.name}.lock")
    try:
        with lock.open("rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            return load_file(local)
    except FileNotFoundError:
        raise HiddenStatesError(
            f"{local} (the server's {server_path}) or its .lock is missing: set hidden_states.shared_path to where "
            "this machine sees the server's shared_storage_path, and keep the connector's synchronization lock on"
        ) from None
    finally:
        local.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)


def served_sample(
    seq: TokenSequence,
    tensors: dict[str, torch.Tensor],
    target: ServedTarget,
    aux_layers: Sequence[int],
    dtype: torch.dtype,
) -> Sample:
    """One connector file as a Sample: token ids checked against the input, shapes and dtype against the config."""
    token_ids, states = tensors["token_ids"].to(torch.int64), tensors["hidden_states"]
    input_ids = seq.input_ids.to(torch.int64)
    if not torch.equal(token_ids, input_ids):
        where = (
            f"{len(token_ids)} tokens for a sequence of {len(input_ids)}"
            if len(token_ids) != len(input_ids)
            else f"token {int((token_ids != input_ids).nonzero()[0])} differs"
        )
        raise HiddenStatesError(
            f"sample {seq.id!r}: the server's hidden states are not for its input ids ({where}); start the "
            "extraction server with prefix caching and chunked prefill off"
        )
    layer_ids = vllm_layer_ids(aux_layers, target.num_layers)
    expected = (len(input_ids), len(layer_ids), target.hidden_size)
    if tuple(states.shape) != expected or states.dtype != dtype:
        raise HiddenStatesError(
            f"sample {seq.id!r}: the server's hidden states are {tuple(states.shape)} {states.dtype}, expected "
            f"{expected} {dtype}: start it with --dtype {str(dtype).removeprefix('torch.')} and "
            f"eagle_aux_hidden_state_layer_ids {layer_ids}"
        )
    aux = states[:, :-1].reshape(len(input_ids), -1)  # [T, 3, H] -> [T, 3H]: the layers side by side, in order
    return Sample(seq.id, seq.input_ids, seq.loss_mask, aux, states[:, -1].contiguous())


def read_hidden_state_shard(store: RunStore, index_rel: str) -> Iterator[Sample]:
    """Every sample of a finished shard, part by part, each part checked against the index's size and sha256."""
    index = store.read_json(index_rel)
    folder = posixpath.dirname(index_rel)
    ids_by_part: dict[int, list[str]] = {}
    for sample_id, (part, _row) in sorted(index["samples"].items(), key=lambda item: item[1]):
        ids_by_part.setdefault(part, []).append(sample_id)
    for part_number, part in enumerate(index["parts"]):
        rel = posixpath.join(folder, part["file"])
        data = store.read_bytes(rel)
        if len(data) != part["bytes"] or sha256_hex(data) != part["sha256"]:
            raise HiddenStatesError(f"{rel} does not match its checksum in {index_rel}: re-run hidden_states")
        tensors = load_safetensors(data)
        offsets = tensors["offsets"].tolist()
        ids = ids_by_part.get(part_number, [])
        if len(offsets) != len(ids) + 1 or offsets[0] != 0 or offsets[-1] != part["num_tokens"]:
            raise HiddenStatesError(f"{rel}: offsets do not match the {len(ids)} samples listed in {index_rel}")
        for sample_id, start, end in zip(ids, offsets[:-1], offsets[1:], strict=True):
            yield Sample(sample_id, *(tensors[name][start:end] for name in _PART_TENSORS))


def read_final_norm(store: RunStore, index_rel: str) -> tuple[torch.Tensor, float]:
    """The final norm's weight and eps stored beside a shard's parts, checked against the index."""
    entry = store.read_json(index_rel).get("final_norm")
    rel = posixpath.join(posixpath.dirname(index_rel), entry["file"]) if entry else None
    if rel is None or not store.exists(rel):
        raise HiddenStatesError(f"{index_rel}: its final norm is missing (an older version?): re-run hidden_states")
    data = store.read_bytes(rel)
    if sha256_hex(data) != entry["sha256"]:
        raise HiddenStatesError(f"{rel} does not match its checksum in {index_rel}: re-run hidden_states")
    return load_safetensors(data)["weight"], float(entry["eps"])


@task(name="extract-hidden-states", retries=1, persist_result=True, cache_policy=STAGE_CACHE)
def extract_hidden_states(
    sequences: ShardRef,
    settings: HiddenStatesConfig,
    target_model: str,
    target_fingerprint: str,
    output_uri: str,
    run_name: str,
) -> ShardRef:
    """Prefect stage 6 for one shard; a transformers target stays loaded across the shards a process runs.

    `target_fingerprint` is part of the cache key: new weights at the same path extract again.
    """
    store = RunStore(output_uri, run_name)
    if settings.backend == "vllm":
        index = extract_shard_vllm(store, sequences.index, load_served_target(target_model), settings)
    elif settings.backend == "transformers":
        resolve_aux_layers(settings.aux_layers, target_num_layers(target_model))  # before loading any weights
        target = load_target_model(target_model, settings.dtype, settings.device_map)
        index = extract_shard(store, sequences.index, target, settings)
    else:
        raise ConfigError(f"config key hidden_states.backend: {settings.backend!r} extracts nothing")
    rel = artifact_path("hidden_states", sequences.index)
    return ShardRef(
        stage="hidden_states",
        index=sequences.index,
        path=rel,
        num_records=index["num_samples"],
        sha256=sha256_hex(store.read_bytes(rel)),
    )
