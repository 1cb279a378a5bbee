"""Train straight from a run: its hidden-state parts as the samples SpecForge's or speculators' EAGLE-3 step reads.

`export` writes every hidden state once more (Kimi-K2.5: ~56 KiB per token); `TrainingReader` reads the run's own
parts instead, local or `s3://`, and yields each sample exactly as the trainer's own dataset would from the export
(key names, shapes, dtypes, loss mask, final state), to be batched by the trainer's own collate function.

What each trainer reads (the export writes the same, so both paths stay one convention):
  specforge    SpecForge's offline EAGLE-3 sample after its normalizer: input_ids, loss_mask (int64, the last
               token unsupervised), attention_mask [1, t], hidden_state [1, t, 3H] (the aux layers) and target
               [1, t, H] (the final state AFTER the final norm), both bfloat16, t = min(T, max_len).
  speculators  speculators' ArrowDataset item: hidden_states [T, 3H] (aux layers), verifier_last_hidden_states
               [T, H] (the final state BEFORE the norm: speculators applies its own verifier_norm), input_ids and
               loss_mask int64, lengths [1], position_ids [T]; states in the run's dtype (its collate casts).
"""

from __future__ import annotations

import posixpath
import random
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from eagle3_datagen.artifacts import MANIFEST, artifact_path, shard_name
from eagle3_datagen.errors import UserError
from eagle3_datagen.hidden_state_format import (
    PART_TENSORS,
    HiddenStatesError,
    Sample,
    check_format,
    final_rms_norm,
    part_split,
    read_final_norm,
    read_part_samples,
    sample_ids_by_part,
)
from eagle3_datagen.holdout import SPLITS, Split
from eagle3_datagen.storage import RunStore
from eagle3_datagen.trainers import FINAL_STATE_FOR, Trainer

SPECFORGE_DTYPE = torch.bfloat16  # its TargetHead is cast to bf16 and its inputs are not: float32 fails to train
ENDED_SHORT = ("failed", "cancelled")
SHARED_SETTINGS = ("aux_layers", "hidden_size", "num_layers", "dtype", "model")  # every shard must agree on these


class RunNotReadable(UserError):
    """A run the reader cannot train on as asked: not a run, no hidden states, or still running."""


class RunEndedShort(UserError):
    """The run ended failed or cancelled: its finished shards are not the whole training set."""


class PartialRunWarning(UserWarning):
    """Training goes on over a run's finished shards only, as asked with `allow_partial=True`."""


def specforge_features(sample: Sample, weight: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """A sample as SpecForge's offline feature file holds it: what `export --format specforge` writes.

    Copies, never views: a slice of a part would keep (and torch.save write, and a DataLoader worker share) the
    whole part's storage.
    """
    return {
        "input_ids": sample.input_ids.to(torch.int64, copy=True),
        "loss_mask": sample.loss_mask.to(torch.int64, copy=True),
        "aux_hidden_state": sample.aux_hidden_states.to(SPECFORGE_DTYPE, copy=True)[None],
        "hidden_state": final_rms_norm(sample.final_hidden_states, weight, eps).to(SPECFORGE_DTYPE)[None],
    }


def specforge_sample(sample: Sample, weight: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """What SpecForge's offline normalizer makes of a feature file already cut to max_len: the step's sample."""
    features = specforge_features(sample, weight, eps)
    loss_mask = features["loss_mask"][None]
    loss_mask[0, -1] = 0  # SpecForge never supervises a sample's last token
    return {
        "attention_mask": torch.ones_like(loss_mask, dtype=torch.long),
        "loss_mask": loss_mask,
        "target": features["hidden_state"],
        "hidden_state": features["aux_hidden_state"],
        "input_ids": features["input_ids"][None],
    }


def speculators_sample(sample: Sample) -> dict[str, torch.Tensor]:
    """What speculators' ArrowDataset yields for a sample of its export (copies, for the same reason as above)."""
    tokens = len(sample.input_ids)
    return {
        "hidden_states": sample.aux_hidden_states.clone(),
        "input_ids": sample.input_ids.to(torch.int64, copy=True),
        "verifier_last_hidden_states": sample.final_hidden_states.clone(),
        "loss_mask": sample.loss_mask.to(torch.int64, copy=True),
        "lengths": torch.tensor([tokens], dtype=torch.long),
        "position_ids": torch.arange(tokens, dtype=torch.long),
    }


@dataclass(frozen=True)
class _Part:
    """One part of a finished shard: its index entry and the ids of its rows."""

    index_rel: str
    shard: int
    number: int
    entry: dict[str, Any]
    ids: list[str]
    final_norm: str  # its sha256: every shard of a run has the same norm, loaded once


class TrainingReader(IterableDataset):
    """A run's hidden states as training samples for `trainer`, shuffled across parts, local or `s3://`.

    Parts are the unit of work, split without overlap over distributed ranks and DataLoader workers: part `p` of
    shard `s` goes to slot `(s + p + r) % slots`, `r` drawn from `seed` and `epoch`, so the split depends on
    nothing that changes while a run is followed and moves every epoch. Each slot reads its parts in an order
    shuffled by `seed` and `epoch`, and each part's samples shuffled too (call `set_epoch` before each epoch, as
    with a DistributedSampler; the DataLoader's default `persistent_workers=False` carries it to the workers).
    Over a finished run the order is a function of seed, epoch, rank and worker; while following, it also depends
    on when shards finish. Ranks get whole parts, so their sample counts differ by up to a part.

    Whole parts, never ranged reads: every part is read once, whole, through `read_part`, which checks its
    checksum against the shard's index. A reader that shuffles across parts consumes every row of a part anyway;
    ranged reads of a part's header and rows would save no bytes, could not be checked (the index holds the
    whole part's hash) and would not work on compressed parts. A worker holds one part (`part_size_bytes`,
    1 GiB by default) while it yields its samples, plus its bytes while decoding.

    `follow=True` reads a run in progress: shards are picked up as their `index.json` appears (it is written
    last), polling every `poll_interval_s`, until the manifest says the run ended. A run that ended failed or
    cancelled raises `RunEndedShort` as soon as the reader sees it, naming the cause, so a trainer never takes a
    partial set for the whole one; `allow_partial=True` reads its finished shards (or, without `follow`, those a
    running run has finished) with a `PartialRunWarning` instead. Give the DataLoader `in_order=False` when
    following with workers: a worker waiting for shards would otherwise hold back the samples of the others.
    """

    def __init__(
        self,
        run: str,
        trainer: Trainer,
        *,
        max_len: int = 2048,
        seed: int = 0,
        follow: bool = False,
        allow_partial: bool = False,
        poll_interval_s: float = 10.0,
        rank: int | None = None,
        world_size: int | None = None,
        split: Split = "train",
    ) -> None:
        """`run`: the run folder (`runs/demo`, `s3://bucket/prefix/run`). `max_len`: SpecForge's `--max-length`,
        each sample cut to it as its normalizer does (speculators' collate packs and cuts batches itself, so its
        samples come whole). `rank`/`world_size`: default from torch.distributed when it is initialized.
        `split`: the training samples, or the held-out ones (`data.holdout`), which are in parts of their own."""
        if trainer not in FINAL_STATE_FOR:
            raise RunNotReadable(f"trainer {trainer!r} is not one of {sorted(FINAL_STATE_FOR)}: pass one of them")
        if split not in SPLITS:
            raise RunNotReadable(f"split {split!r} is not one of {list(SPLITS)}: pass one of them")
        distributed = dist.is_available() and dist.is_initialized()
        self.run, self.trainer, self.max_len, self.seed = run, trainer, max_len, seed
        self.follow, self.allow_partial, self.poll_interval_s = follow, allow_partial, poll_interval_s
        self.split = split
        self.rank = rank if rank is not None else dist.get_rank() if distributed else 0
        self.world_size = world_size if world_size is not None else dist.get_world_size() if distributed else 1
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next iteration differently (the same epoch shuffles the same way)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        store = RunStore.at(self.run)
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        slot, slots = self.rank * workers + worker_id, self.world_size * workers
        rotation = random.Random(f"{self.seed}/{self.epoch}").randrange(slots)
        order = random.Random(f"{self.seed}/{self.epoch}/{slot}")
        seen: set[int] = set()
        first: dict[str, Any] = {}
        norms: dict[str, tuple[torch.Tensor, float]] = {}
        while True:
            ended = self._check_status(store)  # before listing: shards listed after an end are all there are
            new_parts: list[_Part] = []
            for shard in finished_shards(store, seen):
                seen.add(shard)
                new_parts += [part for part in _shard_parts(store, shard, first)
                              if part_split(part.entry) == self.split
                              and (part.shard + part.number + rotation) % slots == slot]
            order.shuffle(new_parts)
            for part in new_parts:
                yield from self._samples(store, part, order, norms)
            if ended or not self.follow:
                return
            time.sleep(self.poll_interval_s)

    def _check_status(self, store: RunStore) -> bool:
        """Whether the run has ended; raises for a run this reader must not (yet) train on, as asked."""
        try:
            manifest = store.read_json(MANIFEST)
        except FileNotFoundError:
            raise RunNotReadable(f"{self.run} has no {MANIFEST}: give the folder of a run (e.g. runs/demo)") from None
        if manifest["config"]["hidden_states"]["backend"] == "none":
            raise RunNotReadable(f"{self.run} was run without hidden states (hidden_states.backend: none): run the "
                                 "extract-only flow on it first")
        status = manifest.get("status")
        if status == "completed":
            return True
        if status in ENDED_SHORT:
            if not self.allow_partial:
                raise RunEndedShort(
                    f"{self.run} ended {status} ({manifest.get('cause', 'no cause recorded')}): run `eagle3-datagen "
                    f"rerun-failed {self.run}` and read it again, or pass allow_partial=True to train on its "
                    "finished shards")
            warnings.warn(f"{self.run} ended {status}: training on its finished shards only", PartialRunWarning,
                          stacklevel=2)
            return True
        if self.follow:
            return False
        if not self.allow_partial:
            raise RunNotReadable(f"{self.run} is still running: pass follow=True to read its shards as they finish, "
                                 "or allow_partial=True for those finished now")
        warnings.warn(f"{self.run} is still running: training on the shards finished now only", PartialRunWarning,
                      stacklevel=2)
        return False

    def _samples(self, store: RunStore, part: _Part, order: random.Random,
                 norms: dict[str, tuple[torch.Tensor, float]]) -> Iterator[dict[str, torch.Tensor]]:
        """A part's samples in shuffled order, the part checked whole first (`norms`: final norms loaded so far)."""
        samples = read_part_samples(store, part.index_rel, part.entry, part.ids)
        if self.trainer == "specforge" and part.final_norm not in norms:
            norms[part.final_norm] = read_final_norm(store, part.index_rel)
        order.shuffle(samples)
        for sample in samples:
            if self.trainer == "speculators":
                yield speculators_sample(sample)
            else:
                cut = Sample(sample.id, *(getattr(sample, name)[:self.max_len] for name in PART_TENSORS))
                yield specforge_sample(cut, *norms[part.final_norm])


def finished_shards(store: RunStore, known: set[int]) -> list[int]:
    """Shards, beyond `known`, whose hidden-state index exists (it is written last: the shard is complete).

    One listing of `hidden_states/` and one existence check per shard folder not yet known, so a poll costs the
    shards in progress, not the run's size.
    """
    folders = (re.fullmatch(r"shard-(\d+)", posixpath.basename(rel)) for rel in store.list("hidden_states"))
    numbers = (int(found.group(1)) for found in folders if found)
    return [n for n in numbers if n not in known and store.exists(artifact_path("hidden_states", n))]


def _shard_parts(store: RunStore, shard: int, first: dict[str, Any]) -> list[_Part]:
    """A finished shard's parts, refused if it was extracted in another format or with other settings than the
    first shard read (`first` remembers it)."""
    index_rel = artifact_path("hidden_states", shard)
    index = store.read_json(index_rel)
    check_format(index, index_rel)
    shared = {key: index[key] for key in SHARED_SETTINGS}
    first.setdefault("shard", shard)
    if first.setdefault("settings", shared) != shared:
        raise HiddenStatesError(f"{index_rel} was extracted with other settings than {shard_name(first['shard'])}: "
                                "run hidden_states again")
    ids = sample_ids_by_part(index)
    final_norm = (index.get("final_norm") or {}).get("sha256", index_rel)  # read_final_norm says what is missing
    return [_Part(index_rel, shard, number, entry, ids.get(number, []), final_norm)
            for number, entry in enumerate(index["parts"])]
