"""Shared fixtures: one tiny model and one real vLLM server per session, a temporary Prefect API per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch keeps compiled kernels in /tmp/torchinductor_<user> unless told otherwise: keep them in build/ instead, for
# this process and every server it starts (set before anything imports torch)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "build" / "torchinductor"))

from eagle3_datagen.testing.tiny_model import build_tiny_model
from eagle3_datagen.testing.vllm_server import LocalVLLMServer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$EAGLE3_TINY_MODEL when it is built (`make setup` builds it), else a fresh build (a minute or two)."""
    given = os.environ.get("EAGLE3_TINY_MODEL")
    if given and (Path(given) / "model.safetensors").is_file():
        return Path(given)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServer]:
    """A vLLM CPU server on the tiny model with the qwen3 reasoning parser, served as `tiny`."""
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    with LocalVLLMServer(tiny_model, served_name="tiny", log_path=log_path) as server:
        yield server


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    """A temporary Prefect server for the module's flow runs (`pytestmark = pytest.mark.usefixtures(...)`)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
