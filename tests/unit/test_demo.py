"""`eagle3-datagen demo` where it cannot start its vLLM server: one line saying how to get there, nothing started
or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli import demo
from cli.main import main
from eagle3_datagen import run_log


def test_the_demo_outside_a_checkout_says_in_one_line_to_clone_and_run_make_demo(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    installed = tmp_path / "site-packages"  # an installed package's "repository root": no infra/, no build/
    monkeypatch.setattr(demo, "REPO_ROOT", installed)
    monkeypatch.setattr(demo, "LAUNCHER", installed / "infra" / "vllm_cpu" / "launch.py")
    monkeypatch.setattr(demo, "tiny_model_dir", lambda: pytest.fail("the demo went on past its check"))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # so main starts no temporary API
    monkeypatch.setattr(run_log, "silence_prefect_console", lambda: None)  # the console of the other tests
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("clone the repository, then run `make demo` in it\n")
    assert not any(tmp_path.iterdir()), "nothing written, not even the output folder"


def test_a_checkout_without_the_vllm_environment_is_told_to_run_make_setup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    with pytest.raises(demo.DemoNeedsCheckout, match=r"no vLLM python at .*absent/python: run `make setup`"):
        demo.check_checkout()
