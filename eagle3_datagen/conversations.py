"""Rollouts: a conversation regenerated turn by turn on the target's own answers, tool calls included.

Generation builds each turn's prompt with `next_turn` and `verify` checks every kept turn against it, so the rule
that a turn's history is the transcript of the turns before it lives in one place.

A rollout's script holds the system and user messages and, after each user message, the dataset's recorded
tool results (`{"role": "tool", "name": FUNCTION, "content": RESULT}`). The tools are not run: when the model
calls one, the call is paired with the next unused recorded result of the same function in its user turn (by
name and order, parallel calls included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Messages = list[dict[str, Any]]
TOOL_RESULT_MISSING = "tool_result_missing"


@dataclass(frozen=True)
class Ended:
    """A conversation that has no next turn: answered in full (`complete`), or ended by a call without a recorded
    result (`tool_result_missing`)."""

    reason: str
    detail: str = ""


def turn_id(conversation: str, turn: int) -> str:
    """A rollout sample's id: its conversation's id and its turn (`prompt_id_of` gives the conversation back)."""
    return f"{conversation}:turn{turn}"


def answer_of(answer: dict[str, Any]) -> dict[str, Any]:
    """What a later turn's history needs of an answer (a record, or a completion's fields)."""
    return {"content": answer["content"], "reasoning": answer["reasoning"], "tool_calls": answer.get("tool_calls")}


def history_message(output: dict[str, Any]) -> dict[str, Any]:
    """An earlier answer as a client sends it back: its content; with tool calls, also its calls and its reasoning
    (a template that keeps interleaved thinking renders it, the others drop it, as vLLM passes it)."""
    calls = output.get("tool_calls")
    if not calls:
        return {"role": "assistant", "content": output["content"] or ""}
    return {"role": "assistant", "content": output["content"] or "", "tool_calls": calls,
            "reasoning": output.get("reasoning") or ""}


def _user_turns(script: Messages) -> list[tuple[Messages, Messages]]:
    """The script per user turn: the messages that lead to it (system ones, then the user's), and its recorded
    tool results."""
    turns: list[tuple[Messages, Messages]] = []
    lead: Messages = []
    for message in script:
        if message["role"] == "tool":
            if not turns:
                raise ValueError("a tool result before the first user message")
            turns[-1][1].append(message)
            continue
        lead.append(message)
        if message["role"] == "user":
            turns.append((lead, []))
            lead = []
    return turns


def user_turns(script: Messages) -> int:
    return sum(message["role"] == "user" for message in script)


def next_turn(script: Messages, outputs: list[dict[str, Any]]) -> Messages | Ended:
    """The prompt of the conversation's next generation, after `outputs` (the model's earlier answers:
    `content`, `reasoning`, `tool_calls`), or why there is none."""
    messages: Messages = []
    answered = 0
    for lead, recorded in _user_turns(script):
        messages += lead
        unused = list(recorded)
        while True:
            if answered == len(outputs):
                return messages
            output = outputs[answered]
            answered += 1
            messages.append(history_message(output))
            calls = output.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                name = call["function"]["name"]
                result = next((r for r in unused if r["name"] == name), None)
                if result is None:
                    if answered < len(outputs):
                        raise ValueError(f"answer {answered} follows a call without a recorded result")
                    return Ended(TOOL_RESULT_MISSING, f"the dataset recorded no (further) result of {name}")
                unused.remove(result)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result["content"]})
    if answered < len(outputs):
        raise ValueError(f"{len(outputs)} answers to a conversation that ended after {answered}")
    return Ended("complete")
