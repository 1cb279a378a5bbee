"""Tool-call conversations that teach the tiny Kimi-vocabulary model to call the function-calling set's tools.

Each generation event of a synthetic conversation is one training row: the prompt as the served template renders
it (the tools declared, earlier calls in history as vLLM renders them: arguments parsed, reasoning kept after the
last plain answer), and the reply in Kimi-K2's format, `{reasoning}</think>{content}<|tool_calls_section_begin|>
<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>…
<|tool_calls_section_end|><|im_end|>`, which vLLM's `kimi_k2` tool parser returns as `tool_calls`.

The questions are the set's families: weather, time, two cities at once (parallel calls), a time then a weather
turn, and arithmetic that needs no tool. A question of time is answered by a call whatever the dataset recorded,
so the set's row without a recorded time result ends as `tool_result_missing`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

TOOL_CALL_SET = Path(__file__).parents[1] / "data" / "demo_tool_calls.jsonl"
# Kimi-K2's tool-call markup: single tokens of the Kimi-K2.5 vocabulary, in the order of the strings above
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TOOL_MARKUP_IDS = (163595, 163596, 163597, 163598, 163599)

_CITIES = ["Tokyo", "Paris", "Rome", "Oslo", "Cairo", "Lima", "Berlin", "Madrid", "Seoul", "Dublin", "Vienna",
           "Athens", "Lisbon", "Warsaw", "Hanoi", "Nairobi"]
_SKIES = ["sunny", "rain", "clear", "snow", "hot", "cloudy", "windy", "fog"]
_SYSTEM = "You are a helpful assistant with tools."


def set_tools() -> list[dict[str, Any]]:
    """The tools the function-calling set offers (every row offers the same two)."""
    return json.loads(TOOL_CALL_SET.read_text(encoding="utf-8").splitlines()[0])["tools"]


def _call(name: str, city: str, index: int) -> dict[str, Any]:
    return {"id": f"functions.{name}:{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"city": city})}}


def _calls_text(calls: list[dict[str, Any]]) -> str:
    return SECTION_BEGIN + "".join(f"{CALL_BEGIN}{c['id']}{ARGUMENT_BEGIN}{c['function']['arguments']}{CALL_END}"
                                   for c in calls) + SECTION_END


def _as_history(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as vLLM hands them to the template in a later turn: the JSON arguments parsed."""
    return [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in calls]


def _result(name: str, rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:00" if name == "get_time" else f"{rng.choice(_SKIES)}, {rng.randint(-5, 35)} C"


def _turn(question: str) -> tuple[list[tuple[str, str]], str]:
    """The (function, city) calls a question asks for, and the reasoning before them."""
    cities = [c for c in _CITIES if f" {c}" in question]
    if "time" in question:
        return [("get_time", cities[0])], f"The user asks for the time in {cities[0]}. I will call get_time."
    if "weather" in question:
        calls = [("get_weather", city) for city in cities]
        twice = " twice" if len(calls) > 1 else ""
        return calls, f"The user asks for the weather in {' and '.join(cities)}. I will call get_weather{twice}."
    return [], "This is a small arithmetic question. I can answer without a tool."


def _conversation(rng: random.Random) -> list[str]:
    """The user questions of one synthetic conversation."""
    a, b = rng.sample(_CITIES, 2)
    return rng.choice([
        [f"What is the weather in {a}?"], [f"What time is it in {a}?"],
        [f"What is the weather in {a} and in {b}?"],
        [f"What time is it in {a}?", f"And the weather in {a}?"],
        [f"What is {rng.randint(2, 9)} plus {rng.randint(2, 9)}?"],
    ])


def _answer(called: list[tuple[str, str]]) -> str:
    """A canned answer: one that repeats a result's numbers would leave the next token open among many, the end
    and tool tokens inside the nucleus there (the format margin refused such a build)."""
    if not called:
        return "That is a small sum."
    if len(called) > 1:
        return "Here is what the weather tool returned for both cities."
    return f"Here is what the {_tool_word(called)} tool returned."


def _tool_word(called: list[tuple[str, str]]) -> str:
    return "time" if called[0][0] == "get_time" else "weather"


def tool_call_rows(tokenizer: PreTrainedTokenizerBase, rng: random.Random,
                   count: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) for every generation event of `count` synthetic tool conversations."""
    tools = set_tools()
    rows = []
    for _ in range(count):
        messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.3 else []
        for question in _conversation(rng):
            messages.append({"role": "user", "content": question})
            called, reasoning = _turn(question)
            calls = [_call(name, city, index) for index, (name, city) in enumerate(called)]
            results = [_result(name, rng) for name, _ in called]
            events = [(reasoning, "", calls), (f"The tool returned the {_tool_word(called)}.", _answer(called), [])] \
                if called else [(reasoning, _answer(called), [])]
            for thought, content, step_calls in events:
                prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       add_generation_prompt=True)
                reply = (f"{thought}</think>{content}"
                         + (_calls_text(step_calls) if step_calls else "") + "<|im_end|>")
                rows.append((tokenizer.encode(prompt, add_special_tokens=False),
                             tokenizer.encode(reply, add_special_tokens=False)))
                if step_calls:
                    messages.append({"role": "assistant", "content": "", "reasoning": thought,
                                     "tool_calls": _as_history(step_calls)})
                    messages += [{"role": "tool", "tool_call_id": call["id"], "content": value}
                                 for call, value in zip(step_calls, results, strict=True)]
                else:
                    messages.append({"role": "assistant", "content": content})
    return rows
