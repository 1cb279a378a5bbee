"""vLLM's hidden-states KV connector for a CPU-only server: the stock one, writing each file synchronously.

Runs inside the vLLM server, which loads it through `--kv-transfer-config` with
`"kv_connector": "CPUHiddenStatesConnector"` and
`"kv_connector_module_path": "eagle3_hidden_states_connector"` (this folder, `infra/vllm_cpu/`, on the server's
PYTHONPATH). It runs in vLLM's environment, where this project is not installed, so it imports only vLLM,
torch, safetensors and the standard library.

Why: vLLM's `ExampleHiddenStatesConnector` copies a finished request's states out of the cache on a CUDA stream into
pinned host memory and writes the file from a thread pool; a CPU-only host has neither streams nor pinned memory.
This subclass reads the states out of the (host) cache and writes the file within the engine step that finishes
the request. Everything else is the stock connector's: the file (`hidden_states` [T, n_layers, H], `token_ids` [T]),
its path in the response's `kv_transfer_params.hidden_states_path`, and the exclusive flock on `<file>.lock` that is
taken before the response leaves and released once the file is complete. Use the stock connector on GPUs.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """Stands in for the stock connector's per-request copy event, which it polls: a synchronous write is done."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector without CUDA streams, pinned memory or writer threads."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Write the request's file now, then release the lock that readers wait on."""
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hidden-states cache not registered: register_kv_caches was never called")
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers blocked on LOCK_SH go on
        self._req_copy_events[pending.req_id] = _Written()
