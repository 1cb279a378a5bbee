"""Exact token sequences with the model's own think tokens, proven on the real Kimi-K2.5 vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from eagle3_datagen.config import SequencesConfig
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.storage import RunStore
from eagle3_datagen.think_tokens import ThinkTokenError, discover_think_tokens, load_tokenizer
from tasks.sequences import build_sequences, to_parquet, to_table, whole_prompts

KIMI_DIR = Path(__file__).resolve().parents[3] / "shared" / "tokenizers" / "kimi-k2.5"
KIMI = BUILTIN_PROFILES["kimi-k2.5"]
THINK, END_THINK, IM_END, IM_USER, IM_ASSISTANT, IM_MIDDLE = 163606, 163607, 163586, 163587, 163588, 163601

pytestmark = pytest.mark.skipif(not KIMI_DIR.is_dir(), reason="../shared/tokenizers/kimi-k2.5 is absent")


@pytest.fixture(scope="module")
def kimi():  # type: ignore[no-untyped-def]
    return load_tokenizer(str(KIMI_DIR))


@pytest.fixture(scope="module")
def spec(kimi):  # type: ignore[no-untyped-def]
    return discover_think_tokens(kimi, KIMI)


def _record(question: str, reasoning: str, content: str, finish: str = "stop", **extra: object) -> dict:
    return {"id": "s1", "messages": [{"role": "user", "content": question}], "reasoning": reasoning,
            "content": content, "finish_reason": finish, **extra}


def _served(kimi, record: dict, generated_reasoning: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    """The record with the usage counts a server reports: its template's prompt, and the tokens the model
    generated (`generated_reasoning` when the parser changed the reasoning text afterwards)."""
    prompt = kimi.apply_chat_template(record["messages"], add_generation_prompt=True, thinking=True,
                                      return_dict=True)["input_ids"]
    reasoning = record["reasoning"] if generated_reasoning is None else generated_reasoning
    completion = kimi.encode(reasoning, add_special_tokens=False)
    if record["finish_reason"] == "stop":
        completion += [END_THINK, *kimi.encode(record["content"], add_special_tokens=False), IM_END]
    return {**record, "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}}


def _build(kimi, spec, records, **settings):  # type: ignore[no-untyped-def]
    """Sequences and rejections of records served with honest usage counts (unless a record brings its own)."""
    served = [record if "usage" in record else _served(kimi, record) for record in records]
    shard = build_sequences(served, kimi, KIMI, spec, SequencesConfig(**{"cross_check_rate": 1.0, **settings}))
    return shard.sequences, shard.rejected


def test_kimi_think_tokens_are_discovered_and_proven(spec) -> None:  # type: ignore[no-untyped-def]
    assert (spec.start_id, spec.end_id, spec.end_of_turn_id) == (THINK, END_THINK, IM_END)
    assert spec.template_writes_start_tag is True


def test_probe_tokenizer_command_prints_the_ids(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["probe-tokenizer", str(KIMI_DIR), "--profile", "kimi-k2.5"]) == 0
    out = capsys.readouterr().out
    assert '"start_id": 163606' in out and '"end_id": 163607' in out and '"template_writes_start_tag": true' in out


def test_a_tokenizer_without_single_token_tags_is_a_clear_error(kimi) -> None:  # type: ignore[no-untyped-def]
    profile = KIMI.model_copy(update={"think_start": "<reasoning>"})
    with pytest.raises(ThinkTokenError, match=r"encodes the think start tag '<reasoning>' as \d+ tokens"):
        discover_think_tokens(kimi, profile)


def test_rebuilt_ids_equal_hand_computed_ids(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    enc = lambda text: kimi.encode(text, add_special_tokens=False)  # noqa: E731
    [sequence], rejected = _build(kimi, spec, [_record("What is 2+2?", "Two plus two.", "4")])
    prompt = [IM_USER, *enc("user"), IM_MIDDLE, *enc("What is 2+2?"), IM_END,
              IM_ASSISTANT, *enc("assistant"), IM_MIDDLE, THINK]
    completion = [*enc("Two plus two."), END_THINK, *enc("4"), IM_END]
    assert rejected == []
    assert sequence.input_ids == prompt + completion
    assert sequence.loss_mask == [0] * len(prompt) + [1] * len(completion)
    assert sequence.source == "text" and sequence.agrees is None


def test_end_tag_is_one_id_exactly_once_in_the_masked_part(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    records = [_record(f"q{i}", f"thought {i}\n", f"answer {i}") for i in range(5)]
    sequences, _ = _build(kimi, spec, records)
    for sequence in sequences:
        masked = [t for t, m in zip(sequence.input_ids, sequence.loss_mask, strict=True) if m]
        assert masked.count(END_THINK) == 1
        assert masked[-1] == IM_END


def test_the_template_trap_is_shown_and_avoided(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    reasoning = "Carefully adding: 2 and 2 make 4."
    whole = kimi.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": reasoning}],
        tokenize=False)
    assert "<think></think>4" in whole and reasoning not in whole, "the template drops completed-turn reasoning"
    [sequence], _ = _build(kimi, spec, [_record("2+2?", reasoning, "4")])
    assert reasoning in kimi.decode(sequence.input_ids)


def test_server_ids_win_and_disagreement_is_located(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    """A literal `</think>` written by the model is several tokens in its ids; re-encoded from text it becomes the
    think-end id: the text rebuild is refused (two think-end ids), the server's ids are kept and the first
    difference is located."""
    record = _record("Say </think> please", "I must write </think> as text.", "ok")
    [plain], _ = _build(kimi, spec, [_record("Say </think> please", "x", "ok")])
    prompt = plain.input_ids[: plain.loss_mask.index(1)]
    spelled = kimi.encode("I must write ", add_special_tokens=False) + kimi.encode("</", add_special_tokens=False) \
        + kimi.encode("think> as text.", add_special_tokens=False)
    server_completion = [*spelled, END_THINK, *kimi.encode("ok", add_special_tokens=False), IM_END]
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(server_completion)}
    _, [refused] = _build(kimi, spec, [{**record, "usage": usage}], source="text")
    assert "think-end" in refused["reason"] or "counts" in refused["reason"], refused
    record = {**record, "prompt_token_ids": prompt, "completion_token_ids": server_completion, "usage": usage}
    [sequence], rejected = _build(kimi, spec, [record])
    assert rejected == [] and sequence.source == "server"
    assert sequence.input_ids == prompt + server_completion
    assert sequence.agrees is False
    assert sequence.first_diff == len(prompt) + len(kimi.encode("I must write ", add_special_tokens=False))


def test_server_ids_that_match_the_text_agree(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    [text_only], _ = _build(kimi, spec, [_record("hello", "hmm", "hi")])
    cut = text_only.loss_mask.index(1)
    record = _record("hello", "hmm", "hi", prompt_token_ids=text_only.input_ids[:cut],
                     completion_token_ids=text_only.input_ids[cut:])
    [sequence], _ = _build(kimi, spec, [record])
    assert (sequence.source, sequence.agrees, sequence.first_diff) == ("server", True, None)


def test_literal_think_in_user_text_is_the_think_id_but_never_supervised(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    [sequence], _ = _build(kimi, spec, [_record("What does <think> mean?", "A tag.", "A tag.")])
    user_part = sequence.input_ids[: sequence.loss_mask.index(1) - 1]
    assert THINK in user_part[:-1], "Kimi's tokenizer (like the server) encodes a literal <think> as its id"
    assert all(m == 0 for m in sequence.loss_mask[: len(user_part)])


@pytest.mark.parametrize(
    ("reasoning", "content"),
    [("\n\nleading and trailing newlines\n\n", "answer"), ("Ünïcödé ✓ 数学 🤖🚀", "réponse 🎉"), ("only thoughts", "")],
    ids=["newlines", "non-ascii-emoji", "empty-content"],
)
def test_text_round_trips_exactly(kimi, spec, reasoning: str, content: str) -> None:  # type: ignore[no-untyped-def]
    [sequence], _ = _build(kimi, spec, [_record("q", reasoning, content)])
    masked = [t for t, m in zip(sequence.input_ids, sequence.loss_mask, strict=True) if m]
    assert kimi.decode(masked) == f"{reasoning}</think>{content}<|im_end|>"


def test_truncated_thinking_has_no_end_tag_and_no_end_of_turn(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    [sequence], _ = _build(kimi, spec, [_record("q", "a very long thought that was cut", "", finish="length")])
    masked = [t for t, m in zip(sequence.input_ids, sequence.loss_mask, strict=True) if m]
    assert END_THINK not in masked and IM_END not in masked


def test_start_tag_supervision_is_a_choice(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    [default], _ = _build(kimi, spec, [_record("q", "r", "c")])
    [supervised], _ = _build(kimi, spec, [_record("q", "r", "c")], supervise_template_start_tag=True)
    start = default.input_ids.index(THINK)
    assert (default.loss_mask[start], supervised.loss_mask[start]) == (0, 1)


def test_length_policy_drops_or_truncates_and_counts(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    records = [_record("short", "r", "c"), {**_record("long " * 50, "r " * 50, "c"), "id": "long"}]
    kept, rejected = _build(kimi, spec, records, max_seq_len=40)
    assert [s.id for s in kept] == ["s1"] and rejected[0]["id"] == "long" and "max_seq_len 40" in rejected[0]["reason"]
    truncated, none = _build(kimi, spec, records, max_seq_len=40, over_length="truncate")
    assert none == [] and len(truncated[1].input_ids) == len(truncated[1].loss_mask) == 40


def test_parquet_loads_with_datasets(kimi, spec, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import datasets

    sequences, _ = _build(kimi, spec, [_record("q", "r", "c"), {**_record("q2", "r2", "c2"), "id": "s2"}])
    store = RunStore(str(tmp_path), "run")
    store.write_bytes("sequences/shard-00000.parquet", to_parquet([to_table(sequences[:1]), to_table(sequences[1:])]))
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "run/sequences/*.parquet"), split="train")
    assert loaded["id"] == ["s1", "s2"]
    assert loaded[0]["input_ids"] == sequences[0].input_ids and loaded[0]["num_tokens"] == len(sequences[0].input_ids)


def test_a_text_rebuild_is_kept_only_when_the_servers_counts_agree(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    """vLLM's kimi_k2 parser strips trailing whitespace from the reasoning: the text has lost a token the model
    generated, the counts say so, and the sample is refused with that cause instead of trained on."""
    honest = {**_record("q", "thinking it over", "fine"), "id": "honest"}
    stripped = _served(kimi, {**_record("q", "thinking it over", "fine"), "id": "stripped"},
                       generated_reasoning="thinking it over\n\n")
    kept, [refused] = _build(kimi, spec, [honest, stripped])
    assert [s.id for s in kept] == ["honest"] and kept[0].source == "text"
    assert refused["id"] == "stripped" and "stripped whitespace from the end of the reasoning" in refused["reason"]


def test_a_rebuild_without_usage_counts_is_never_trained_on(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    kept, [refused] = _build(kimi, spec, [{**_record("q", "r", "c"), "usage": {}}])
    assert kept == [] and "no usage counts" in refused["reason"]


def test_a_prompt_rendered_differently_is_named(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    record = _served(kimi, _record("q", "r", "c"))
    record["usage"]["prompt_tokens"] += 3  # e.g. a system prompt the served template adds
    _, [refused] = _build(kimi, spec, [record])
    assert "model.tokenizer or its chat template differs" in refused["reason"]


def test_samples_of_one_request_are_counted_together(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    """With n > 1 the server's usage counts every sample of the request together."""
    first, second = (_served(kimi, {**_record("q", f"thought {k}", f"answer {k}"), "id": f"p:{k}"}) for k in (0, 1))
    together = {"prompt_tokens": first["usage"]["prompt_tokens"],
                "completion_tokens": first["usage"]["completion_tokens"] + second["usage"]["completion_tokens"]}
    kept, rejected = _build(kimi, spec, [{**first, "usage": together}, {**second, "usage": together}])
    assert rejected == [] and [s.id for s in kept] == ["p:0", "p:1"]


def test_the_source_setting_decides_which_ids_are_kept(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    [built], _ = _build(kimi, spec, [_record("hello", "hmm", "hi")])
    cut = built.loss_mask.index(1)
    with_ids = _record("hello", "hmm", "hi", prompt_token_ids=built.input_ids[:cut],
                       completion_token_ids=built.input_ids[cut:])
    [auto], _ = _build(kimi, spec, [with_ids])
    [text], _ = _build(kimi, spec, [with_ids], source="text")
    assert (auto.source, text.source) == ("server", "text") and text.agrees is True
    _, [refused] = _build(kimi, spec, [_record("hello", "hmm", "hi")], source="server")
    assert "no token ids (sequences.source: server)" in refused["reason"]


def test_server_ids_with_two_think_ends_are_refused(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    """The kimi_k2 parser removes a second `</think>` from the answer text; the ids keep it, and a sequence built
    from them would supervise two: refused with the cause."""
    [built], _ = _build(kimi, spec, [_record("q", "r", "c")])
    cut = built.loss_mask.index(1)
    completion = built.input_ids[cut:]
    doubled = [*completion[:-1], END_THINK, IM_END]
    record = _record("q", "r", "c", prompt_token_ids=built.input_ids[:cut], completion_token_ids=doubled)
    kept, [refused] = _build(kimi, spec, [record])
    assert kept == [] and refused["reason"].startswith("2 think-end tokens (163607) in the completion, not 1")


def test_the_cross_check_is_a_stable_sample_of_prompts_and_never_skips_a_sample_without_ids(  # type: ignore[no-untyped-def]
        kimi, spec) -> None:
    """Re-encoding every text is most of the stage's cost where the server sent ids: only a sample of prompts is
    compared, the same prompts on every run, while a sample without ids is always rebuilt and checked."""
    [built], _ = _build(kimi, spec, [_record("hello", "hmm", "hi")])
    cut = built.loss_mask.index(1)
    ids = {"prompt_token_ids": built.input_ids[:cut], "completion_token_ids": built.input_ids[cut:]}
    with_ids = [_record("hello", "hmm", "hi", **ids) | {"id": f"p{k}:0"} for k in range(200)]
    compared = {rate: [s.id for s in _build(kimi, spec, with_ids, cross_check_rate=rate)[0] if s.agrees is not None]
                for rate in (0.0, 0.25, 1.0)}
    assert compared[0.0] == [] and len(compared[1.0]) == 200
    assert 25 <= len(compared[0.25]) <= 75, "about a quarter of the prompts"
    assert compared[0.25] == [s.id for s in _build(kimi, spec, with_ids, cross_check_rate=0.25)[0]
                              if s.agrees is not None], "the same prompts every run"
    assert all(s.agrees for s in _build(kimi, spec, with_ids, cross_check_rate=0.25)[0] if s.agrees is not None)

    [without_ids], _ = _build(kimi, spec, [_record("hello", "hmm", "hi")], cross_check_rate=0.0)
    assert without_ids.source == "text" and without_ids.input_ids == built.input_ids


def test_a_shard_is_built_in_chunks_that_never_split_a_prompts_samples() -> None:
    records = [{"id": f"p{p}:{k}"} for p in range(5) for k in range(3)] + [{"id": "q"}, {"id": "r"}]
    chunks = list(whole_prompts(iter(records), 4))
    assert [r for chunk in chunks for r in chunk] == records
    assert [[r["id"] for r in chunk] for chunk in chunks][:2] == [["p0:0", "p0:1", "p0:2", "p1:0", "p1:1", "p1:2"],
                                                                   ["p2:0", "p2:1", "p2:2", "p3:0", "p3:1", "p3:2"]]
    assert all({r["id"].split(":")[0] for r in chunk}.isdisjoint({r["id"].split(":")[0] for r in other})
               for i, chunk in enumerate(chunks) for other in chunks[i + 1:])


def test_kimi_instant_mode_is_exact_with_the_templates_empty_think_block(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    """Instant mode (`thinking: false`): the prompt ends `<think></think>`, the completion is answer + end of turn,
    with no think id of its own; the text rebuild in that mode equals the ids a server would send."""
    enc = lambda text: kimi.encode(text, add_special_tokens=False)  # noqa: E731
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = kimi.apply_chat_template(messages, add_generation_prompt=True, thinking=False,
                                      return_dict=True)["input_ids"]
    assert prompt[-2:] == [THINK, END_THINK]
    completion = [*enc("4"), IM_END]
    served = {"prompt_token_ids": prompt, "completion_token_ids": completion,
              "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}}
    instant = _record("What is 2+2?", "", "4", mode="instant", **served)
    thinking = {**_record("What is 2+2?", "Two plus two.", "4", mode="thinking"), "id": "s2"}
    sequences, rejected = _build(kimi, spec, [instant, thinking])
    assert rejected == []
    by_mode = {sequence.mode: sequence for sequence in sequences}
    assert by_mode["instant"].input_ids == prompt + completion and by_mode["instant"].agrees is True
    assert by_mode["instant"].loss_mask == [0] * len(prompt) + [1] * len(completion)
    thinking_prompt = by_mode["thinking"].input_ids[: by_mode["thinking"].loss_mask.index(1)]
    assert thinking_prompt[-2:] == [IM_MIDDLE, THINK], "thinking keeps its own form: the model closes the block"
    [text_only], _ = _build(kimi, spec, [{k: v for k, v in instant.items() if "token_ids" not in k}], source="text")
    assert text_only.input_ids == prompt + completion, "the text rebuild in instant mode is the server's ids"


def test_reasoning_in_an_instant_record_is_refused(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    _, [refused] = _build(kimi, spec, [_record("2+2?", "I think anyway.", "4", mode="instant",
                                               usage={"prompt_tokens": 1, "completion_tokens": 1})])
    assert refused["reason"].startswith("reasoning in a record of mode 'instant', answered without reasoning")


def test_a_kimi_tool_call_is_rebuilt_from_text_as_the_model_generated_it(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    """A tool call's ids, as the model generates them (vLLM's kimi_k2 tool parser takes the calls out of the
    text), are rebuilt from the record with the template's own rendering of the calls; validation reads them as
    the record's text and calls."""
    from eagle3_datagen.config import ValidationConfig
    from eagle3_datagen.think_tokens import tool_calls_text
    from tasks.validation import validate_records

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]
    record = _record("What is the weather in Tokyo?", "I should look it up.", "", "tool_calls", tools=tools,
                     tool_calls=calls)
    section = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               '{"city": "Tokyo"}<|tool_call_end|><|tool_calls_section_end|>')
    assert tool_calls_text(kimi, record, KIMI, spec) == section
    prompt = kimi.apply_chat_template(record["messages"], tools=tools, add_generation_prompt=True, thinking=True,
                                      return_dict=True)["input_ids"]
    completion = kimi.encode(f"I should look it up.</think>{section}<|im_end|>", add_special_tokens=False)
    served = {**record, "prompt_token_ids": prompt, "completion_token_ids": completion,
              "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}}
    [sequence], rejected = _build(kimi, spec, [served])
    assert rejected == [] and sequence.agrees is True and sequence.input_ids == prompt + completion
    [rebuilt], _ = _build(kimi, spec, [served], source="text")
    assert rebuilt.input_ids == prompt + completion, "the text rebuild places the calls where the model wrote them"
    decode = lambda ids: kimi.decode(ids, skip_special_tokens=False)  # noqa: E731
    report = validate_records(0, [served], KIMI, ValidationConfig(), decode, spec,
                              lambda r: tool_calls_text(kimi, r, KIMI, spec))
    assert (report.token_text_mismatch, report.empty_content, report.status) == (0, 0, "pass")
    lost = {**served, "completion_token_ids": completion[:-8] + completion[-1:]}  # a call cut short
    assert validate_records(0, [lost], KIMI, ValidationConfig(), decode, spec,
                            lambda r: tool_calls_text(kimi, r, KIMI, spec)).token_text_mismatch == 1


def test_a_call_in_history_is_rendered_as_vllm_renders_it(kimi, spec) -> None:  # type: ignore[no-untyped-def]
    """vLLM parses a history call's JSON arguments before the template renders them; Kimi's template writes
    them as they come, so the prompt holds Python's form and a text rebuild must too."""
    from eagle3_datagen.think_tokens import render_generation_prompt

    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]
    history = [{"role": "user", "content": "Weather in Tokyo?"},
               {"role": "assistant", "content": "", "tool_calls": calls, "reasoning": "Look it up."},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    prompt = render_generation_prompt(kimi, history, KIMI)
    assert "<|tool_call_argument_begin|>{'city': 'Tokyo'}<|tool_call_end|>" in prompt
    assert "<think>Look it up.</think>" in prompt, "interleaved reasoning is kept where the template keeps it"
