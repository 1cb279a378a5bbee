"""What keeps a run exact before and after generation: request fields a config may not override, servers judged by
what they send (token ids, usage counts), and validation's thresholds on text the server's parser changed."""

from __future__ import annotations

import pytest

from eagle3_datagen.config import ValidationConfig, parse_config
from eagle3_datagen.diagnosis import ServerCheckFailed, check_form, reasoning_facts
from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.protocol import Completion
from eagle3_datagen.think_tokens import ThinkTokenSpec
from tasks.validation import validate_records

KIMI = BUILTIN_PROFILES["kimi-k2.5"]
COUNTS = {"prompt_tokens": 9, "completion_tokens": 12}


def _config(**generation: object) -> dict[str, object]:
    return {"run_name": "r", "data": {"source": "d.jsonl"}, "generation": generation,
            "model": {"name": "m", "profile": "kimi-k2.5", "tokenizer": "t"}}


@pytest.mark.parametrize(("key", "fix"), [("return_token_ids", "sequences.source decides"),
                                          ("chat_template_kwargs", "define a profile under `profiles:`"),
                                          ("max_tokens", "set generation.max_tokens"), ("model", "model.name")])
def test_extra_body_may_not_override_a_field_the_request_owns(key: str, fix: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        parse_config(_config(extra_body={key: False}))
    message = str(refused.value)
    assert "generation.extra_body" in message and repr(key) in message and fix in message
    assert "\n" not in message


def test_extra_body_keeps_fields_of_its_own() -> None:
    config = parse_config(_config(extra_body={"structured_outputs": {"regex": "a+"}}))
    assert config.generation.extra_body == {"structured_outputs": {"regex": "a+"}}


def _answer(ids: bool = True, usage: dict[str, int] | None = None) -> Completion:
    return Completion("thinking", "answer", "stop", "reasoning_content", [1, 2] if ids else None,
                      [3, 4] if ids else None, COUNTS if usage is None else usage, "m")


def test_a_server_without_token_ids_is_used_through_the_text_rebuild() -> None:
    check_form("http://sglang:30000", ["m"], _answer(ids=False), KIMI, allow_inline=False, sequence_source="auto")
    facts = reasoning_facts([_answer(ids=False)], "auto")
    assert facts["sequence_source"] == "text" and facts["token_ids_returned"] is False
    assert reasoning_facts([_answer()], "auto")["sequence_source"] == "server"
    assert reasoning_facts([_answer()], "text")["sequence_source"] == "text"


def test_answers_of_modes_without_reasoning_say_nothing_of_where_reasoning_arrives() -> None:
    instant = Completion("", "answer", "stop", "none", [1], [2], COUNTS, "m")
    assert reasoning_facts([instant, instant])["reasoning_field"] is None
    assert reasoning_facts([instant, _answer()])["reasoning_field"] == "reasoning_content"


def test_a_server_without_token_ids_is_refused_only_when_its_ids_are_asked_for() -> None:
    with pytest.raises(ServerCheckFailed) as refused:
        check_form("http://sglang:30000", ["m"], _answer(ids=False), KIMI, allow_inline=False,
                   sequence_source="server")
    assert "set sequences.source: auto" in str(refused.value)
    assert "SGLang and hosted APIs do not send it" in str(refused.value)


def test_a_server_without_ids_or_usage_counts_is_refused_naming_the_fix() -> None:
    with pytest.raises(ServerCheckFailed, match=r"neither token ids nor usage counts .* use a server that reports"):
        check_form("https://api.example.com", ["m"], _answer(ids=False, usage={}), KIMI, allow_inline=False)


SPEC = ThinkTokenSpec(think_start="<think>", think_end="</think>", end_of_turn="<|im_end|>", start_id=1, end_id=2,
                      end_of_turn_id=3, template_writes_start_tag=True, generation_prompt_suffix="<think>")


def _record(i: int, content: str = "answer", ids: list[int] | None = None) -> dict[str, object]:
    return {"id": f"r{i}", "reasoning": "thinking", "content": content, "finish_reason": "stop",
            "completion_token_ids": ids if ids is not None else [7, 2, 8, 3]}


def _decode(ids: list[int]) -> str:
    words = {7: "thinking", 2: "</think>", 8: "answer", 3: "<|im_end|>"}
    return "".join(words[i] for i in ids)


def test_leaked_tags_above_their_threshold_quarantine_the_shard() -> None:
    records = [_record(i) for i in range(98)] + [_record(98, "a</think>b"), _record(99, "<think>c")]
    report = validate_records(0, records, KIMI, ValidationConfig(), _decode, SPEC)
    assert report.leaked_tags == 2 and report.status == "quarantine"
    assert "leaked_tags rate 2.0% > validation.max_leaked_tags_rate 1.0%" in report.reasons


def test_ids_with_a_second_think_end_are_counted_and_quarantine_the_shard() -> None:
    """The parser removed a second `</think>` from the answer text: the text looks clean, the ids do not."""
    records = [_record(i) for i in range(8)] + [_record(8, ids=[7, 2, 8, 2, 3])]
    report = validate_records(0, records, KIMI, ValidationConfig(), _decode, SPEC)
    assert report.leaked_tags == 0 and report.think_end_miscount == 1 and report.token_text_mismatch == 1
    assert report.status == "quarantine"
    assert any(r.startswith("think_end_miscount rate 11.1% > validation.max_token_text_mismatch_rate")
               for r in report.reasons)


def test_a_clean_shard_passes_every_exactness_threshold() -> None:
    report = validate_records(0, [_record(i) for i in range(20)], KIMI, ValidationConfig(), _decode, SPEC)
    assert (report.status, report.think_end_miscount, report.token_text_mismatch) == ("pass", 0, 0)


def test_reasoning_never_closed_is_counted_but_is_not_a_mismatch() -> None:
    """The model ended its turn inside its reasoning: what it did, exactly; counted, not quarantined."""
    unclosed = {"id": "u", "reasoning": "thinking", "content": "", "finish_reason": "stop",
                "completion_token_ids": [7, 3]}
    report = validate_records(0, [_record(i) for i in range(9)] + [unclosed], KIMI, ValidationConfig(), _decode,
                              SPEC)
    assert (report.unclosed_reasoning, report.think_end_miscount, report.token_text_mismatch) == (1, 0, 0)
    assert report.status == "pass"


def test_a_shard_whose_model_often_never_closed_its_reasoning_is_quarantined() -> None:
    """Kept one by one, as what the model did; a shard full of them is a model or template that is broken."""
    unclosed = [_record(i, ids=[7, 8, 3]) for i in range(7, 10)]  # reasoning and answer, no think-end id
    report = validate_records(0, [_record(i) for i in range(7)] + unclosed, KIMI, ValidationConfig(), _decode, SPEC)
    assert report.status == "quarantine"
    assert report.reasons == ["unclosed_reasoning rate 30.0% > validation.max_unclosed_reasoning_rate 10.0%"]
    assert report.as_dict()["rates"]["unclosed_reasoning"] == 0.3
    allowed = validate_records(0, [_record(i) for i in range(7)] + unclosed, KIMI,
                               ValidationConfig(max_unclosed_reasoning_rate=0.5), _decode, SPEC)
    assert allowed.status == "pass"


def test_a_tokenizer_that_ships_its_own_code_is_refused_naming_the_fix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from eagle3_datagen.think_tokens import ThinkTokenError, load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["tok.OwnTokenizer", null]}, "tokenizer_class": "OwnTokenizer"}')
    (tmp_path / "tok.py").write_text("from transformers import PreTrainedTokenizer\n\n\n"
                                     "class OwnTokenizer(PreTrainedTokenizer):\n    pass\n")
    with pytest.raises(ThinkTokenError) as refused:
        load_tokenizer(str(tmp_path))
    assert "ships its own code" in str(refused.value) and "tokenizer.json" in str(refused.value)
