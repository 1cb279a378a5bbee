"""A real vLLM CPU server on the tiny model: the response shape the pipeline relies on, and clean failures."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3_datagen.testing.tiny_model import DEMO_QUESTIONS
from eagle3_datagen.testing.vllm_server import LocalVLLMServer, vllm_python

ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def _demo_messages() -> list[list[dict[str, str]]]:
    rows = [json.loads(line) for line in DEMO_QUESTIONS.read_text(encoding="utf-8").splitlines() if line]
    return [[{"role": ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]] for row in rows]


def _chat(client: httpx.Client, server: LocalVLLMServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "model": server.served_name,
        "messages": messages,
        "chat_template_kwargs": {"enable_thinking": True},  # top level: over raw HTTP there is no extra_body
        "return_token_ids": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 256,
    }
    response = client.post(f"{server.url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


@pytest.mark.vllm
def test_demo_questions_give_reasoning_and_content(vllm_server: LocalVLLMServer, tiny_model: Path) -> None:
    conversations = _demo_messages()
    assert len(conversations) == 40
    started = time.monotonic()
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(max_workers=16) as pool:
        replies = list(pool.map(lambda messages: _chat(client, vllm_server, messages), conversations))
    elapsed = time.monotonic() - started
    choices = [reply["choices"][0] for reply in replies]
    complete = [c for c in choices if c["message"].get("reasoning") and c["message"].get("content")]
    truncated = sum(c["finish_reason"] == "length" for c in choices)
    print(f"\n{len(complete)}/40 with reasoning and content, {truncated} cut by max_tokens, "
          f"{len(replies) / elapsed:.1f} requests/s")
    # the model's build checks its format with margin on these prompts; a few sampled slips are a machine's own
    assert len(complete) >= 36, "at least nine in ten sampled answers close their reasoning and answer"

    vocab = json.loads((tiny_model / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in vocab}
    for reply, choice in zip(replies, choices, strict=True):
        assert reply["prompt_token_ids"]
        assert choice["token_ids"]
        assert "reasoning_content" not in choice["message"]  # removed from vLLM in early 2026 (facts §1)
    for choice in complete:
        # The sampled ids hold the model's own <think> and, when it stopped, the end-of-turn token.
        assert choice["token_ids"][0] == ids["<think>"]
        assert ids["</think>"] in choice["token_ids"]
        if choice["finish_reason"] == "stop":
            assert choice["token_ids"][-1] == ids["<|im_end|>"]


def _descendants(pid: int) -> dict[int, int]:
    """Every process below `pid`, with its process group, from /proc."""
    parent_and_group: dict[int, tuple[int, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent_and_group[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))
    below, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, group) in parent_and_group.items():
            if ppid == parent:
                below[child] = group
                frontier.append(child)
    return below


@pytest.mark.vllm
def test_server_runs_in_the_callers_session_in_a_group_that_stop_signals(vllm_server: LocalVLLMServer) -> None:
    # In a session of its own, the kernel's autogroup scheduling made vLLM a scheduling group apart from the
    # client's, and on 2 cores the client sat runnable and unrun for seconds (vllm_server.py says more)
    assert vllm_server._process is not None
    pid = vllm_server._process.pid
    assert os.getsid(pid) == os.getsid(0)
    assert os.getpgid(pid) == pid
    # stop() signals the whole group, so it reaches the engine core and its worker: every process vLLM started
    # is in it (by ancestry, not by title: vLLM's process titles are not set on every machine)
    below = _descendants(pid)
    assert len(below) >= 2, below
    assert set(below.values()) == {pid}, below


def test_missing_vllm_python_names_make_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(FileNotFoundError, match="make setup"):
        vllm_python()


@pytest.mark.vllm
def test_server_that_dies_fails_fast_with_its_log(tmp_path: Path) -> None:
    server = LocalVLLMServer(tmp_path / "no-such-model", served_name="x", log_path=tmp_path / "log")
    with pytest.raises(RuntimeError, match="vLLM exited") as failure:
        server.start()
    assert "no-such-model" in str(failure.value)
