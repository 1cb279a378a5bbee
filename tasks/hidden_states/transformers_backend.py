"""The transformers backend: the target loaded in this process, its layers hooked during one forward pass."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText

from eagle3_datagen.artifacts import ShardRef
from eagle3_datagen.config import HiddenStatesConfig
from eagle3_datagen.fingerprints import fingerprint
from eagle3_datagen.hidden_state_format import (
    Fp8States,
    HiddenStatesError,
    Sample,
    check_finite,
    final_rms_norm,
    quantize_fp8,
    torch_dtype,
)
from eagle3_datagen.images import image_path, name_matches
from eagle3_datagen.storage import RunStore
from tasks.hidden_states.batching import plan_batches
from tasks.hidden_states.parts import TokenSequence, write_shard
from tasks.hidden_states.targets import TargetInfo, remote_code_named


@dataclass(frozen=True)
class TargetModel(TargetInfo):
    """The target's base model (decoder layers + final norm, no lm_head: logits are never needed here)."""

    base: torch.nn.Module
    dtype: torch.dtype
    model: torch.nn.Module | None = None  # the whole vision-language model: what reads an image sample's pixels

_LOAD_LOCK = threading.Lock()
_loads = [0]


def load_target_model(path: str, dtype: str, device_map: str, trust_remote_code: bool = False) -> TargetModel:
    """Load once per process (a run has many shards); one entry, so a new target replaces the old in memory.

    Shards run in threads: the lock makes the others wait for the first load instead of each loading its own copy
    of the weights (a cache alone lets concurrent misses through).
    """
    with _LOAD_LOCK:
        return _cached_target_model(path, dtype, device_map, trust_remote_code)


def target_loads() -> int:
    """How many times this process has loaded a target: one per run, proven per shard in its worker record."""
    return _loads[0]


def fresh_target_model(path: str, dtype: str, device_map: str, trust_remote_code: bool = False) -> TargetModel:
    """A new copy of the target, loaded now (`load_target_model` shares one)."""
    _loads[0] += 1
    # "cpu" is where from_pretrained loads anyway; any device_map at all would make accelerate a requirement.
    placement = {} if device_map == "cpu" else {"device_map": device_map}
    with remote_code_named(path):
        whole = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        multimodal = getattr(whole, "vision_config", None) is not None  # loaded whole: its forward reads pixels
        loader = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        model = loader.from_pretrained(path, config=whole, dtype=torch_dtype(dtype),
                                       trust_remote_code=trust_remote_code, **placement).eval()
    base = decoder_stack(model, path)
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
        dtype=torch_dtype(dtype),
        fingerprint=fingerprint(path),
        norm_weight=base.norm.weight.detach().to("cpu", copy=True),
        norm_eps=float(eps),
        model=model if multimodal else None,
    )


def decoder_stack(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The module holding the decoder layers and final norm, also under a multimodal wrapper (Kimi-K2.5 nests
    its DeepSeek-V3 text model as `language_model`, whose decoder is `.model`)."""
    module = model
    for _ in range(4):
        if hasattr(module, "layers") and hasattr(module, "norm"):
            return module
        inner = module.get_decoder() if hasattr(module, "get_decoder") else None
        if inner is None or inner is module:
            inner = getattr(module, "language_model", None) or getattr(module, "model", None)
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    raise HiddenStatesError(f"{path}: {type(model).__name__} has no decoder with .layers/.norm to hook; unsupported")


_cached_target_model = lru_cache(maxsize=1)(fresh_target_model)
_FORWARD_LOCK = threading.Lock()


Rows = list[tuple[torch.Tensor | Fp8States, torch.Tensor | Fp8States]]


@dataclass
class HostStates:
    """A batch's states on their way to the host. From a GPU they cross into pinned memory on a copy stream of
    their own, so the next batch's forward pass runs while they do: `rows()` waits for the copy, then gives per
    sequence (aux [t, 3H], final [t, H]), unpadded."""

    _rows: Rows
    _copied: Any = None  # the copy stream's torch.cuda.Event, recorded after the batch's copies

    @property
    def crossing(self) -> bool:
        return self._copied is not None

    def rows(self) -> Rows:
        if self._copied is not None:
            self._copied.synchronize()
        return self._rows


def capture_batch(
    target: TargetModel, aux_layers: Sequence[int], sequences: Sequence[torch.Tensor],
    ids: Sequence[str] | None = None, fp8: bool = False, pixels: dict[str, torch.Tensor] | None = None,
) -> Rows:
    """One forward pass over a right-padded batch; per sequence (aux [t, 3H], final [t, H]) on CPU, unpadded."""
    return launch_batch(target, aux_layers, sequences, ids, fp8, pixels).rows()


def launch_batch(
    target: TargetModel, aux_layers: Sequence[int], sequences: Sequence[torch.Tensor],
    ids: Sequence[str] | None = None, fp8: bool = False, pixels: dict[str, torch.Tensor] | None = None,
) -> HostStates:
    """One forward pass over a right-padded batch, its states sent on to the host (`HostStates`).

    Hooks keep only the needed states: output_hidden_states would hold all N+1 of them for the whole batch. They
    are checked finite on the model's device, before the copy (a sample named by `ids`, else by its row), and with
    `fp8` quantized there too, so half the bytes cross to the host.
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
                if pixels is None:
                    base(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
                else:
                    assert target.model is not None and len(sequences) == 1
                    target.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 use_cache=False, **{k: v.to(device) for k, v in pixels.items()})
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
    aux = torch.cat([captured.pop(i) for i in aux_layers], dim=-1)
    names, lengths = ids or [f"row {row}" for row in range(len(sequences))], [len(seq) for seq in sequences]
    check_finite(aux, names, lengths, "aux_hidden_states")
    check_finite(final, names, lengths, "final_hidden_states")
    if fp8:
        flat = len(sequences) * longest
        quantized = [quantize_fp8(aux.reshape(flat, -1), target.hidden_size),
                     quantize_fp8(final.reshape(flat, -1), target.hidden_size)]
        tensors = [tensor for states in quantized for tensor in (states.values, states.scale, states.cosines)]
        host, copied = to_host(tensors)
        aux_fp8, final_fp8 = (Fp8States(*host[3 * i: 3 * i + 3], states.dtype) for i, states in enumerate(quantized))
        return HostStates([(aux_fp8.rows(row * longest, row * longest + len(seq)),
                            final_fp8.rows(row * longest, row * longest + len(seq)))
                           for row, seq in enumerate(sequences)], copied)
    # one copy to the host per batch, not per row and layer: each row is then a view of it (padding dropped)
    (aux, final), copied = to_host([aux, final])
    return HostStates([(aux[row, : len(seq)], final[row, : len(seq)]) for row, seq in enumerate(sequences)], copied)


def to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """The tensors on the host, and what to wait on before reading them: from a GPU, pinned buffers filled on the
    device's copy stream (and the event recorded after them), otherwise moved now, the same tensors when they
    were made on the host (and None)."""
    device = tensors[0].device
    if device.type != "cuda":
        return [tensor.to("cpu") for tensor in tensors], None  # made on the host: the same tensors
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the states are made before they are copied
    host = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) for tensor in tensors]
    with torch.cuda.stream(stream):
        for source, pinned in zip(tensors, host, strict=True):
            pinned.copy_(source, non_blocking=True)
            source.record_stream(stream)  # its memory is not handed out again before the copy is done
        copied = torch.cuda.Event()
        copied.record(stream)
    return host, copied


@cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _check_final_norm(before: torch.Tensor, after: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """The stored before-norm state must give the model's own after-norm state, or a SpecForge export would be off."""
    try:
        torch.testing.assert_close(final_rms_norm(before, weight, eps), after, equal_nan=True)  # NaN: named later
    except AssertionError:
        raise HiddenStatesError(
            "the target's final norm is not the plain RMSNorm (weight * x / rms(x)) that final_rms_norm redoes for "
            "the after-norm export; this model needs its own norm there"
        ) from None

def image_inputs(store: RunStore, target: TargetModel, seq: TokenSequence) -> dict[str, torch.Tensor]:
    """The target's own image processor over a sample's stored images (each checked against its name): the pixel
    inputs its forward takes beside the server's ids (pixel_values, and e.g. a grid or a pixel mask)."""
    if target.model is None:
        raise HiddenStatesError(f"sample {seq.id!r} shows images but {target.path} is not a vision-language model")
    pictures = []
    for name in seq.images:
        data = store.read_bytes(image_path(name))
        if not name_matches(name, data):
            raise HiddenStatesError(f"{image_path(name)} no longer hashes to its name: the stored image was changed")
        with Image.open(io.BytesIO(data)) as image:
            pictures.append(image.convert("RGB"))
    processed = _image_processor(target.path)(images=[pictures], return_tensors="pt")
    return {key: value for key, value in processed.items() if isinstance(value, torch.Tensor)}


@lru_cache(maxsize=1)
def _image_processor(path: str) -> Any:
    return AutoImageProcessor.from_pretrained(path)


def extract_shard(
    store: RunStore, sequences_ref: ShardRef, target: TargetModel, settings: HiddenStatesConfig, stage_key: str = ""
) -> dict[str, Any]:
    """Stage 6 for one shard with the transformers backend, without Prefect; returns the index."""

    fp8 = settings.compression == "fp8"

    def samples(sequences: list[TokenSequence], aux_layers: list[int]) -> Generator[Sample, None, None]:
        texts = [seq for seq in sequences if not seq.images]

        def batch_samples(batch: list[int], states: HostStates) -> Generator[Sample, None, None]:
            for i, (aux, final) in zip(batch, states.rows(), strict=True):
                yield Sample(texts[i].id, texts[i].input_ids, texts[i].loss_mask, aux, final)

        launched: list[tuple[list[int], HostStates]] = []
        for batch in plan_batches([len(seq.input_ids) for seq in texts], settings.max_tokens_per_batch):
            launched.append((batch, launch_batch(target, aux_layers, [texts[i].input_ids for i in batch],
                                                 [texts[i].id for i in batch], fp8=fp8)))
            # a batch still crossing to the host waits for the next forward pass to be launched beside it
            while launched and (len(launched) > 1 or not launched[0][1].crossing):
                yield from batch_samples(*launched.pop(0))
        for batch, states in launched:
            yield from batch_samples(batch, states)
        for seq in sequences:  # one at a time: each brings its own images
            if seq.images:
                (aux, final), = capture_batch(target, aux_layers, [seq.input_ids], [seq.id], fp8=fp8,
                                              pixels=image_inputs(store, target, seq))
                yield Sample(seq.id, seq.input_ids, seq.loss_mask, aux, final)

    return write_shard(store, sequences_ref, target, settings, samples, stage_key)
