"""Shared fixtures: one tiny model, one real vLLM server and one S3 server per session, a temporary Prefect API
per module."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from built_models import built_model

# torch keeps compiled kernels in /tmp/torchinductor_<user> unless told otherwise: keep them in build/ instead, for
# this process and every server it starts (set before anything imports torch)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / "build" / "torchinductor"))

from eagle3_datagen.testing.tiny_model import build_tiny_model
from eagle3_datagen.testing.vllm_server import LocalVLLMServer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reasoning model (a fresh build takes a minute or two)."""
    return built_model("EAGLE3_TINY_MODEL", lambda: build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


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


@pytest.fixture(scope="session")
def ceph_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-node Ceph cluster's folder (its ceph.conf names its daemons)."""
    return tmp_path_factory.mktemp("ceph")


@pytest.fixture(scope="session")
def s3_endpoint(ceph_folder: Path) -> Iterator[str]:
    """A real S3 server: a one-node Ceph cluster with a RADOS Gateway (infra/ceph-rgw), credentials in env.

    One per session, defined here: every module that needs S3 shares it (it listens on fixed ports)."""
    folder = ceph_folder
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "eagle3test", "AWS_SECRET_ACCESS_KEY": "eagle3testsecret"}
    started = subprocess.run(["bash", str(REPO / "infra/ceph-rgw/start.sh"), str(folder), "7481"], env=env,
                             capture_output=True, text=True, timeout=180)
    try:
        assert started.returncode == 0, f"Ceph RGW did not start: {started.stderr[-2000:]}"
        endpoint = started.stdout.strip().splitlines()[-1]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AWS_ACCESS_KEY_ID", "eagle3test")
            patch.setenv("AWS_SECRET_ACCESS_KEY", "eagle3testsecret")
            patch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
            patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir("eagle3-test")
            yield endpoint
    finally:
        subprocess.run(["bash", str(REPO / "infra/ceph-rgw/stop.sh"), str(folder)], check=False, timeout=60)
