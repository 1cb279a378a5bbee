"""Rollouts: a conversation regenerated turn by turn on the target's own answers.

Generation builds each turn's prompt with `turn_messages` and `verify` checks every kept turn against it, so the
rule that a turn's history is the transcript of the turns before it lives in one place.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]


def turn_id(conversation: str, turn: int) -> str:
    """A rollout sample's id: its conversation's id and its turn (`prompt_id_of` gives the conversation back)."""
    return f"{conversation}:turn{turn}"


def turn_of(sample_id: str) -> int | None:
    """The turn of a rollout sample (or rejection) id; None for a sample that is not a rollout's."""
    _, found, turn = sample_id.rpartition(":turn")
    return int(turn) if found and turn.isdigit() else None


def turn_messages(script: Messages, answers: list[str]) -> Messages:
    """Turn k's prompt, k = len(answers): the script's messages up to its (k+1)-th user message, each earlier user
    turn followed by the target's own answer. History carries the answer's content only, as a client sends it
    back; the served template decides how earlier answers are rendered (Kimi-K2.5 writes an empty think block)."""
    messages: Messages = []
    answered = 0
    for message in script:
        messages.append(message)
        if message["role"] != "user":
            continue
        if answered == len(answers):
            return messages
        messages.append({"role": "assistant", "content": answers[answered]})
        answered += 1
    raise ValueError(f"a conversation of {answered} user turns has no turn {len(answers)}")
