"""Reading chat completions: a 200 whose body breaks the protocol is a ProtocolError, which the client turns into a
retryable failure of the endpoint, never a crash of the run."""

from __future__ import annotations

from typing import Any

import pytest

from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.protocol import ProtocolError, parse_chat_response

QWEN3 = BUILTIN_PROFILES["qwen3"]
ANSWER = {"role": "assistant", "content": "42"}


@pytest.mark.parametrize("body, wrong", [
    ({"object": "chat.completion"}, "no choices"),
    ({"choices": []}, "no choices"),
    ([{"choices": [{"message": ANSWER}]}], "no choices"),
    ("an answer", "no choices"),
    ({"choices": [None]}, "a choice is not an object"),
    ({"choices": ["an answer"]}, "a choice is not an object"),
    ({"choices": [{"message": "an answer"}]}, "message is not an object"),
    ({"choices": [{"message": ["an answer"]}]}, "message is not an object"),
    ({"choices": [{"message": {"content": 5}}]}, "content is not a string"),
    ({"choices": [{"message": {"content": "42", "reasoning": ["thinking"]}}]}, "reasoning is not a string"),
    ({"choices": [{"message": ANSWER}], "usage": [7, 9]}, "usage is not an object"),
    ({"choices": [{"message": ANSWER}], "prompt_token_ids": 7}, "prompt_token_ids is not a list"),
    ({"choices": [{"message": ANSWER, "token_ids": "7 9"}]}, "token_ids is not a list"),
], ids=["no choices", "empty choices", "top-level array", "top-level string", "null choice", "text choice",
        "text message", "array message", "numeric content", "array reasoning", "array usage", "numeric prompt ids",
        "text token ids"])
def test_a_body_that_breaks_the_protocol_is_a_protocol_error_that_shows_it(body: Any, wrong: str) -> None:
    with pytest.raises(ProtocolError, match=wrong):
        parse_chat_response(body, QWEN3)


def test_a_long_malformed_body_is_cut_to_200_characters() -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_chat_response({"choices": [None], "padding": "x" * 10_000}, QWEN3)
    assert len(str(raised.value).split(": ", 1)[1]) == 200
