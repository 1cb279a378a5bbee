"""The Prefect task of stage 6: one shard, either backend.

The backends (torch, transformers) are imported where a shard is extracted: the flow, and a re-run whose shards
are all cached, never load them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3_datagen.artifacts import ShardRef, artifact_path, sha256_hex, worker_record_path
from eagle3_datagen.caching import StageOutput, handed_on
from eagle3_datagen.config import HiddenStatesConfig, PipelineConfig
from eagle3_datagen.errors import ConfigurationError, retry_unless_user_error
from eagle3_datagen.hidden_state_format import check_compression
from eagle3_datagen.storage import RunLocation


@dataclass(frozen=True)
class ExtractionSettings:
    """Everything that changes a shard's hidden states, and so the stage's cache key."""

    hidden_states: HiddenStatesConfig
    target_model: str
    target_fingerprint: str  # new weights at the same path extract again
    trust_remote_code: bool

    @classmethod
    def from_config(cls, config: PipelineConfig, target_fingerprint: str) -> ExtractionSettings:
        return cls(config.hidden_states, config.target_model, target_fingerprint, config.model.trust_remote_code)


# Bump `version` when the parts or the index written for the same sequences and settings change.
HIDDEN_STATES = StageOutput("hidden_states", version=1,
                            record=lambda sequences: artifact_path("hidden_states", sequences.index))


@task(name="extract-hidden-states", task_run_name="{run.run_name}/extract-hidden-states-{sequences.index:05d}",
      retries=1, retry_condition_fn=retry_unless_user_error, persist_result=True,
      cache_policy=NO_CACHE)
def extract_hidden_states(sequences: ShardRef, extraction: ExtractionSettings, run: RunLocation) -> ShardRef:
    """Prefect stage 6 for one shard; a transformers target stays loaded across the shards a process runs. A
    shard whose index was made under this key already is handed on without loading anything.

    Its worker record (host, process, target loads so far in that process) shows where the shard ran and that
    no shard loaded the target twice.
    """
    settings, target_model = extraction.hidden_states, extraction.target_model
    trust_remote_code = extraction.trust_remote_code
    store = run.store()
    rel = artifact_path("hidden_states", sequences.index)
    key = HIDDEN_STATES.key(sequences=sequences, extraction=extraction)
    if (done := HIDDEN_STATES.done(store, sequences, key)) is not None:
        return handed_on(ShardRef("hidden_states", sequences.index, rel, done["num_samples"],
                                  sha256_hex(store.read_bytes(rel))), key)
    check_compression(settings.compression)  # this worker's torch, before a target is loaded or asked
    if settings.backend == "vllm":
        from tasks.hidden_states.vllm_backend import extract_shard_vllm, load_served_target

        index = extract_shard_vllm(store, sequences, load_served_target(target_model), settings, key)
    elif settings.backend == "transformers":
        from tasks.hidden_states.targets import resolve_aux_layers, target_num_layers
        from tasks.hidden_states.transformers_backend import extract_shard, load_target_model, target_loads

        layers = target_num_layers(target_model, trust_remote_code)
        resolve_aux_layers(settings.aux_layers, layers)  # before loading any weights
        target = load_target_model(target_model, settings.dtype, settings.device_map, trust_remote_code)
        index = extract_shard(store, sequences, target, settings, key)
        store.write_json(worker_record_path(sequences.index),
                         {"host": socket.gethostname(), "pid": os.getpid(), "target_loads_in_process": target_loads()})
    else:
        raise ConfigurationError(f"config key hidden_states.backend: {settings.backend!r} extracts nothing")
    return ShardRef(
        stage="hidden_states",
        index=sequences.index,
        path=rel,
        num_records=index["num_samples"],
        sha256=sha256_hex(store.read_bytes(rel)),
    )
