"""Each stage's output for a fixed input, pinned by digest: an output that changes without a bump of its stage's
`version` fails here (eagle3_datagen/caching.py: code is not in a stage's key, so a re-run would take the outputs
written before the change for current ones).

Per stage, a small input built here goes through the stage's pure core (no Prefect, no server) and what it writes
is reduced to plain JSON values (file names and bytes, or the records and report it makes), then digested. What
varies between machines or library versions and is not the stage's to decide is left out: the temporary folder,
Parquet's writer metadata (the columns are read back instead), a zstd build's compressed bytes (the decoded states
and the part's layout instead), the input shards' own checksums, the stage keys.

When a test fails: an output that changed on purpose bumps its stage's `version` and takes the new digest the
message prints; one that changed by accident is a bug.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eagle3_datagen.artifacts import artifact_path
from eagle3_datagen.caching import StageOutput
from eagle3_datagen.config import HiddenStatesConfig, SequencesConfig, ValidationConfig
from eagle3_datagen.hidden_state_format import Sample, read_part
from eagle3_datagen.holdout import HoldoutChooser, HoldoutSplit
from eagle3_datagen.profiles import BUILTIN_PROFILES
from eagle3_datagen.protocol import Completion
from eagle3_datagen.storage import RunStore, marker_path
from eagle3_datagen.think_tokens import ThinkTokenSpec, discover_think_tokens
from tasks.generation.records import (
    GENERATIONS,
    Prompt,
    ShardState,
    finalize_shard,
    log_header,
    new_records,
    partial_log_path,
    rollout_prompt,
)
from tasks.hidden_states.parts import write_shard
from tasks.hidden_states.targets import TargetInfo
from tasks.hidden_states.task import HIDDEN_STATES
from tasks.prompts import PROMPTS, UnreadableRow, write_prompt_shards
from tasks.sequences import SEQUENCES, Sequence, build_sequences, to_parquet, to_table
from tasks.validation import VALIDATION, validate_records

REPO = Path(__file__).resolve().parents[2]

# stage -> (its StageOutput's version when the digest was taken, the digest of its output for the input below)
GOLDEN: dict[str, tuple[int, str]] = {
    "prompts": (1, "31b40e30d4a180b8a751e257fd242f5ee20df8df2809f5b20d33b9e6446eef7f"),
    "generations": (1, "d7ed688d8aa332d6b560e503b50815af03b2734b22562e92520e8fe6752c43a5"),
    "validation": (1, "e3a7c0cd307c83821fcf0feceb08c7ce24710d89f19c92f550c85ab95b9c90ed"),
    "sequences": (1, "26fb5c81c900a54479de7ab9932e7bf366f98954f7546da72df00441fd6e65c1"),
    "hidden_states": (1, "39d1836911e9021b1ca3da214cf13556204bb87ffe93978bd4c82408d59537da"),
}

QWEN3 = BUILTIN_PROFILES["qwen3"]

# A character-level vocabulary, the same on every machine and with every tokenizers version: the special and think
# tokens, then newline and printable ASCII, one id each.
SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
VOCAB = [*SPECIAL, "\n", *(chr(code) for code in range(32, 127))]
IM_START, IM_END, THINK, END_THINK = (VOCAB.index(token) for token in SPECIAL[2:])
# Qwen3's generation prompt and thinking switch, without its handling of earlier answers' reasoning
CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
SPEC = ThinkTokenSpec(think_start="<think>", think_end="</think>", end_of_turn="<|im_end|>", start_id=THINK,
                      end_id=END_THINK, end_of_turn_id=IM_END, template_writes_start_tag=False,
                      generation_prompt_suffix="<|im_start|>assistant\n")


def ids(*pieces: str | int) -> list[int]:
    """Token ids in VOCAB: a string's characters one by one, an int as it is."""
    return [i for piece in pieces for i in ([piece] if isinstance(piece, int) else [VOCAB.index(c) for c in piece])]


def decode(token_ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in token_ids)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """VOCAB as a transformers fast tokenizer with CHAT_TEMPLATE (built here: nothing read from disk)."""
    tokenizer = Tokenizer(models.WordLevel({token: i for i, token in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.add_special_tokens([AddedToken(token, normalized=False) for token in SPECIAL[1:4]])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in SPECIAL[4:]])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def files(root: Path) -> dict[str, str]:
    """Every file under `root` by its path there, as the sha256 of its bytes."""
    return {path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def digest(view: Any) -> str:
    return hashlib.sha256(json.dumps(view, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
                          ).hexdigest()


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# ---- stage 2: prompts ----------------------------------------------------------------------------------------------

ADD_CALL = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]

PROMPT_ROWS: list[dict[str, Any] | UnreadableRow] = [
    {"messages": [user("What is 2+2?")]},
    {"conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "Capital of Peru?"},
                       {"from": "gpt", "value": "Lima."}, {"from": "human", "value": "And of Chile?"},
                       {"from": "gpt", "value": "Santiago."}]},
    UnreadableRow("line 3 is not a JSON object"),
    {"messages": [user("What is 2+2?")]},  # a duplicate
    {"messages": [{"role": "system", "content": "Be kind."}]},  # no user turn
    {"messages": [user("Add 2 and 3."), {"role": "assistant", "content": "", "tool_calls": ADD_CALL},
                  {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "assistant", "content": "5."}],
     "tools": [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                             "b": {"type": "integer"}}}}]},
    {"messages": [user("Name a prime.")]},
]


def prompts_output(tmp_path: Path) -> Any:
    """The shards, markers, rejections and summary of each user turn as a prompt (with a held-out share and two
    modes), and of each row as one conversation (`turns: rollout`)."""
    view = {}
    for turns in ("each", "rollout"):
        store = RunStore(str(tmp_path), turns)
        write_prompt_shards(PROMPT_ROWS, store, 2, turns=turns, holdout=HoldoutChooser(0.3, 1),
                            mode_of=lambda pid: "instant" if pid < "8" else "thinking")
        view[turns] = files(tmp_path / turns)
    return view


# ---- stage 3: generations ------------------------------------------------------------------------------------------

PROMPT_SHARD = [
    {"id": "single", "messages": [user("What is 2+2?")], "row": 0, "turn": 0},
    {"id": "sampled", "messages": [user("Name a prime.")], "row": 1, "turn": 0},
    {"id": "refused", "messages": [user("Something refused.")], "row": 2, "turn": 0},
    {"id": "rollout", "messages": [{"role": "system", "content": "You are terse."}, user("Capital of Peru?"),
                                   {"role": "assistant", "content": "Lima."}, user("And of Chile?"),
                                   {"role": "assistant", "content": "Santiago."}], "row": 3, "turns": 2},
    {"id": "tools", "messages": [user("Add 2 and 3.")], "row": 4, "turn": 0,
     "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]},
]


def answer(reasoning: str, content: str, tool_calls: list[dict[str, Any]] | None = None) -> Completion:
    completion = ids(reasoning, END_THINK, content, IM_END)
    return Completion(reasoning, content, "tool_calls" if tool_calls else "stop", "reasoning", ids("<prompt>"),
                      completion, {"prompt_tokens": 8, "completion_tokens": len(completion)}, "served-model",
                      tool_calls=tool_calls)


def generations_output(tmp_path: Path) -> Any:
    """A finished shard: a plain answer, two samples of a prompt asked in a mode, a refusal, a two-turn rollout
    and a tool call, logged out of order; its file, rejections and marker (less its stage key)."""
    store = RunStore(str(tmp_path), "run")
    ref = store.write_shard("prompts", 0, PROMPT_SHARD)
    state = ShardState(ref, partial_log_path(store, 0, "run-id"), log_header("run-id", ref))
    single, sampled, refused, rollout, tools = PROMPT_SHARD
    asked = Prompt(0, 1, sampled["id"], sampled["messages"], 7, mode="thinking")
    state.append(asked, records=new_records(asked, [answer("A prime.", "2"), answer("Another.", "3")]))
    asked = Prompt(0, 0, single["id"], single["messages"], None)
    state.append(asked, records=new_records(asked, [answer("Two and two.", "4")]))
    state.append(Prompt(0, 2, refused["id"], refused["messages"], None),
                 rejected={"id": refused["id"], "stage": "generations", "reason": "the server refused it"})
    asked = rollout_prompt(0, 3, rollout, (), None, None)
    first = answer("Peru.", "Lima.")
    state.append(asked, records=new_records(asked, [first]))
    step = asked.rollout.after(first)  # type: ignore[union-attr]
    assert isinstance(step, list)
    asked = asked.followed_by(first, step)
    second = answer("Chile.", "Santiago.")
    state.append(asked, records=new_records(asked, [second], "complete"), ended="complete")
    asked = Prompt(0, 4, tools["id"], tools["messages"], None, tools=tools["tools"])
    state.append(asked, records=new_records(asked, [answer("Use add.", "", ADD_CALL)]))
    shard = finalize_shard(store, state)
    marker = store.read_json(marker_path(shard.path))
    return {"files": {rel: sha for rel, sha in files(tmp_path / "run").items() if rel != marker_path(shard.path)},
            "marker": {key: value for key, value in marker.items() if key != "stage_key"}}


# ---- stage 4: validation -------------------------------------------------------------------------------------------


def generated(record_id: str, reasoning: str, content: str, token_ids: list[int] | None, finish: str = "stop",
              **extra: Any) -> dict[str, Any]:
    return {"id": record_id, "messages": [user("q")], "reasoning": reasoning, "content": content,
            "finish_reason": finish, "reasoning_source": "reasoning", "completion_token_ids": token_ids, **extra}


# Qwen3's template leaves the start tag to the model: a thinking completion's ids start with it
VALIDATED = [
    generated("clean", "Two and two.", "4", ids(THINK, "Two and two.", END_THINK, "4", IM_END)),
    generated("instant", "", "Lima.", ids("Lima.", IM_END), mode="instant"),
    generated("thought-anyway", "Hmm.", "Lima.", ids("Hmm.", END_THINK, "Lima.", IM_END), mode="instant"),
    generated("no-reasoning", "", "4", ids(THINK, END_THINK, "4", IM_END)),
    generated("no-content", "Thinking.", "", ids(THINK, "Thinking.", END_THINK, IM_END)),
    generated("cut", "Long thoughts", "", ids(THINK, "Long thoughts"), "length"),
    generated("leaked", "Odd.", "a</think>b", ids(THINK, "Odd.", END_THINK, "a", END_THINK, "b", IM_END)),
    generated("clean", "Again.", "5", ids(THINK, "Again.", END_THINK, "5", IM_END)),  # a duplicate id
    generated("mismatch", "Said one thing.", "x", ids(THINK, "Said another.", END_THINK, "x", IM_END)),
    generated("unclosed", "Never closed.", "", ids(THINK, "Never closed.", IM_END)),
    generated("inline", "Split here.", "6", ids(THINK, "Split here.", END_THINK, "6", IM_END),
              reasoning_source="inline"),
    generated("no-ids", "No ids.", "7", None),
    generated("call", "Use add.", "", ids(THINK, "Use add.", END_THINK, "<call add>", IM_END), "tool_calls",
              tool_calls=[{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]),
]


def validation_output(tmp_path: Path) -> Any:
    """The report of a shard with one record of each kind the checks count (it is quarantined)."""
    report = validate_records(3, VALIDATED, QWEN3, ValidationConfig(), decode, SPEC, lambda record: "<call add>")
    return report.as_dict()


# ---- stage 5: sequences --------------------------------------------------------------------------------------------

SERVED_PROMPT = ids(IM_START, "user\nq", IM_END, "\n", IM_START, "assistant\n")  # the template's, as rebuilt
SEQUENCE_RECORDS = [
    # rebuilt from text: the usage counts are those this tokenizer gives, as a server's would be
    generated("think", "Two and two.", "4", None, usage={"prompt_tokens": 20, "completion_tokens": 16}),
    generated("fast", "", "Lima.", None, mode="instant", usage={"prompt_tokens": 26, "completion_tokens": 6}),
    generated("cut", "Let me count", "", None, "length", usage={"prompt_tokens": 20, "completion_tokens": 13}),
    generated("miscounted", "Off.", "1", None, usage={"prompt_tokens": 20, "completion_tokens": 3}),
    generated("thought-anyway", "Hmm.", "Lima.", None, mode="instant"),
    # the server's ids, cross-checked against the text (they differ at the "!")
    {**generated("served:0", "Peru.", "Lima.", ids(THINK, "Peru.", END_THINK, "Lima!", IM_END), turn=1),
     "prompt_token_ids": SERVED_PROMPT, "usage": {"prompt_tokens": 10, "completion_tokens": 12}},
    {**generated("twice", "A.", "B", ids(THINK, "A.", END_THINK, "B", END_THINK, IM_END)),
     "prompt_token_ids": SERVED_PROMPT, "usage": {"prompt_tokens": 10, "completion_tokens": 6}},
]
# under these cuts, the prompts of "fast" and "cut" are held out
HOLDOUT = HoldoutSplit(share=0.5, min_per_mode=0, cuts={"thinking": 0.5, "instant": 0.5}, prompts={})


def column_type(data_type: pa.DataType) -> str:
    """A column's type, without the list item's name (which Parquet writers name differently across versions)."""
    if pa.types.is_list(data_type):
        return f"list<{column_type(data_type.value_type)}>"
    return str(data_type)


def sequences_output(tmp_path: Path) -> Any:
    """The Parquet shard's columns and rows, and the rejections, of text rebuilds (both modes, a truncated one, one
    whose counts differ), a server's ids cross-checked, and samples refused for their mode or their think-end ids,
    with a held-out split."""
    tokenizer = char_tokenizer()
    spec = discover_think_tokens(tokenizer, QWEN3)
    shard = build_sequences(SEQUENCE_RECORDS, tokenizer, QWEN3, spec, SequencesConfig(cross_check_rate=1.0), HOLDOUT)
    table = pq.read_table(io.BytesIO(to_parquet([to_table(shard.sequences)])))
    return {"columns": {field.name: column_type(field.type) for field in table.schema}, "rows": table.to_pylist(),
            "rejected": shard.rejected, "rebuilt_from_text": shard.rebuilt_from_text,
            "count_mismatches": shard.count_mismatches}


# ---- stage 6: hidden states ----------------------------------------------------------------------------------------

HIDDEN = 4


def hidden_states_output(tmp_path: Path) -> Any:
    """The index and parts of three sequences (one held out) with fixed states, stored plain and under zstd, in
    parts small enough that there are several."""
    rows = [("s0", [5, 6, 7], [0, 1, 1], "train"), ("s1", [8, 9, 10, 11, 12], [0, 0, 1, 1, 1], "holdout"),
            ("s2", [13, 14], [0, 1], "train")]
    sequences = [Sequence(sid, tokens, mask, "server", None, None, "thinking", split)
                 for sid, tokens, mask, split in rows]
    target = TargetInfo(path="tiny-target", num_layers=8, hidden_size=HIDDEN, vocab_size=64, fingerprint="target-1",
                        norm_weight=torch.tensor([1.0, 0.5, 2.0, 0.25]), norm_eps=1e-6)

    def samples(read: list[Any], aux_layers: list[int]) -> Generator[Sample, None, None]:
        for sequence in read:
            count = len(sequence.input_ids)
            # multiples of 1/8 below 4: exact in bfloat16
            states = ((torch.arange(count * 4 * HIDDEN) % 61 - 30) / 8).view(count, 4 * HIDDEN).to(torch.bfloat16)
            yield Sample(sequence.id, sequence.input_ids, sequence.loss_mask, states[:, :3 * HIDDEN].clone(),
                         states[:, 3 * HIDDEN:].clone())

    view = {}
    for compression in ("none", "zstd"):
        store = RunStore(str(tmp_path), compression)
        ref = store.write_shard_bytes("sequences", 0, to_parquet([to_table(sequences)]), len(sequences))
        settings = HiddenStatesConfig(dtype="bfloat16", part_size_bytes=100, compression=compression)
        index = write_shard(store, ref, target, settings, samples, stage_key="a-stage-key")
        index_rel = artifact_path("hidden_states", ref.index)
        assert store.read_json(index_rel) == index
        view[compression] = {
            "index": index_view(index, compression),
            "parts": [part_view(store, index_rel, part) for part in index["parts"]],
            "files": sorted(files(tmp_path / compression / "hidden_states")),
        }
    return view


def index_view(index: dict[str, Any], compression: str) -> dict[str, Any]:
    """The index, less what it records of its input (the sequences' checksum, the stage key) and, under zstd, of
    the compressed bytes (their size and checksum: a zstd build's to decide)."""
    view = {key: value for key, value in index.items() if key not in ("sequences_sha256", "stage_key")}
    if compression != "none":
        view["parts"] = [{**part, "bytes": "compressed", "blake3": "compressed"} for part in index["parts"]]
    return view


def part_view(store: RunStore, index_rel: str, part: dict[str, Any]) -> dict[str, Any]:
    """A part's metadata, its tensors' names, dtypes and shapes (not the compressed ones': their length is the
    compressor's), and the bytes of what a reader decodes from it."""
    data = store.read_bytes(posixpath.join(posixpath.dirname(index_rel), part["file"]))
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    compressed = re.compile(r"\.zstd(_bytes)?$")
    return {
        "metadata": header.pop("__metadata__", {}),
        "stored": {name: {"dtype": spec["dtype"], **({} if compressed.search(name) else {"shape": spec["shape"]})}
                   for name, spec in header.items()},
        "decoded": {name: [str(tensor.dtype), list(tensor.shape),
                           hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
                    for name, tensor in sorted(read_part(store, index_rel, part).items())},
    }


# ---- the check -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    output: StageOutput
    constant: str  # the StageOutput's name
    module: str  # where it is declared
    build: Callable[[Path], Any]  # the stage's output for the fixed input, as plain JSON values


STAGES = {
    "prompts": Stage(PROMPTS, "PROMPTS", "tasks/prompts.py", prompts_output),
    "generations": Stage(GENERATIONS, "GENERATIONS", "tasks/generation/records.py", generations_output),
    "validation": Stage(VALIDATION, "VALIDATION", "tasks/validation.py", validation_output),
    "sequences": Stage(SEQUENCES, "SEQUENCES", "tasks/sequences.py", sequences_output),
    "hidden_states": Stage(HIDDEN_STATES, "HIDDEN_STATES", "tasks/hidden_states/task.py", hidden_states_output),
}


@pytest.mark.parametrize("name", list(STAGES))
def test_a_stage_whose_output_changed_has_a_new_version(name: str, tmp_path: Path) -> None:
    stage = STAGES[name]
    assert stage.output.stage == name
    got = digest(stage.build(tmp_path))
    version = stage.output.version
    golden_version, golden = GOLDEN[name]
    if version != golden_version:
        pytest.fail(f"{stage.constant}.version is {version}, GOLDEN[{name!r}] was taken at {golden_version}: set "
                    f"GOLDEN[{name!r}] to ({version}, {got!r}) in tests/unit/test_output_versions.py")
    assert got == golden, (
        f"the {name} stage's output changed: bump {stage.constant}.version in {stage.module} and set "
        f"GOLDEN[{name!r}] to ({version + 1}, {got!r})")


def test_every_stage_output_is_pinned_here() -> None:
    declared = {match[1]: path.relative_to(REPO).as_posix() for path in sorted((REPO / "tasks").rglob("*.py"))
                for match in re.finditer(r'StageOutput\(\s*"(\w+)"', path.read_text(encoding="utf-8"))}
    missing = sorted(set(declared) - set(STAGES))
    assert not missing, (f"stage {missing[0]} ({declared[missing[0]]}) has no fixed input here: add its builder to "
                         "STAGES and its digest to GOLDEN in tests/unit/test_output_versions.py")
