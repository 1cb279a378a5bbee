"""Thinking-mode mixes: which prompt is asked in which mode, how each mode is switched on, and each record held to
its own mode by the early-abort test, validation and the sequences (on the tiny Qwen3-style template here; the real
Kimi-K2.5 vocabulary in test_sequences.py)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from early_abort_answers import answer, judge

from eagle3_datagen.config import GenerationConfig, SequencesConfig, ValidationConfig, parse_config
from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.modes import ModeSpec, ModeWeight, assign_mode
from eagle3_datagen.profiles import BUILTIN_PROFILES, ModelProfile
from eagle3_datagen.protocol import Completion, build_chat_request
from eagle3_datagen.think_tokens import ThinkTokenSpec, discover_think_tokens, load_tokenizer
from tasks.generation.records import GenerationSettings, Prompt, new_records
from tasks.sequences import build_sequences, cross_checked
from tasks.validation import validate_records

KIMI, QWEN3 = BUILTIN_PROFILES["kimi-k2.5"], BUILTIN_PROFILES["qwen3"]
MIX = [ModeWeight(mode="thinking", weight=0.7), ModeWeight(mode="instant", weight=0.3)]
IDS = [f"{n:016x}" for n in range(10_000)]


def _config(modes: object, profile: str = "kimi-k2.5", **tree: Any) -> Any:
    return parse_config({"run_name": "r", "data": {"source": "d.jsonl"}, "generation": {"modes": modes},
                         "model": {"name": "m", "profile": profile, "tokenizer": "t"}, **tree})


def test_a_prompts_mode_is_a_pure_function_of_its_id_and_the_mix() -> None:
    assert [assign_mode(i, MIX) for i in IDS[:200]] == [assign_mode(i, list(MIX)) for i in IDS[:200]]
    # pinned: a mode must not move between machines, versions or re-runs (a resumed run asks each prompt again
    # in the mode it was asked in before)
    assert [assign_mode(i, MIX) for i in IDS[:8]] == ["thinking", "thinking", "thinking", "thinking", "instant",
                                                       "thinking", "thinking", "thinking"]


def test_shares_follow_the_weights_and_a_zero_weight_is_never_asked() -> None:
    counts = Counter(assign_mode(i, MIX) for i in IDS)
    assert abs(counts["instant"] / len(IDS) - 0.3) < 0.02
    efforts = [ModeWeight(mode="high", weight=2), ModeWeight(mode="medium", weight=0), ModeWeight(mode="low", weight=1)]
    counts = Counter(assign_mode(i, efforts) for i in IDS)
    assert counts["medium"] == 0 and abs(counts["low"] / len(IDS) - 1 / 3) < 0.02


def test_the_mode_split_is_independent_of_the_cross_check_sample() -> None:
    """Both are drawn from the prompt id: unsalted, a 10% cross-check would hold thinking prompts only."""
    checked = [i for i in IDS if cross_checked(i, 0.1)]
    share = Counter(assign_mode(i, MIX) for i in checked)["instant"] / len(checked)
    assert abs(share - 0.3) < 0.06


@pytest.mark.parametrize(("modes", "message"), [
    ([{"mode": "fast", "weight": 1}], "profile 'kimi-k2.5' has no mode 'fast': use one of thinking, instant"),
    ([{"mode": "thinking", "weight": 1}, {"mode": "thinking", "weight": 2}], "lists mode 'thinking' twice"),
    ([{"mode": "thinking", "weight": 1}, {"mode": "instant", "weight": -0.5}],
     "mode 'instant' has weight -0.5: weights must be >= 0"),
    ([{"mode": "thinking", "weight": 0}], "weights sum to 0: give at least one mode a positive weight"),
    ([], "is empty: list at least one mode with its weight"),
])
def test_a_bad_mix_is_one_line_naming_the_fix(modes: object, message: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        _config(modes)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_profile_sets_its_switches_in_one_place() -> None:
    both = {"reasoning_parser": "qwen3", "end_of_turn": "<|im_end|>", "template_writes_start_tag": False,
            "chat_template_kwargs": {"enable_thinking": True}, "modes": {"thinking": {}}}
    with pytest.raises(ConfigurationError, match="a profile with `modes` sets its switches there: move "
                                                 "chat_template_kwargs into a mode"):
        _config(None, "mine", profiles={"mine": both})


def test_profiles_name_their_modes() -> None:
    assert list(KIMI.mode_specs) == ["thinking", "instant"] and KIMI.default_mode == "thinking"
    assert KIMI.mode("instant") == ModeSpec(chat_template_kwargs={"thinking": False}, reasoning="absent")
    assert list(BUILTIN_PROFILES["gpt-oss"].mode_specs) == ["high", "medium", "low"]
    assert list(BUILTIN_PROFILES["deepseek-r1"].mode_specs) == ["thinking"]
    assert _config([{"mode": "low", "weight": 1}, {"mode": "high", "weight": 1}], "gpt-oss").generation.modes


def test_without_a_mix_settings_records_and_requests_are_as_before_mixes_existed() -> None:
    """Pinned fingerprints (computed before modes existed): a run recorded then resumes under this version."""
    fingerprints = {name: GenerationSettings("m", BUILTIN_PROFILES[name], GenerationConfig(), "d.jsonl").fingerprint()
                    for name in ("kimi-k2.5", "qwen3")}
    assert fingerprints == {"kimi-k2.5": "7c483d8447f1609a0a351d690128f44b17d9681768fe00ac04bb764f0414d00f",
                            "qwen3": "d41db27a5cb07f7399b1a50329c67668cb73f3838be90a6482571a07be13ee65"}
    assert "modes" not in GenerationConfig().model_dump() and "modes" not in KIMI.model_dump()
    settings = GenerationSettings("m", KIMI, GenerationConfig(), "d.jsonl")
    assert settings.mode_of("abc") is None
    done = Completion("r", "c", "stop", "reasoning", [1], [2], {}, "m")
    assert "mode" not in new_records(Prompt(0, 0, "abc", [], None), [done])[0]
    assert new_records(Prompt(0, 0, "abc", [], None, "instant"), [done])[0]["mode"] == "instant"
    mixed = GenerationSettings("m", KIMI, GenerationConfig(modes=MIX), "d.jsonl")
    assert mixed.fingerprint() != settings.fingerprint(), "changing the mix is changing the settings"


def test_each_mode_is_switched_on_its_own_way() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = build_chat_request("m", messages, KIMI.mode(None), GenerationConfig())
    assert body["chat_template_kwargs"] == {"thinking": True} and "reasoning_effort" not in body
    assert build_chat_request("m", messages, KIMI.mode("instant"), GenerationConfig())["chat_template_kwargs"] == \
        {"thinking": False}
    low = build_chat_request("m", messages, BUILTIN_PROFILES["gpt-oss"].mode("low"), GenerationConfig())
    assert low["reasoning_effort"] == "low" and "chat_template_kwargs" not in low
    prompted = ModelProfile(reasoning_parser="qwen3", end_of_turn="<|im_end|>", template_writes_start_tag=False,
                            modes={"thinking": ModeSpec(),
                                   "terse": ModeSpec(system_prompt="/no_think", reasoning="absent")})
    with_system = [{"role": "system", "content": "Be kind."}, *messages]
    assert build_chat_request("m", with_system, prompted.mode("terse"), GenerationConfig())["messages"] == [
        {"role": "system", "content": "/no_think\n\nBe kind."}, *messages]
    assert build_chat_request("m", messages, prompted.mode("terse"), GenerationConfig())["messages"] == [
        {"role": "system", "content": "/no_think"}, *messages]


def test_a_mixed_run_goes_on_once_both_modes_answer_in_their_form() -> None:
    outcomes = [answer("thinking…", "thinking"), answer("", "instant")] * 16
    probation, seen = judge(outcomes, profile=KIMI, modes=["thinking", "instant"])
    assert probation.passed and seen == 14, "seven good answers of each mode"


def test_an_ignored_instant_switch_stops_the_run_early_naming_the_switch() -> None:
    outcomes = [answer("thinking…", "thinking"), answer("thinking anyway…", "instant")] * 16
    probation, seen = judge(outcomes, profile=KIMI, modes=["thinking", "instant"])
    assert seen == 6 and probation.error is not None
    assert str(probation.error).startswith("early abort: 3 of the first 3 records asked in mode instant carry "
                                           "reasoning")
    assert "instant: {'thinking': False}) is ignored" in str(probation.error)


def test_an_instant_only_run_is_not_held_to_reasoning() -> None:
    probation, seen = judge([answer("", "instant")] * 32, profile=KIMI, modes=["instant"])
    assert probation.passed and seen == 7


SPEC = ThinkTokenSpec(think_start="<think>", think_end="</think>", end_of_turn="<|im_end|>", start_id=1, end_id=2,
                      end_of_turn_id=3, template_writes_start_tag=True, generation_prompt_suffix="<think>")
WORDS = {7: "thinking", 2: "</think>", 8: "answer", 3: "<|im_end|>"}


def _record(i: int, mode: str, reasoning: str, ids: list[int]) -> dict[str, object]:
    return {"id": f"r{i}", "reasoning": reasoning, "content": "answer", "finish_reason": "stop", "mode": mode,
            "completion_token_ids": ids}


def test_validation_holds_each_record_to_its_own_mode() -> None:
    thinking = [_record(i, "thinking", "thinking", [7, 2, 8, 3]) for i in range(20)]
    instant = [_record(100 + i, "instant", "", [8, 3]) for i in range(10)]
    decode = lambda ids: "".join(WORDS[i] for i in ids)  # noqa: E731
    report = validate_records(0, thinking + instant, KIMI, ValidationConfig(), decode, SPEC)
    assert report.status == "pass", report.reasons
    assert (report.unclosed_reasoning, report.token_text_mismatch, report.empty_reasoning) == (0, 0, 0)
    assert report.records_by_mode == {"thinking": 20, "instant": 10}

    unswitched = [*instant[:9], _record(200, "instant", "thinking", [7, 2, 8, 3])]
    report = validate_records(0, thinking + unswitched, KIMI, ValidationConfig(), decode, SPEC)
    assert (report.unexpected_reasoning, report.think_end_miscount, report.status) == (1, 1, "quarantine")
    assert "unexpected_reasoning rate 10.0% > validation.max_unexpected_reasoning_rate 5.0%" in report.reasons
    assert report.as_dict()["rates"]["unexpected_reasoning"] == 0.1, "of the instant records, not of all"


@pytest.fixture(scope="module")
def qwen() -> Any:
    folder = Path(os.environ.get("EAGLE3_TINY_MODEL", "build/tiny-model"))
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the tiny model is not built ($EAGLE3_TINY_MODEL)")
    return load_tokenizer(str(folder))


def test_qwen3_sequences_are_exact_in_each_mode(qwen: Any) -> None:
    """Thinking: the model writes `<think>`; instant: the template pre-fills `<think>\\n\\n</think>\\n\\n`."""
    spec = discover_think_tokens(qwen, QWEN3)
    encode = lambda text: qwen(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    records = []
    for mode, reasoning, completion in (
            ("thinking", "\nParis is the capital.\n", "<think>\nParis is the capital.\n</think>\n\nParis.<|im_end|>"),
            ("instant", "", "Paris.<|im_end|>")):
        prompt = encode(qwen.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=mode == "thinking"))
        served = {"prompt_token_ids": prompt, "completion_token_ids": encode(completion)}
        records.append({"id": mode, "messages": messages, "reasoning": reasoning,
                        "content": "\n\nParis." if mode == "thinking" else "Paris.", "finish_reason": "stop",
                        "mode": mode, **served})
    shard = build_sequences(records, qwen, QWEN3, spec, SequencesConfig(cross_check_rate=1.0))
    assert shard.rejected == []
    thinking, instant = shard.sequences
    assert (thinking.agrees, instant.agrees) == (True, True)
    assert (thinking.mode, instant.mode) == ("thinking", "instant")
    assert qwen.decode(instant.input_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nParis.<|im_end|>")
    assert spec.start_id not in instant.input_ids[-3:] and instant.input_ids.count(spec.end_id) == 1
    supervised = [t for t, m in zip(instant.input_ids, instant.loss_mask, strict=True) if m]
    assert qwen.decode(supervised) == "Paris.<|im_end|>", "the template's empty think block is prompt, not target"
