"""docs/config-reference.md is generated from the config model: a field added or changed must show there."""

from __future__ import annotations

from pathlib import Path

from eagle3_datagen.config_reference import REGENERATE, render

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def test_the_committed_reference_is_what_the_config_model_renders() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == render(), (
        f"docs/config-reference.md is out of date with eagle3_datagen/config.py: run `{REGENERATE}`")
