"""The hidden-state format every reader shares: parts, their index and the final norm, checked on read.

Under `hidden_states/shard-NNNNN/` the extraction stage writes:
  part-NNNNN.safetensors  input_ids [T] int32, loss_mask [T] uint8, aux_hidden_states [T, 3H] (the three aux
                          layers concatenated in order), final_hidden_states [T, H] (before the final norm),
                          offsets [n+1] int64 (sample k is rows offsets[k]:offsets[k+1]); metadata names ids,
                          layers and the compression.
  final_norm.safetensors  the final RMSNorm's weight [H]; its eps in the metadata and the index.
  index.json              parts with checksums (each part's BLAKE3), sample id -> [part, row], layer
                          ids in both conventions, model fingerprint, compression (and fp8's cosine to the
                          model-dtype states). Written last: its presence means the shard is complete.

Compression applies to the two state tensors only; ids, mask and offsets are always stored as they are. Under
`zstd` a state tensor is stored as `NAME.zstd`, each sample's bytes split into planes (every value's first byte,
then every second byte...) and zstd-compressed on their own, one chunk per sample (`NAME.zstd_bytes` gives each
chunk's size; a /3 part holds one stream for the whole part): lossless; the planes compress better than the
interleaved values (bf16: the sign-and-exponent byte is repetitive, the mantissa byte is not). Under `fp8` it is
stored as `NAME.fp8` (float8 e4m3) and `NAME.scale` (float32, one per token and layer: amax / 448): each value
comes back within 1/16 of itself (3 mantissa bits), or within 2^-10 of its row's scale near zero, then rounded to
the model dtype; the index records every row's cosine to the model-dtype row. The metadata `encoded` gives each
state's dtype and shape. `read_part` returns plain tensors in the model dtype whatever the compression, so every
reader is unchanged.

The extraction stage writes it; export and verify read it, so it lives here, below the stages. torch is imported
where a tensor is made or read: the flow, structural checks and a cached re-run never load it.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, get_args

import numpy as np
import pyarrow as pa

from eagle3_datagen.artifacts import ENCODING_THREADS, blake3_hex, blocks_sha256_hex, sha256_hex
from eagle3_datagen.config import Compression, ModelDtype
from eagle3_datagen.errors import ConfigurationError, UserError
from eagle3_datagen.holdout import Split
from eagle3_datagen.storage import RunStore

if TYPE_CHECKING:
    import torch

# /5: a part's checksum is `blake3`; /4: `sha256_blocks` (its blocks' sha256s); /3: parts may be compressed (their
# metadata and the index say how), each part's checksum a plain `sha256`
FORMAT = "eagle3-hidden-states/5"
READABLE_FORMATS = ("eagle3-hidden-states/3", "eagle3-hidden-states/4", FORMAT)
FINAL_STATE = "before_norm"
FINAL_NORM_FILE = "final_norm.safetensors"
DTYPES: tuple[str, ...] = get_args(ModelDtype)  # the model dtypes states are stored in
PART_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states")
STATE_TENSORS = ("aux_hidden_states", "final_hidden_states")
ZSTD_LEVEL = 1  # higher levels take several times as long for a few percent smaller parts
FP8_MAX = 448.0  # the largest float8 e4m3 value
FP8_BLOCK_TOKENS = 1024  # quantized this many tokens at a time: the float32 copies stay small beside a part
COSINE_GOAL = 0.999


# safetensors' names of the dtypes a part or a norm file holds
_SAFETENSORS_DTYPES = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model dtype's name (`hidden_states.dtype`, a part's `encoded` metadata)."""
    import torch

    if name not in DTYPES:
        raise HiddenStatesError(f"states stored as {name!r}, not one of {', '.join(DTYPES)}: re-run hidden_states")
    return getattr(torch, name)


def safetensors_buffers(tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str] | None = None
                        ) -> list[memoryview]:
    """A safetensors file as buffers to write one after the other, its data never copied into one.

    Each tensor comes as pieces that concatenate along the first dimension (a part's samples); its bytes are the
    pieces' in turn, never joined: on a GPU, joining and re-slicing a part would cost more than its forward passes.
    The same bytes on every machine and process: tensors stored in name order, the header's keys sorted
    (safetensors' own writer orders metadata by a hash map that changes from process to process).
    """
    import torch

    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    buffers: list[memoryview] = []
    offset = 0
    for name in sorted(tensors):
        pieces = tensors[name]
        start = offset
        for piece in pieces:
            buffers.append(memoryview(piece.contiguous().view(-1).view(torch.uint8).numpy()))
            offset += buffers[-1].nbytes
        shape = [sum(piece.shape[0] for piece in pieces), *pieces[0].shape[1:]] if pieces[0].dim() else []
        header[name] = {"dtype": _SAFETENSORS_DTYPES[_dtype_name(pieces[0].dtype)], "shape": shape,
                        "data_offsets": [start, offset]}
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return [memoryview(len(text).to_bytes(8, "little") + text), *buffers]


def save_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes that depend only on the tensors and metadata (see `safetensors_buffers`)."""
    return b"".join(safetensors_buffers({name: [tensor] for name, tensor in tensors.items()}, metadata))


class HiddenStatesError(UserError):
    """Hidden states that must not reach a trainer: non-finite values, wrong shapes, corrupted parts."""

@dataclass(frozen=True)
class Sample:
    """One sequence's training features, padding removed."""

    id: str
    input_ids: torch.Tensor  # [t] int32
    loss_mask: torch.Tensor  # [t] uint8
    aux_hidden_states: torch.Tensor | Fp8States  # [t, 3H], model dtype (fp8 only on its way to a part)
    final_hidden_states: torch.Tensor | Fp8States  # [t, H], before the final norm

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in PART_TENSORS)


@dataclass(frozen=True)
class Fp8States:
    """States quantized where they were made (on the GPU, before the copy, which it halves): float8 e4m3 values,
    a float32 scale per token and layer, and each row's cosine to the model-dtype row. Only the extraction stage
    holds them; a part stores them as they are."""

    values: torch.Tensor  # [t, L x H] float8_e4m3fn
    scale: torch.Tensor  # [t, L] float32
    cosines: torch.Tensor  # [t, L] float32
    dtype: torch.dtype  # the model dtype they decode to

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scale.nbytes

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def __len__(self) -> int:
        return len(self.values)

    def to(self, device: str) -> Fp8States:
        return Fp8States(self.values.to(device), self.scale.to(device), self.cosines.to(device), self.dtype)

    def rows(self, start: int, end: int) -> Fp8States:
        return Fp8States(self.values[start:end], self.scale[start:end], self.cosines[start:end], self.dtype)

def check_finite(states: torch.Tensor, sample_ids: Sequence[str], lengths: Sequence[int] | None = None,
                 what: str = "hidden states") -> None:
    """NaN or Inf must not reach a trainer: refuse the first sample whose states hold one, by name.

    `states` is [samples, tokens, ...] on whatever device it was made (one reduction there, before any copy), a
    sample's tokens past its length (padding) not counted. Summed in float32: NaN and Inf survive a sum, and no
    finite bf16 or fp16 row overflows it.
    """
    import torch

    bad = ~torch.isfinite(states.flatten(2).sum(-1, dtype=torch.float32))  # [samples, tokens]
    if lengths is not None:
        positions = torch.arange(bad.shape[1], device=bad.device)
        bad &= positions[None] < torch.tensor(lengths, device=bad.device)[:, None]
    rows = bad.any(-1)
    if bool(rows.any()):
        raise HiddenStatesError(f"sample {sample_ids[int(rows.nonzero()[0])]!r}: {what} have NaN or Inf values")


def final_rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm, computed as transformers does (fp32 statistics, scale in the states' dtype).

    Why: the stored final state is before the norm (what vLLM captures and speculators trains on); SpecForge
    trains on the state after it, which `lm_head` reads. Extraction checks this against the model's own norm.
    """
    import torch

    hidden = states.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(states.dtype) * hidden.to(states.dtype)

def check_compression(compression: Compression, torch_module: ModuleType | None = None) -> None:
    """Refuse fp8 before any work where torch has no float8 dtypes (torch < 2.1), rather than at the first part."""
    if compression != "fp8":
        return
    if torch_module is None:
        import torch as torch_module
    if not hasattr(torch_module, "float8_e4m3fn"):
        raise ConfigurationError(
            f"config key hidden_states.compression: fp8 needs float8 dtypes, which torch "
            f"{getattr(torch_module, '__version__', '?')} lacks: install torch >= 2.1 or use compression zstd"
        )


@dataclass(frozen=True)
class EncodedPart:
    """A part's file (as buffers to write in turn) and, under fp8, each stored row's cosine to the model-dtype row
    (token x layer)."""

    buffers: list[memoryview]
    cosines: torch.Tensor | None


def encode_part(pieces: dict[str, list[Any]], metadata: dict[str, str],
                compression: Compression = "none") -> EncodedPart:
    """A part's file: the one place the stored encoding of a part is decided.

    Each tensor comes as pieces along its first dimension (the part's samples); stored as they are, they are
    never joined in memory. Under zstd each piece is compressed on its own, on several threads; under fp8 a
    piece not quantized where it was made (`Fp8States`) is quantized here.
    """
    import torch

    if compression == "none":
        return EncodedPart(safetensors_buffers(pieces, metadata={**metadata, "compression": "none"}), None)
    stored = {name: tensor_pieces for name, tensor_pieces in pieces.items() if name not in STATE_TENSORS}
    hidden_size = pieces["final_hidden_states"][0].shape[-1]
    encoded = {name: {"dtype": _dtype_name(pieces[name][0].dtype),
                      "shape": [sum(len(piece) for piece in pieces[name]), pieces[name][0].shape[-1]]}
               for name in STATE_TENSORS}
    cosines: list[torch.Tensor] = []
    for name in STATE_TENSORS:
        if compression == "zstd":
            with ThreadPoolExecutor(max_workers=ENCODING_THREADS, thread_name_prefix="zstd") as pool:
                chunks = list(pool.map(_zstd_compress, pieces[name]))
            stored[f"{name}.zstd"] = chunks
            stored[f"{name}.zstd_bytes"] = [torch.tensor([len(chunk) for chunk in chunks], dtype=torch.int64)]
        else:
            quantized = [piece if isinstance(piece, Fp8States) else quantize_fp8(piece, hidden_size)
                         for piece in pieces[name]]
            stored[f"{name}.fp8"] = [piece.values for piece in quantized]
            stored[f"{name}.scale"] = [piece.scale for piece in quantized]
            cosines += [piece.cosines.flatten() for piece in quantized]
    metadata = {**metadata, "compression": compression, "encoded": json.dumps(encoded)}
    return EncodedPart(safetensors_buffers(stored, metadata), torch.cat(cosines) if cosines else None)


def _decode_part(data: bytes) -> dict[str, torch.Tensor]:
    """The plain tensors of a part's bytes, states in the model dtype whatever the compression."""
    import torch
    from safetensors.torch import load as load_safetensors

    tensors = load_safetensors(data)
    metadata = _safetensors_metadata(data)
    for name, spec in json.loads(metadata.get("encoded", "{}")).items():
        dtype, shape = torch_dtype(spec["dtype"]), spec["shape"]
        if metadata["compression"] == "zstd" and f"{name}.zstd_bytes" in tensors:  # /4: one chunk per sample
            rows = tensors["offsets"].diff().tolist()
            chunks = torch.split(tensors.pop(f"{name}.zstd"), tensors.pop(f"{name}.zstd_bytes").tolist())
            tensors[name] = torch.cat([_zstd_decompress(chunk, dtype, [count, shape[1]])
                                       for chunk, count in zip(chunks, rows, strict=True)])
        elif metadata["compression"] == "zstd":  # /3: the part's states as one stream
            tensors[name] = _zstd_decompress(tensors.pop(f"{name}.zstd"), dtype, shape)
        else:
            tensors[name] = _dequantize_fp8(tensors.pop(f"{name}.fp8"), tensors.pop(f"{name}.scale"), dtype)
    return tensors


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _zstd_compress(states: torch.Tensor) -> torch.Tensor:
    """The states' bytes as planes (byte k of every value together), zstd-compressed, as a uint8 tensor."""
    import torch

    values = states.contiguous().view(torch.uint8).numpy().reshape(-1, states.element_size())
    compressed = pa.Codec("zstd", compression_level=ZSTD_LEVEL).compress(np.ascontiguousarray(values.T), asbytes=True)
    return torch.frombuffer(bytearray(compressed), dtype=torch.uint8)


def _zstd_decompress(compressed: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape))
    raw = pa.decompress(compressed.numpy(), decompressed_size=count * itemsize, codec="zstd", asbytes=False)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, count)
    return torch.from_numpy(np.stack(list(planes), axis=1)).view(dtype).view(shape)


def quantize_fp8(states: torch.Tensor, hidden_size: int) -> Fp8States:
    """float8 e4m3 values, a float32 scale per token and layer (amax / 448), and each row's cosine to the original,
    on the states' device.

    One scale per layer of a token, not one per token: each layer's scale follows its own magnitude, which grows
    from the low aux layer to the final state. The cosine is that of what `read_part` returns (same dequantization).
    """
    import torch

    tokens, layers, device = len(states), states.shape[-1] // hidden_size, states.device
    values = torch.empty(states.shape, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty((tokens, layers), dtype=torch.float32, device=device)
    cosines = torch.empty((tokens, layers), dtype=torch.float32, device=device)
    for start in range(0, tokens, FP8_BLOCK_TOKENS):
        block = slice(start, start + FP8_BLOCK_TOKENS)
        rows = states[block].float().view(-1, layers, hidden_size)
        amax = rows.abs().amax(-1)
        divisor = torch.where(amax > 0, amax / FP8_MAX, 1.0)
        # clamped: the division may round a row's amax a hair above 448, which older torch casts to NaN
        quantized = (rows / divisor[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        values[block], scale[block] = quantized.view(len(rows), -1), amax / FP8_MAX
        decoded = _dequantize_rows(quantized, scale[block], states.dtype).float()
        cosines[block] = torch.where(amax > 0, torch.nn.functional.cosine_similarity(rows, decoded, dim=-1), 1.0)
    return Fp8States(values, scale, cosines, states.dtype)


def _dequantize_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, layers, H] float8 values times their [tokens, layers] scales, in the model dtype."""
    return (values.float() * scale[..., None]).to(dtype)


def _dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    import torch

    states = torch.empty(values.shape, dtype=dtype)
    for start in range(0, len(values), FP8_BLOCK_TOKENS):
        block = slice(start, start + FP8_BLOCK_TOKENS)
        rows = values[block].view(len(values[block]), scale.shape[1], -1)
        states[block] = _dequantize_rows(rows, scale[block], dtype).view(len(rows), -1)
    return states


def cosine_summary(cosines: torch.Tensor) -> dict[str, Any]:
    """What the index says of fp8's fidelity: the distribution over rows (token x layer) and how many miss 0.999."""
    values = cosines.double().numpy()
    p1, p50 = np.quantile(values, [0.01, 0.5]).tolist()
    return {"rows": len(values), "min": float(values.min()), "p1": p1, "p50": p50, "mean": float(values.mean()),
            f"under_{COSINE_GOAL}": int((values < COSINE_GOAL).sum())}


def check_format(index: dict[str, Any], index_rel: str) -> None:
    """An index of another format version or final-state convention is refused by name: its parts would be
    misread."""
    if index.get("format") not in READABLE_FORMATS or index.get("final_state") != FINAL_STATE:
        readable = f"{', '.join(map(repr, READABLE_FORMATS[:-1]))} and {READABLE_FORMATS[-1]!r}"
        raise HiddenStatesError(
            f"{index_rel} is {index.get('format')!r} with its final state {index.get('final_state')!r}, this "
            f"version reads {readable} ({FINAL_STATE}): run hidden_states again"
        )


def part_checksum(buffers: list[memoryview]) -> dict[str, Any]:
    """What the index keeps to check a part's bytes: their BLAKE3 (see `blake3_hex`)."""
    return {"blake3": blake3_hex(*buffers)}


def matches_checksum(data: bytes, part: dict[str, Any]) -> bool:
    """A part's bytes against its index entry, whichever checksum it was written with (/4: its blocks' sha256s,
    /3: a plain sha256)."""
    if "blake3" in part:
        return blake3_hex(data) == part["blake3"]
    if "sha256" in part:
        return sha256_hex(data) == part["sha256"]
    blocks = part["sha256_blocks"]
    return blocks_sha256_hex(data, block_bytes=blocks["block_bytes"]) == blocks["digest"]


def read_part(store: RunStore, index_rel: str, part: dict) -> dict[str, torch.Tensor]:
    """One part of a finished shard, checked against the index's size and checksum, decoded to plain tensors."""
    rel = posixpath.join(posixpath.dirname(index_rel), part["file"])
    data = store.read_bytes(rel)
    if len(data) != part["bytes"] or not matches_checksum(data, part):
        raise HiddenStatesError(f"{rel} does not match its checksum in {index_rel}: re-run hidden_states")
    return _decode_part(data)


def sample_ids_by_part(index: dict[str, Any]) -> dict[int, list[str]]:
    """Each part's sample ids, in row order, from a shard's index."""
    ids: dict[int, list[str]] = {}
    for sample_id, (part, _row) in sorted(index["samples"].items(), key=lambda item: item[1]):
        ids.setdefault(part, []).append(sample_id)
    return ids


def read_part_samples(store: RunStore, index_rel: str, part: dict, ids: list[str]) -> list[Sample]:
    """A part's samples in row order (views of its tensors), the part checked against the index first."""
    tensors = read_part(store, index_rel, part)
    offsets = tensors["offsets"].tolist()
    if len(offsets) != len(ids) + 1 or offsets[0] != 0 or offsets[-1] != part["num_tokens"]:
        rel = posixpath.join(posixpath.dirname(index_rel), part["file"])
        raise HiddenStatesError(f"{rel}: offsets do not match the {len(ids)} samples listed in {index_rel}: "
                                "re-run hidden_states")
    return [Sample(sample_id, *(tensors[name][start:end] for name in PART_TENSORS))
            for sample_id, start, end in zip(ids, offsets[:-1], offsets[1:], strict=True)]


def part_split(part: dict[str, Any]) -> Split:
    """The split a part's samples belong to (parts before held-out splits existed are training parts)."""
    return part.get("split", "train")


def split_samples(index: dict[str, Any], split: Split) -> int:
    return sum(part["num_samples"] for part in index["parts"] if part_split(part) == split)


def read_hidden_state_shard(store: RunStore, index_rel: str, split: Split | None = None) -> Iterator[Sample]:
    """Every sample of a finished shard (of one split), part by part, each part checked against the index."""
    index = store.read_json(index_rel)
    check_format(index, index_rel)
    ids = sample_ids_by_part(index)
    for number, part in enumerate(index["parts"]):
        if split is None or part_split(part) == split:
            yield from read_part_samples(store, index_rel, part, ids.get(number, []))

def read_final_norm(store: RunStore, index_rel: str) -> tuple[torch.Tensor, float]:
    """The final norm's weight and eps stored beside a shard's parts, checked against the index."""
    from safetensors.torch import load as load_safetensors

    entry = store.read_json(index_rel).get("final_norm")
    rel = posixpath.join(posixpath.dirname(index_rel), entry["file"]) if entry else None
    if rel is None or not store.exists(rel):
        raise HiddenStatesError(f"{index_rel}: its final norm is missing (an older version?): re-run hidden_states")
    data = store.read_bytes(rel)
    if sha256_hex(data) != entry["sha256"]:
        raise HiddenStatesError(f"{rel} does not match its checksum in {index_rel}: re-run hidden_states")
    return load_safetensors(data)["weight"], float(entry["eps"])
