"""Stage 7, on demand: a run's hidden states as the files a trainer reads as is.

specforge    <out>/shard-NNNNN/data_{i:09d}.ckpt (torch.save; SpecForge's OfflineEagle3Dataset walks sub-folders
             for *.ckpt and takes them in string order, which the zero-padding makes the sample order): input_ids
             [T] int64, loss_mask [T] int64, aux_hidden_state [1, T, 3H], hidden_state [1, T, H] after the final
             norm, both bfloat16 whatever the run stored (SpecForge's target head is bf16 and reads no other).
speculators  <out>/hidden_states/hs_{i}.safetensors: token_ids [T] int64, hidden_states [T, 4, H] (the three aux
             layers, then the final state before the norm), loss_mask [T] int64; and <out>/ itself is a `datasets`
             folder (save_to_disk, torch format) with input_ids, loss_mask and seq_len for row i, which speculators'
             ArrowDataset loads with load_from_disk and pairs with hs_{i}, plus token_freq.pt (token id -> count
             under the loss mask, as its prepare_data writes: without it --draft-vocab-size is ignored).
both         <out>/export.json, written last: the split (training samples by default; `holdout` exports the
             held-out ones, into <format>-holdout), sample i -> id, layer ids in both conventions, which final state,
             the dtype of the files.

`i` counts samples over the shards in order, so shards export independently: each leaves a marker under
<out>/_done/ and a re-run exports only shards without one (or whose hidden states changed since).
"""

from __future__ import annotations

import io
import json
import posixpath
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import MANIFEST, artifact_path, sha256_hex, shard_name
from eagle3_datagen.errors import UserError, retry_unless_user_error
from eagle3_datagen.hidden_state_format import (
    check_format,
    read_final_norm,
    read_hidden_state_shard,
    split_samples,
)
from eagle3_datagen.holdout import Split
from eagle3_datagen.lease import refuse_while_written
from eagle3_datagen.storage import RunStore
from eagle3_datagen.trainers import FINAL_STATE_FOR, Trainer

ExportFormat = Trainer
EXPORT_INDEX = "export.json"
TOKEN_FREQ = "token_freq.pt"


class ExportError(UserError):
    """A run that cannot be exported yet, with what to do about it."""


@dataclass(frozen=True)
class ShardExport:
    """One finished hidden-state shard and the global number of its first sample."""

    index: int
    first: int
    num_samples: int
    source_sha256: str  # of its index.json: a changed shard exports again


@dataclass(frozen=True)
class ExportPlan:
    """Where from, where to, which format, and every shard's place in the sample numbering."""

    run_uri: str
    out_uri: str
    format: ExportFormat
    split: Split  # training samples, or the held-out ones
    shards: list[ShardExport]
    source: dict[str, Any]  # what export.json repeats from the hidden-state indexes: layers, sizes, dtype


def plan_export(run_uri: str, export_format: ExportFormat, out_uri: str | None = None,
                split: Split = "train") -> ExportPlan:
    """Every shard of the run must have finished hidden states: a partial export would silently lose samples.

    `split`: the training samples (default: held-out ones are for `evaluate`, never trained on) or the held-out
    ones, by default into RUN/exports/FORMAT-holdout.
    """
    run = RunStore.at(run_uri)
    if not run.exists(MANIFEST):
        raise ExportError(f"{run_uri} has no {MANIFEST}: give the folder of a run (e.g. runs/demo)")
    refuse_while_written(run, "export it once that run ends")
    manifest = run.read_json(MANIFEST)
    if manifest.get("status") == "running":
        raise ExportError(f"{run_uri} did not end (its manifest says running: killed, or its machine lost): run it "
                          f"again to finish it, or `eagle3-datagen rerun-failed {run_uri}`, then export")
    if manifest["config"]["hidden_states"]["backend"] == "none":
        raise ExportError(
            f"{run_uri} was run without hidden states (hidden_states.backend: none): run the extract-only flow first"
        )
    shards: list[ShardExport] = []
    source: dict[str, Any] = {}
    for name in sorted(manifest.get("shards", {})):
        rel = artifact_path("hidden_states", int(name.rsplit("-", 1)[1]))
        if not run.exists(rel):
            raise ExportError(
                f"{run_uri}: {posixpath.dirname(rel)} is not finished: run `eagle3-datagen rerun-failed {run_uri}` "
                "first"
            )
        data = run.read_bytes(rel)
        index = json.loads(data)
        check_format(index, rel)
        settings = {
            key: index[key] for key in ("aux_layers", "final_state", "hidden_size", "num_layers", "dtype", "model")
        }
        if source and settings != source:
            raise ExportError(
                f"{rel} was extracted with other settings than the shards before it: run hidden_states again"
            )
        source = settings
        first = sum(shard.num_samples for shard in shards)
        shards.append(ShardExport(index["shard"], first, split_samples(index, split), sha256_hex(data)))
    if not shards:
        raise ExportError(f"{run_uri} has no shards to export")
    if not any(shard.num_samples for shard in shards):
        raise ExportError(f"{run_uri} has no {split} samples to export"
                          + (" (data.holdout was 0)" if split == "holdout" else ""))
    folder = export_format if split == "train" else f"{export_format}-{split}"
    out = out_uri or f"{run.uri.rstrip('/')}/exports/{folder}"
    return ExportPlan(run.uri, out, export_format, split, shards, source)


def _marker(shard: ShardExport) -> str:
    return f"_done/{shard_name(shard.index)}.json"


def _rows_file(shard: ShardExport) -> str:
    return f"_rows/{shard_name(shard.index)}.parquet"


def _sample_file(export_format: ExportFormat, shard: ShardExport, i: int) -> str:
    if export_format == "specforge":
        return f"{shard_name(shard.index)}/data_{i:09d}.ckpt"
    return f"hidden_states/hs_{i}.safetensors"


def export_shard(plan: ExportPlan, shard: ShardExport) -> dict[str, Any]:
    """Write one shard's samples as trainer files, then its marker; a shard with a current marker is skipped."""
    import torch
    from safetensors.torch import save as save_safetensors

    from eagle3_datagen.training_reader import specforge_features

    run, out = RunStore.at(plan.run_uri), RunStore.at(plan.out_uri)
    if out.exists(_marker(shard)):
        marker = out.read_json(_marker(shard))
        if (marker["source_sha256"], marker["first"], marker.get("split", "train")) == (
                shard.source_sha256, shard.first, plan.split):
            return marker
        _remove_samples(out, plan.format, ShardExport(shard.index, marker["first"], len(marker["ids"]), ""))
        out.remove(_marker(shard))
    out.remove(EXPORT_INDEX)  # it vouches for a complete export: not while a shard is being written
    index_rel = artifact_path("hidden_states", shard.index)
    weight, eps = read_final_norm(run, index_rel)
    ids: list[str] = []
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, sample in enumerate(read_hidden_state_shard(run, index_rel, plan.split), start=shard.first):
        if plan.format == "specforge":
            buffer = io.BytesIO()
            torch.save(specforge_features(sample, weight, eps), buffer)
            data = buffer.getvalue()
        else:
            input_ids, loss_mask = sample.input_ids.to(torch.int64), sample.loss_mask.to(torch.int64)
            tokens = len(input_ids)
            states = torch.cat(
                [sample.aux_hidden_states.view(tokens, 3, -1), sample.final_hidden_states[:, None]], dim=1
            )
            data = save_safetensors({"token_ids": input_ids, "hidden_states": states, "loss_mask": loss_mask})
            rows["input_ids"].append(input_ids.tolist())
            rows["loss_mask"].append(loss_mask.tolist())
            rows["seq_len"].append(tokens)
        out.write_bytes(_sample_file(plan.format, shard, i), data)
        ids.append(sample.id)
    if len(ids) != shard.num_samples:
        raise ExportError(f"{index_rel} lists {shard.num_samples} samples, its parts hold {len(ids)}")
    if plan.format == "speculators":
        table = pa.table(rows, schema=_ROWS_SCHEMA)
        with out.open(_rows_file(shard), "wb") as handle:
            pq.write_table(table, handle)
    marker = {"source_sha256": shard.source_sha256, "first": shard.first, "split": plan.split, "ids": ids}
    out.write_json(_marker(shard), marker)
    return marker


_ROWS_SCHEMA = pa.schema(
    [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())]
)


def _remove_samples(out: RunStore, export_format: ExportFormat, shard: ShardExport) -> None:
    """Files of an older export of this shard: its numbering may have moved."""
    if export_format == "specforge":
        out.remove(shard_name(shard.index))
    else:
        for i in range(shard.first, shard.first + shard.num_samples):
            out.remove(_sample_file(export_format, shard, i))
        out.remove(_rows_file(shard))


def finish_export(plan: ExportPlan) -> dict[str, Any]:
    """After every shard: drop what no planned shard owns, write the speculators dataset, then export.json."""
    out = RunStore.at(plan.out_uri)
    planned = {_marker(shard) for shard in plan.shards}
    for stale in out.list("_done", ".json"):
        if stale not in planned:
            marker = out.read_json(stale)
            number = int(posixpath.basename(stale).removesuffix(".json").rsplit("-", 1)[1])
            _remove_samples(out, plan.format, ShardExport(number, marker["first"], len(marker["ids"]), ""))
            out.remove(stale)
    ids: list[str] = []
    for shard in plan.shards:
        marker = out.read_json(_marker(shard)) if out.exists(_marker(shard)) else None
        if marker is None or (marker["source_sha256"], marker["first"], marker.get("split", "train")) != (
                shard.source_sha256, shard.first, plan.split):
            raise ExportError(
                f"{shard_name(shard.index)} was not exported: run the export again (finished shards are kept)"
            )
        ids.extend(marker["ids"])
    if plan.format == "speculators":
        _write_dataset(out, plan)
    index = {
        "format": plan.format,
        "run": plan.run_uri,
        "split": plan.split,
        "num_samples": len(ids),
        "final_state": FINAL_STATE_FOR[plan.format],
        **{key: value for key, value in plan.source.items() if key != "final_state"},
        "dtype": "bfloat16" if plan.format == "specforge" else plan.source["dtype"],
        "source_dtype": plan.source["dtype"],
        "samples": ids,
    }
    out.write_json(EXPORT_INDEX, index)
    return {key: value for key, value in index.items() if key != "samples"}


def _write_dataset(out: RunStore, plan: ExportPlan) -> None:
    """The rows as a `datasets` folder in torch format, built on local disk and copied up file by file."""
    import datasets
    import torch

    with tempfile.TemporaryDirectory(prefix="eagle3-export-") as tmp:
        shards = [shard for shard in plan.shards if shard.num_samples]  # datasets cannot read an empty parquet
        local = [str(Path(tmp, f"{shard_name(s.index)}.parquet")) for s in shards]
        for shard, path in zip(shards, local, strict=True):
            Path(path).write_bytes(out.read_bytes(_rows_file(shard)))
        dataset = datasets.Dataset.from_parquet(local, cache_dir=str(Path(tmp, "cache")))
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(Path(tmp, "dataset")))
        for file in sorted(Path(tmp, "dataset").iterdir()):
            out.write_bytes(file.name, file.read_bytes())
        buffer = io.BytesIO()
        torch.save(token_frequencies(dataset), buffer)
        out.write_bytes(TOKEN_FREQ, buffer.getvalue())


def token_frequencies(rows: Any) -> dict[int, int]:
    """Token id -> count under the loss mask: what speculators builds its reduced draft vocabulary from."""
    counts: Counter[int] = Counter()
    for row in rows:
        ids, counted = row["input_ids"][row["loss_mask"].bool()].unique(return_counts=True)
        counts.update(dict(zip(ids.tolist(), counted.tolist(), strict=True)))
    return dict(counts)


def export_run(run_uri: str, export_format: ExportFormat, out_uri: str | None = None,
               split: Split = "train") -> dict[str, Any]:
    """The whole export in this process, shard after shard (the `export` flow runs shards as parallel tasks)."""
    plan = plan_export(run_uri, export_format, out_uri, split)
    for shard in plan.shards:
        export_shard(plan, shard)
    return {"out": plan.out_uri, **finish_export(plan)}


@task(name="export-shard", retries=1, retry_condition_fn=retry_unless_user_error, cache_policy=NO_CACHE)
def export_shard_task(plan: ExportPlan, shard: ShardExport) -> int:
    """Prefect stage 7 for one shard: the marker, not a cached result, says it is done."""
    return len(export_shard(plan, shard)["ids"])


@task(name="finish-export", cache_policy=NO_CACHE)
def finish_export_task(plan: ExportPlan) -> dict[str, Any]:
    return {"out": plan.out_uri, **finish_export(plan)}
