"""Held-out prompts: chosen by a salted hash, at least a minimum per mode, stable, a conversation whole."""

from __future__ import annotations

from pathlib import Path

from test_prompts import question, write_rows

from eagle3_datagen.config import DataConfig
from eagle3_datagen.holdout import HoldoutChooser, HoldoutSplit
from eagle3_datagen.modes import ModeWeight, assign_mode
from eagle3_datagen.storage import RunStore
from tasks.prompts import build_prompt_shards

MIX = [ModeWeight(mode="thinking", weight=0.9), ModeWeight(mode="instant", weight=0.1)]


def choose(ids: list[str], share: float, minimum: int) -> HoldoutSplit:
    chooser = HoldoutChooser(share, minimum)
    for prompt_id in ids:
        chooser.add(prompt_id, assign_mode(prompt_id, MIX))
    return chooser.split()


def held_out(split: HoldoutSplit, ids: list[str]) -> set[str]:
    return {i for i in ids if split.split_of(i, assign_mode(i, MIX)) == "holdout"}


def test_the_share_is_held_out_in_every_mode_independently_of_the_mode_draw() -> None:
    ids = [f"prompt-{i}" for i in range(20_000)]
    split = choose(ids, share=0.05, minimum=0)
    chosen = held_out(split, ids)
    for mode in ("thinking", "instant"):
        in_mode = [i for i in ids if assign_mode(i, MIX) == mode]
        share = len(chosen.intersection(in_mode)) / len(in_mode)
        assert 0.04 < share < 0.06, (mode, share)  # a hash shared with the mode draw would skew one mode
    assert split.prompts == {mode: len([i for i in chosen if assign_mode(i, MIX) == mode]) for mode in split.prompts}


def test_a_rare_mode_keeps_its_minimum_and_a_small_run_keeps_three_quarters_for_training() -> None:
    ids = [f"prompt-{i}" for i in range(2_000)]  # ~200 instant prompts: 1 % would be ~2
    split = choose(ids, share=0.01, minimum=20)
    chosen = held_out(split, ids)
    assert sum(assign_mode(i, MIX) == "instant" for i in chosen) == 20 == split.prompts["instant"]
    assert split.cuts["thinking"] == 0.01  # 1 % of ~1,800 is 18 < 20: raised too
    small = [f"small-{i}" for i in range(12)]
    few = choose(small, share=0.01, minimum=20)
    assert len(held_out(few, small)) == sum(few.prompts.values()) <= 3  # a quarter of each mode at most


def test_a_share_of_zero_holds_out_nothing_whatever_the_minimum() -> None:
    ids = [f"prompt-{i}" for i in range(400)]
    split = choose(ids, share=0.0, minimum=20)
    assert not held_out(split, ids) and sum(split.prompts.values()) == 0


def test_the_split_is_the_same_for_the_same_prompts_in_any_order() -> None:
    ids = [f"prompt-{i}" for i in range(3_000)]
    first, second = choose(ids, 0.01, 20), choose(list(reversed(ids)), 0.01, 20)
    assert first == second and held_out(first, ids) == held_out(second, ids)
    assert HoldoutSplit.model_validate_json(first.model_dump_json()) == first  # as recorded with the run


def test_the_prompt_stage_chooses_and_records_the_split(tmp_path: Path) -> None:
    source = write_rows(tmp_path / "q.jsonl", [question(i) for i in range(400)])
    store = RunStore(str(tmp_path / "runs"), "r")
    result = build_prompt_shards(DataConfig(source=str(source), holdout=0.01, holdout_min_per_mode=10), store,
                                 modes=MIX)
    ids = [record["id"] for ref in result.shards for record in store.read_jsonl(ref.path)]
    assert sum(result.holdout.prompts.values()) == len(held_out(result.holdout, ids)) >= 20
    assert store.read_json("prompts/summary.json")["holdout"] == result.holdout.model_dump()
