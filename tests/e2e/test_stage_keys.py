"""One truth for "done", through the whole flow: an output counts while storage records it under the key computed
now, whatever Prefect's cache or the code's comments say."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_pipeline import config, manifest_of, write_config

from cli.demo import DEMO_MODEL_NAME
from cli.runner import run_pipeline
from eagle3_datagen.storage import RunStore
from eagle3_datagen.testing.scripted_server import Script, ScriptedServer
from eagle3_datagen.think_tokens import load_tokenizer
from tasks.verify import verify_run

pytestmark = pytest.mark.usefixtures("prefect_api")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tiny_model: Path) -> Iterator[ScriptedServer]:
    with ScriptedServer(Script(model=DEMO_MODEL_NAME, tokenizer=load_tokenizer(str(tiny_model)))) as running:
        yield running


def _held_out(run: Path) -> int:
    return sum(row == "holdout" for f in sorted((run / "sequences").glob("shard-*.parquet"))
               for row in pq.read_table(f).column("split").to_pylist())


def test_holdout_changed_and_changed_back_ends_with_the_first_split(tiny_model: Path, server: ScriptedServer,
                                                                     tmp_path: Path) -> None:
    """data.holdout 0, then 0.3, then 0 again: the last run's samples are all in the training split, not those the
    second run wrote (a cache of the first run must not vouch for them)."""
    run = tmp_path / "flow"
    splits = []
    for share in (0.0, 0.3, 0.0):
        run_pipeline(config(tiny_model, server.url, tmp_path, data__holdout=share))
        splits.append(_held_out(run))
    assert splits[0] == splits[2] == 0 and splits[1] > 0
    assert manifest_of(run)["status"] == "completed"
    assert verify_run(RunStore.at(str(run)), deep=True).complete


def test_a_deleted_stage_folder_is_made_again(tiny_model: Path, server: ScriptedServer, tmp_path: Path) -> None:
    run = tmp_path / "flow"
    run_pipeline(config(tiny_model, server.url, tmp_path))
    requests = server.log.requests
    for stage in ("validation", "sequences", "hidden_states"):
        shutil.rmtree(run / stage)
        run_pipeline(config(tiny_model, server.url, tmp_path))
        assert manifest_of(run)["status"] == "completed", stage
        assert (run / stage).is_dir()
    assert server.log.requests == requests, "no answer asked again"
    assert verify_run(RunStore.at(str(run)), deep=True).complete


def test_an_upgrade_that_changes_only_comments_and_structure_redoes_nothing(
        tiny_model: Path, server: ScriptedServer, tmp_path: Path) -> None:
    """The next version of the code (here: a copy whose stage modules gained comments and a renamed helper) and no
    Prefect result cache (the upgrade's): every stage is found done in storage, nothing is extracted again."""
    cfg = config(tiny_model, server.url, tmp_path / "runs")
    run_pipeline(cfg)
    run = tmp_path / "runs" / "flow"
    index = run / "hidden_states" / "shard-00000" / "index.json"
    before = (index.read_bytes(), index.stat().st_mtime_ns)
    requests = server.log.requests

    upgraded = tmp_path / "upgraded"
    for package in ("eagle3_datagen", "tasks", "flows", "cli"):
        shutil.copytree(REPO / package, upgraded / package, ignore=shutil.ignore_patterns("__pycache__"))
    parts = upgraded / "tasks" / "hidden_states" / "parts.py"
    parts.write_text("# reorganised in the next release\n" + parts.read_text().replace("_PartWriter", "PartWriter"))
    sequences = upgraded / "tasks" / "sequences.py"
    sequences.write_text(sequences.read_text() + "\n# a comment the next release adds\n")
    shutil.rmtree(run / ".prefect-results", ignore_errors=True)

    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or ""}
    where = subprocess.run([sys.executable, "-c", "import tasks.hidden_states.parts as p; print(p.__file__)"],
                           cwd=upgraded, capture_output=True, text=True, check=True, env=env)
    assert where.stdout.strip() == str(parts), "the upgraded copy is the code that runs"
    rerun = subprocess.run([sys.executable, "-m", "cli.main", "run", "--config",
                            write_config(tmp_path / "c.yaml", cfg)],
                           cwd=upgraded, capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "work tasks cached: nothing recomputed, no request sent to any server" in rerun.stdout, rerun.stdout
    assert (index.read_bytes(), index.stat().st_mtime_ns) == before, "hidden states extracted again"
    assert server.log.requests == requests
