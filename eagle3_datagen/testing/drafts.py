"""Small EAGLE-3 drafts built and trained with speculators' own code on this CPU, for the tests and the benchmark
that judge drafts on a run's held-out split.

speculators' Trainer assumes an accelerator: on a CPU its device is "cpu" (not rank 0) and its step timer's
synchronize is a no-op; nothing else of it changes. Drafts train with SDPA attention (flex attention has no CPU
backward) and the eager KL loss (its fused one needs Triton).
"""

from __future__ import annotations

import importlib
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from eagle3_datagen.trainers import speculators, speculators_call_kwargs

PACKED_TOKENS = 256  # tokens per training batch (speculators packs samples into one row)


def new_draft(target: str, aux_layers: list[int], steps: int = 3, seed: int = 0) -> Any:
    """An untrained one-layer EAGLE-3 draft for `target` over its whole vocabulary."""
    speculators()
    cli = importlib.import_module("speculators.train.cli")
    eagle3 = importlib.import_module("speculators.models.eagle3")
    layer = cli.create_transformer_layer_config(verifier_name_or_path=target, num_layers=1, draft_arch="llama",
                                                hidden_act="silu", sliding_window=2048, full_attention_indices=[0])
    torch.manual_seed(seed)
    return eagle3.Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=None, d2t=None, verifier_name_or_path=target, target_layer_ids=aux_layers,
        draft_vocab_size=layer.vocab_size, ttt_steps=steps, norm_before_residual=True, norm_before_fc=True,
        norm_output=True, draft_attn_impl="sdpa")


def train_draft(model: Any, export: Path, save: Path, max_steps: int, lr: float = 3e-3, steps: int = 3) -> Path:
    """Train `model` on a speculators export for `max_steps` optimizer steps with speculators' Trainer; the
    checkpoint folder it saved."""
    data = importlib.import_module("speculators.train.data")
    loader = importlib.import_module("speculators.train.dataloader")
    shift = importlib.import_module("speculators.models.eagle3.data").shift_batch
    trainer_module = importlib.import_module("speculators.train.trainer")
    dataset = data.ArrowDataset(datapath=str(export), max_len=PACKED_TOKENS, on_missing="raise", split="train",
                                train_ratio=1.0, hidden_states_dtype=torch.float32)
    batches = loader._setup_dataloader(dataset, PACKED_TOKENS, model.hidden_size, num_workers=0,
                                       num_target_layers=3, prefetch_factor=None, preprocess=shift)
    epochs = math.ceil(max_steps / len(batches))  # the trainer saves and validates after every epoch
    config = trainer_module.TrainerConfig(
        lr=lr, num_epochs=epochs, save_path=str(save), train_call_kwargs=speculators_call_kwargs(steps),
        val_call_kwargs=speculators_call_kwargs(steps), hidden_states_dtype=torch.float32, max_steps=max_steps,
        scheduler_type="none")
    with on_this_cpu(trainer_module):
        trainer = trainer_module.Trainer(model, config, batches, None)
        trainer.device_type = "cpu"
        trainer.run_training()
    return latest_checkpoint(save)


def on_this_cpu(trainer_module: Any) -> ExitStack:
    stack = ExitStack()
    stack.enter_context(mock.patch.object(trainer_module, "get_local_rank", lambda: "cpu"))
    stack.enter_context(mock.patch.object(torch.accelerator, "synchronize", lambda *args, **kwargs: None))
    return stack


def latest_checkpoint(save: Path) -> Path:
    return max((path for path in save.iterdir() if path.name.isdigit()), key=lambda path: int(path.name))


def save_draft(model: Any, folder: Path) -> Path:
    """An untrained draft saved as the trainer saves its checkpoints."""
    model.save_pretrained(str(folder))
    return folder
