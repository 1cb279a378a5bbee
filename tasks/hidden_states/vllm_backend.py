"""The vllm backend: an extraction server runs the target; its connector's files are read, checked and removed.

One token-id prompt per sequence with max_tokens=1; the server (vLLM with the `extract_hidden_states`
speculative method and a hidden-states KV connector, see infra/vllm-gpu/) writes the states to a file on a
shared path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.hidden_state_format import HiddenStatesError, Sample, check_finite, torch_dtype
from eagle3_datagen.storage import RunStore
from tasks.hidden_states.parts import TokenSequence, write_shard
from tasks.hidden_states.targets import TargetInfo

# The final norm's weight in a checkpoint: `model.norm.weight`, or under `language_model.` in multimodal
# checkpoints such as Kimi-K2.5's.
_FINAL_NORM_KEY = re.compile(r"^(?:language_model\.)?model\.norm\.weight$")


@dataclass(frozen=True)
class ServedTarget(TargetInfo):
    """A target that a vLLM server runs: only its config and final norm are read here, never its weights."""

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
        connector["kv_connector_module_path"] = "eagle3_hidden_states_connector"
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
        raise ConfigurationError(
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

def extract_shard_vllm(
    store: RunStore, sequences_ref: ShardRef, target: ServedTarget, settings: HiddenStatesConfig, stage_key: str = ""
) -> dict[str, Any]:
    """Stage 6 for one shard with the vllm backend (settings.endpoint), without Prefect; returns the index."""
    limits = httpx.Limits(max_connections=settings.max_in_flight)
    with httpx.Client(base_url=str(settings.endpoint), timeout=settings.request_timeout_s, limits=limits) as client:

        def samples(sequences: list[TokenSequence], aux_layers: list[int]) -> Generator[Sample, None, None]:
            if shown := next((seq for seq in sequences if seq.images), None):
                raise HiddenStatesError(
                    f"sample {shown.id!r} shows images, which the vllm backend does not send yet: use "
                    "hidden_states.backend: transformers for image prompts")
            return served_samples(client, sequences, target, aux_layers, settings)

        return write_shard(store, sequences_ref, target, settings, samples, stage_key)

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
    dtype = torch_dtype(settings.dtype)
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
    check_finite(states[None], [seq.id])
    # [T, 3, H] -> [T, 3H], the layers side by side in order: copied here, beside the previous part's upload,
    # rather than by the part's encoding on the writing thread, just before its own
    aux = states[:, :-1].reshape(len(input_ids), -1).contiguous()
    return Sample(seq.id, seq.input_ids, seq.loss_mask, aux, states[:, -1].contiguous())
