"""Think-token discovery: prove the model's think tags are single token ids and learn what its template writes.

Reconstruction trusts nothing it has not checked here: a tag that splits into text pieces, or a template that
already writes the start tag, changes every training sequence.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_datagen.artifacts import GenerationRecord
from eagle3_datagen.errors import ConfigurationError
from eagle3_datagen.modes import with_system_prompt
from eagle3_datagen.profiles import ModelProfile

if TYPE_CHECKING:  # transformers (and torch with it) loads with the first tokenizer: a cached re-run needs none
    from transformers import PreTrainedTokenizerBase


class ThinkTokenError(ConfigurationError, ValueError):
    """The tokenizer cannot represent this profile's think tags as single ids."""


@dataclass(frozen=True)
class ThinkTokenSpec:
    think_start: str
    think_end: str
    end_of_turn: str
    start_id: int
    end_id: int
    end_of_turn_id: int
    template_writes_start_tag: bool  # found by rendering the generation prompt in the profile's thinking mode
    generation_prompt_suffix: str  # what the rendered prompt ends with, for the report

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_IMPORTING = threading.Lock()


@lru_cache(maxsize=8)
def load_tokenizer(path_or_id: str) -> PreTrainedTokenizerBase:
    """A tokenizer loaded once per process; remote code is never executed. The first import of transformers is
    made by one thread at a time: shard tasks that start together each make it, and two at once can fail one with
    an ImportError."""
    with _IMPORTING:
        from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path_or_id, trust_remote_code=False)
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise ThinkTokenError(
                f"tokenizer {path_or_id!r} ships its own code, which tokenizers are never loaded with: set "
                "model.tokenizer to a folder with its fast-tokenizer form (tokenizer.json), e.g. one saved by "
                "transformers' TikTokenConverter"
            ) from None
        raise ThinkTokenError(
            f"cannot load tokenizer {path_or_id!r} ({str(error).splitlines()[0]}): "
            "set model.tokenizer to a local tokenizer folder or a reachable hub id"
        ) from None


def single_token_id(tokenizer: PreTrainedTokenizerBase, text: str, role: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ThinkTokenError(
            f"the tokenizer encodes the {role} {text!r} as {len(ids)} tokens {pieces}, not one id: "
            "this tokenizer has no single-token tag for it; check model.tokenizer and the profile's tags"
        )
    return ids[0]


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts, without added special tokens, the same ids as `tokenizer(texts)`.

    Why: the Rust backend's `encode_batch_fast` skips the character offsets and the Python-side conversion that
    `tokenizer(texts)` builds and the stage never reads (benchmarks/sequences_throughput.py times both).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a tokenizer without a Rust backend
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


def as_served(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the template: an earlier answer's `reasoning` is also its
    `reasoning_content` (the name other templates read), and its calls' JSON arguments are parsed into objects
    (a template writing `{{ arguments }}` then renders Python's form of them, as the server's prompt holds)."""
    return [_served_answer(m) if m["role"] == "assistant" else m for m in messages]


def _served_answer(message: dict[str, Any]) -> dict[str, Any]:
    served = {**message, "reasoning_content": message["reasoning"]} if "reasoning" in message else message
    if message.get("tool_calls"):
        served["tool_calls"] = [{**call, "function": {**call["function"],
                                                      "arguments": _parsed(call["function"]["arguments"])}}
                                for call in message["tool_calls"]]
    return served


def _parsed(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def render_generation_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], profile: ModelProfile, mode: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text exactly as the server renders it: generation prompt on, switched into `mode` (None: the
    default mode) as the request switches it (see `build_chat_request`), offering `tools`."""
    spec = profile.mode(mode)
    return tokenizer.apply_chat_template(as_served(with_system_prompt(messages, spec)), tools=tools, tokenize=False,
                                         add_generation_prompt=True, **spec.template_variables())


def tool_calls_text(tokenizer: PreTrainedTokenizerBase, record: GenerationRecord, profile: ModelProfile,
                    spec: ThinkTokenSpec) -> str | None:
    """The text the served template writes for a record's tool calls, between its answer and the end of turn:
    what the model generated there. None when the template does not render the answer as the record's own
    reasoning, end tag and content followed by the calls (a text rebuild cannot place them)."""
    mode = profile.mode_of(record)
    thinks = profile.mode(mode).thinks
    prompt = render_generation_prompt(tokenizer, record["messages"], profile, mode, record.get("tools"))
    answer = {"role": "assistant", "content": record["content"] or "", "tool_calls": record["tool_calls"],
              "reasoning": record["reasoning"]}
    # the answer's arguments stay the JSON text the model generated; only the history's are parsed
    spoken = [*as_served(with_system_prompt(record["messages"], profile.mode(mode))),
              {**answer, "reasoning_content": record["reasoning"]}]
    full = tokenizer.apply_chat_template(spoken, tools=record.get("tools"), tokenize=False,
                                         add_generation_prompt=False, **profile.mode(mode).template_variables())
    head = (("" if spec.template_writes_start_tag else spec.think_start) + record["reasoning"] + spec.think_end
            if thinks else "") + (record["content"] or "")
    if not full.startswith(prompt + head):
        return None
    calls = full[len(prompt) + len(head):]
    end = calls.rfind(spec.end_of_turn)
    return calls[:end] if end >= 0 else calls


def think_token_proof(tokenizer: str, tokenizer_fingerprint: str, profile: ModelProfile) -> str | None:
    """What a discovery holds for: the tokenizer's files, the profile and this module's code. A run that recorded
    the same proof reuses its think tokens without loading a tokenizer (transformers and torch with it: seconds of
    every cached re-run). A tokenizer named by hub id has no files here to vouch for it: None, found again."""
    if not Path(tokenizer).exists():
        return None
    digest = hashlib.sha256(tokenizer_fingerprint.encode() + b"\0" + profile.model_dump_json().encode() + b"\0")
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def discover_think_tokens(tokenizer: PreTrainedTokenizerBase, profile: ModelProfile) -> ThinkTokenSpec:
    """Find and prove the think-token ids and whether the template writes the start tag."""
    if not profile.single_token_tags:
        raise ThinkTokenError(
            "this profile marks reasoning with multi-token channels (gpt-oss harmony): rebuild from "
            "the server's token ids only; single-token think-tag discovery does not apply"
        )
    start_id = single_token_id(tokenizer, profile.think_start, "think start tag")
    end_id = single_token_id(tokenizer, profile.think_end, "think end tag")
    end_of_turn_id = single_token_id(tokenizer, profile.end_of_turn, "end-of-turn token")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ThinkTokenError("the tokenizer has no chat template: use the model's own tokenizer folder")
    rendered = render_generation_prompt(tokenizer, [{"role": "user", "content": "2+2?"}], profile,
                                        profile.thinking_mode)
    writes_start = rendered.rstrip().endswith(profile.think_start)
    return ThinkTokenSpec(
        think_start=profile.think_start,
        think_end=profile.think_end,
        end_of_turn=profile.end_of_turn,
        start_id=start_id,
        end_id=end_id,
        end_of_turn_id=end_of_turn_id,
        template_writes_start_tag=writes_start,
        generation_prompt_suffix=rendered[-40:],
    )
