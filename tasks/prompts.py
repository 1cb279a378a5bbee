"""Stage 2: read a prompt dataset, turn each row into chat messages, and write fixed-size prompt shards.

The core (load_rows, normalize_messages, prompt_id, write_prompt_shards, build_prompt_shards) is plain Python
so it can be tested without Prefect; `load_prompts` is the thin task around it. A row that cannot become a
prompt is rejected with a reason in rejected/prompts.jsonl instead of stopping the run.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from eagle3_datagen.artifacts import (
    IMAGE_FILES,
    PROMPTS_DONE,
    PROMPTS_SUMMARY,
    REJECTED_PATH,
    PromptLoadResult,
    ShardRef,
    holds_answers,
    sha256_hex,
    shard_name,
)
from eagle3_datagen.caching import StageOutput, handed_on
from eagle3_datagen.config import DataConfig, ImagesConfig, PipelineConfig
from eagle3_datagen.conversations import user_turns
from eagle3_datagen.errors import Eagle3Error, Log, UserError, retry_unless_user_error
from eagle3_datagen.fingerprints import data_fingerprint
from eagle3_datagen.holdout import HoldoutChooser
from eagle3_datagen.images import (
    IMAGE_TEXT_PLACEHOLDER,
    ImageLimits,
    ImageReader,
    ImageRejected,
    checked_image,
    files_fingerprint,
    image_name,
    image_names,
    image_part,
    image_path,
    is_image_part,
)
from eagle3_datagen.modes import DEFAULT_MODE, ModeWeight, assign_mode
from eagle3_datagen.profiles import ModelProfile
from eagle3_datagen.storage import RunLocation, RunStore, marker_path

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)
PromptFormat = Literal["auto", "sharegpt", "openai"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "function_call",
}
# (column, role key, text key) of each accepted form; "auto" takes the first whose column the row fills.
_SHAREGPT = ("conversations", "from", "value")
_OPENAI = ("messages", "role", "content")
_FORMS = {"sharegpt": (_SHAREGPT,), "openai": (_OPENAI,), "auto": (_SHAREGPT, _OPENAI)}
_IMAGE_COLUMNS = ("images", "image")  # LLaVA-Instruct's `image`, ShareGPT4V's and Parquet datasets' `images`


# Hermes function calling (NousResearch): calls, results and the offered tools as tagged blocks in the text
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
HERMES_RESULT = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)
HERMES_TOOLS = re.compile(r"<tools>\s*([\[{].*?)\s*</tools>", re.DOTALL)  # not the prose's "<tools></tools>"


class RowRejected(Eagle3Error, ValueError):
    """A row that cannot become a prompt: its reason is logged and the run goes on."""


class DataSourceError(UserError, ValueError):
    """The dataset as a whole cannot be used (missing, empty, no prompt column, every row rejected)."""


class DataSourceMissing(DataSourceError, FileNotFoundError):
    """`data.source` names a local path that does not exist."""


@dataclass(frozen=True)
class UnreadableRow:
    """A line of a JSONL file that is not a JSON object: rejected with its line number, the run goes on."""

    reason: str


def load_rows(source: str, split: str = "train", limit: int | None = None) -> Iterator[dict[str, Any] | UnreadableRow]:
    """Rows of a hub dataset or of local files, streamed so a large dataset is never copied or held whole."""
    import datasets  # here, not at the top: a re-run whose prompts are cached reads no dataset and need not import it

    local = Path(source).expanduser()
    if local.exists():
        builder, files = _local_files(local)
        if all(file.endswith(".jsonl") for file in files):
            return islice(_jsonl_rows(files), limit)
        if all(Path(file).stat().st_size == 0 for file in files):
            raise DataSourceError(f"data.source {source} is empty: there are no rows to read; check the file")
        # A bad byte becomes U+FFFD so only its row is rejected, instead of the whole file failing to decode.
        # datasets applies encoding_errors only to an encoding not spelled "utf-8", hence the "utf_8" alias.
        options = {"encoding": "utf_8", "encoding_errors": "replace"} if builder == "json" else {}
        dataset = _undecoded_images(datasets.load_dataset(builder, data_files={split: files}, split=split,
                                                          streaming=True, **options))
    elif source.startswith(("/", ".", "~")) or local.suffix in _BUILDERS:
        raise DataSourceMissing(
            f"data.source {source}: no such file or folder; give an existing .jsonl/.json/.parquet file, "
            "a folder of them, or a Hugging Face dataset id"
        )
    else:
        dataset = _undecoded_images(datasets.load_dataset(source, split=split, streaming=True))
    return islice(iter(dataset), limit)


def _undecoded_images(dataset: datasets.IterableDataset) -> datasets.IterableDataset:
    """The dataset's image features as the bytes it holds ({bytes, path}), not decoded pictures: an image is named
    by those bytes, which a picture encoded again would change."""
    import datasets

    for name, feature in (dataset.features or {}).items():
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(name, datasets.Image(decode=False))
        elif isinstance(getattr(feature, "feature", None), datasets.Image):
            dataset = dataset.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return dataset


def _jsonl_rows(files: list[str]) -> Iterator[dict[str, Any] | UnreadableRow]:
    """JSONL rows read line by line, so one torn or invalid line costs one row (named by its line), not the file.

    A bad byte becomes U+FFFD, which rejects only its row ("not valid UTF-8"), as for the other formats.
    """
    for file in files:
        with open(file, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                if not raw.strip():
                    continue
                where = f"{Path(file).name} line {number}"
                try:
                    row = json.loads(raw.decode("utf-8", errors="replace"))
                except json.JSONDecodeError as error:
                    yield UnreadableRow(f"{where} is not valid JSON ({error.msg} at column {error.colno})")
                    continue
                yield row if isinstance(row, dict) else UnreadableRow(f"{where} is not a JSON object")


def dataset_folder(source: str) -> Path:
    """Where a row's relative image paths start: the dataset file's folder, the dataset folder, else here."""
    local = Path(source).expanduser()
    return local.parent if local.is_file() else local if local.is_dir() else Path.cwd()


def image_limits(images: ImagesConfig) -> ImageLimits:
    return ImageLimits(images.max_bytes, images.max_pixels, images.fetch_timeout_s)


def _local_files(path: Path) -> tuple[str, list[str]]:
    """The datasets builder and the files of a local source: one file, or every data file under a folder."""
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise DataSourceError(f"data.source {path}: unsupported file type; use a .jsonl, .json or .parquet file")
        return _BUILDERS[path.suffix], [str(path)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS)
    if not files:
        raise DataSourceError(f"data.source {path}: the folder holds no .jsonl, .json or .parquet files")
    builders = {_BUILDERS[p.suffix] for p in files}
    if len(builders) > 1:
        raise DataSourceError(f"data.source {path}: the folder mixes JSON and Parquet files; keep one kind")
    return builders.pop(), [str(p) for p in files]


def normalize_conversation(row: dict[str, Any], fmt: PromptFormat = "auto") -> list[dict[str, Any]]:
    """A row's whole conversation as chat messages: {role, content}, an assistant's `tool_calls`, and tool results
    as {role: tool, tool_call_id, name, content} (`name`: the function whose call they answer).

    Reads OpenAI messages (assistant `tool_calls`, `tool` messages with `tool_call_id`) and ShareGPT turns
    (`function_call` and `observation` turns, as LLaMA-Factory writes function calling; Hermes' `<tool_call>` and
    `<tool_response>` blocks in `gpt` and `tool` turns, its system prompt's `<tools>` offered as the row's tools
    and the prompt itself left to the served template). Raises RowRejected with a short reason when the row is
    unusable.
    """
    form = next((f for f in _FORMS[fmt] if row.get(f[0]) is not None), None)
    if form is None:
        raise RowRejected(f"no {' or '.join(f[0] for f in _FORMS[fmt])} value")
    column, role_key, text_key = form
    turns = row[column]
    if not isinstance(turns, list):
        raise RowRejected(f"{column} is a {type(turns).__name__}, not a list of turns")
    messages: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []  # the last assistant's calls, which the tool results that follow answer
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowRejected(f"turn {i} is not a {{{role_key}, {text_key}}} object")
        role = turn.get(role_key)
        if not isinstance(role, str) or role.lower() not in _ROLES:
            raise RowRejected(f"turn {i} has unknown role {role!r}")
        role = _ROLES[role.lower()]
        if role == "function_call":
            calls = _sharegpt_calls(turn.get(text_key), i)
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        text = turn.get(text_key)
        if isinstance(text, list):
            text = content_parts(text, i)
        if role == "assistant" and turn.get("tool_calls"):
            calls = _openai_calls(turn["tool_calls"], i)
            text = text or ""
        if isinstance(text, list):
            if role != "user":
                raise RowRejected(f"turn {i} ({role}) shows images; only user turns may")
            messages.append({"role": role, "content": text})
            continue
        if not isinstance(text, str):
            raise RowRejected(f"turn {i} {text_key} is {type(text).__name__}, not a string")
        if not _is_valid_utf8(text):
            raise RowRejected("text is not valid UTF-8")
        if role == "user" and not text.strip():
            raise RowRejected(f"turn {i} is an empty user turn")
        if role == "assistant" and HERMES_CALL.search(text):
            calls = _hermes_calls(text, i)
            messages.append({"role": "assistant", "content": HERMES_CALL.sub("", text).strip(), "tool_calls": calls})
        elif role == "tool" and HERMES_RESULT.search(text):
            messages += _hermes_results(text, calls, messages, i)
        elif role == "tool":
            messages.append(_tool_result(turn, text, calls, messages, i))
        elif role == "assistant" and turn.get("tool_calls"):
            messages.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif role == "system" and HERMES_TOOLS.search(text):
            continue  # Hermes' function-calling prompt: its tools are offered, the served template words the rest
        else:
            messages.append({"role": role, "content": text})
    if not any(message["role"] == "user" for message in messages):
        raise RowRejected("no user turn")
    return _with_row_images(messages, row)


def content_parts(parts: list[Any], turn: int) -> list[dict[str, Any]] | str:
    """An OpenAI content list: text parts, and image parts with their reference as the row gives it (stored by
    `StoredImages`). A list of text parts only is the text vLLM makes of it (joined by newlines)."""
    read: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            read.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part["image_url"].get("url") if isinstance(part.get("image_url"), dict) else part.get("image_url")
            read.append(image_part(url))
        elif kind == "image":
            read.append(image_part(part.get("image", part.get("url"))))
        else:
            raise RowRejected(f"turn {turn} has a content part of type {kind!r}; expected text, image_url or image")
    if not any(is_image_part(part) for part in read):
        return "\n".join(part["text"] for part in read)
    if not all(_is_valid_utf8(part["text"]) for part in read if part["type"] == "text"):
        raise RowRejected("text is not valid UTF-8")
    return read


def _with_row_images(messages: list[dict[str, Any]], row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's `image`/`images` column placed where its turns show an image without a reference: an `<image>` in
    the text (LLaVA, ShareGPT4V) or an `{"type": "image"}` part (TRL's and Parquet datasets' rows). With no such
    place, the images open the first user turn, as LLaVA's loader places them."""
    column = next((name for name in _IMAGE_COLUMNS if row.get(name) not in (None, [], "")), None)
    if column is None:
        return messages
    images = row[column] if isinstance(row[column], list) else [row[column]]
    messages = [{**message, "content": _split_marks(message["content"])} for message in messages]
    places = [part for message in messages if isinstance(message["content"], list) for part in message["content"]
              if is_image_part(part) and part["image"] is None]
    if not places:
        first = next(i for i, message in enumerate(messages) if message["role"] == "user")
        opening = [image_part(None) for _ in images]
        content = messages[first]["content"]
        messages[first] = {**messages[first], "content": opening + (
            content if isinstance(content, list) else [{"type": "text", "text": content}])}
        places = opening
    if len(places) != len(images):
        raise RowRejected(f"the turns show {len(places)} images but the {column} column holds {len(images)}")
    if any(message["role"] != "user" and isinstance(message["content"], list) for message in messages):
        raise RowRejected("an image is placed in a turn other than a user's; only user turns may show images")
    for place, image in zip(places, images, strict=True):
        place["image"] = image
    return messages


def _split_marks(content: Any) -> Any:
    """Text with `<image>` marks as content parts, each mark an image part still without its reference."""
    if not isinstance(content, str) or IMAGE_TEXT_PLACEHOLDER not in content:
        return content
    texts = content.split(IMAGE_TEXT_PLACEHOLDER)
    parts = [image_part(None) if k % 2 else {"type": "text", "text": texts[k // 2]} for k in range(2 * len(texts) - 1)]
    return [part for part in parts if part["type"] == "image" or part["text"]]


class StoredImages:
    """The prompt stage's images: each read once, checked, and written to the run under its content's name."""

    def __init__(self, store: RunStore, reader: ImageReader) -> None:
        self.store = store
        self.reader = reader
        self.written: set[str] = set()

    def stored(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with each image part naming its stored image; RowRejected for an unusable image."""
        if not any(isinstance(message["content"], list) for message in messages):
            return messages
        return [{**message, "content": [self._part(part) for part in message["content"]]}
                if isinstance(message["content"], list) else message for message in messages]

    def _part(self, part: dict[str, Any]) -> dict[str, Any]:
        if not is_image_part(part):
            return part
        try:
            data = self.reader.read(part["image"])
            name = image_name(data, checked_image(data, self.reader.limits))
        except ImageRejected as why:
            raise RowRejected(str(why)) from None
        if name not in self.written:
            if not self.store.exists(image_path(name)):
                self.store.write_bytes(image_path(name), data)
            self.written.add(name)
        return image_part(name)


def normalize_messages(row: dict[str, Any], fmt: PromptFormat = "auto") -> list[dict[str, Any]]:
    """The prompt of one row: its turns up to and including the last user turn.

    Trailing assistant turns are dropped because the target model regenerates the answer; earlier assistant
    and system turns stay as context (tool results as the protocol sends them).
    """
    return _up_to_last_user(normalize_conversation(row, fmt))


def _up_to_last_user(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last_user = max(i for i, message in enumerate(conversation) if message["role"] == "user")
    return [_as_sent(message) for message in conversation[: last_user + 1]]


def _as_sent(message: dict[str, Any]) -> dict[str, Any]:
    """A tool result as a request carries it: a template may read `name` as the speaker's."""
    return {key: value for key, value in message.items() if key != "name"} if message["role"] == "tool" else message


def _openai_calls(calls: Any, turn: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):
        raise RowRejected(f"turn {turn} tool_calls is not a list of {{id, function: {{name, arguments}}}}")
    return [{"id": str(call.get("id") or f"call_{turn}_{k}"), "type": "function",
             "function": {"name": call["function"]["name"], "arguments": _arguments(call["function"], turn)}}
            for k, call in enumerate(calls)]


def _sharegpt_calls(value: Any, turn: int) -> list[dict[str, Any]]:
    """A ShareGPT `function_call` turn: a JSON object {name, arguments}, or a list of them (parallel calls)."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        raise RowRejected(f"turn {turn} function_call is not JSON") from None
    parsed = parsed if isinstance(parsed, list) else [parsed]
    if not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in parsed):
        raise RowRejected(f"turn {turn} function_call is not a {{name, arguments}} object or a list of them")
    return [{"id": f"call_{turn}_{k}", "type": "function",
             "function": {"name": call["name"], "arguments": _arguments(call, turn)}} for k, call in enumerate(parsed)]


def _arguments(function: dict[str, Any], turn: int) -> str:
    """A call's arguments as the protocol carries them: a JSON string."""
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        return arguments
    try:
        return json.dumps(arguments, ensure_ascii=False)
    except TypeError:
        raise RowRejected(f"turn {turn} has tool-call arguments that are not JSON") from None


def _loose_json(text: str, what: str) -> Any:
    """JSON, or the Python literal Hermes datasets often write instead (single quotes, True/None)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise RowRejected(f"{what} is not JSON") from None


def _hermes_calls(text: str, turn: int) -> list[dict[str, Any]]:
    """The `<tool_call>{name, arguments}</tool_call>` blocks of a Hermes `gpt` turn, in order (parallel calls)."""
    parsed = [_loose_json(block, f"turn {turn} <tool_call>") for block in HERMES_CALL.findall(text)]
    if not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in parsed):
        raise RowRejected(f"turn {turn} <tool_call> is not a {{name, arguments}} object")
    return [{"id": f"call_{turn}_{k}", "type": "function",
             "function": {"name": call["name"], "arguments": _arguments(call, turn)}} for k, call in enumerate(parsed)]


def _hermes_results(text: str, calls: list[dict[str, Any]], before: list[dict[str, Any]],
                    index: int) -> list[dict[str, Any]]:
    """The `<tool_response>{name, content}</tool_response>` blocks of a Hermes `tool` turn, each paired with the
    next unanswered call of its function."""
    results: list[dict[str, Any]] = []
    for block in HERMES_RESULT.findall(text):
        response = _loose_json(block, f"turn {index} <tool_response>")
        if not isinstance(response, dict) or not isinstance(response.get("name"), str):
            raise RowRejected(f"turn {index} <tool_response> is not a {{name, content}} object")
        answered = {r["tool_call_id"] for r in results}
        call = next((c for c in calls if c["function"]["name"] == response["name"] and c["id"] not in answered), None)
        if call is None:
            raise _without_call(index)
        content = response.get("content", "")
        content = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        results.append(_tool_result({"tool_call_id": call["id"]}, content, calls, [*before, *results], index))
    return results


def _hermes_tools(conversation: Any) -> list[dict[str, Any]] | None:
    """The tools a Hermes system prompt declares in `<tools>…</tools>`, if the conversation has one."""
    if not isinstance(conversation, list):
        return None
    systems = [turn["value"] for turn in conversation if isinstance(turn, dict) and turn.get("from") == "system"
               and isinstance(turn.get("value"), str)]
    found = next((match for text in systems if (match := HERMES_TOOLS.search(text))), None)
    if found is None:
        return None
    tools = _loose_json(found.group(1), "the system prompt's <tools>")
    return tools if isinstance(tools, list) else [tools]


def _tool_result(turn: dict[str, Any], text: str, calls: list[dict[str, Any]], before: list[dict[str, Any]],
                 index: int) -> dict[str, Any]:
    """A tool result and the function it answers: the call its `tool_call_id` names, else the next call in order."""
    answered = next((k for k, message in enumerate(reversed(before)) if message["role"] != "tool"), len(before))
    wanted = turn.get("tool_call_id")
    call = next((c for c in calls if c["id"] == wanted), None) if wanted else (
        calls[answered] if answered < len(calls) else None)
    if call is None or not before or before[-1 - answered]["role"] != "assistant":
        raise _without_call(index)
    return {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": text}


def _without_call(index: int) -> RowRejected:
    return RowRejected(f"turn {index} is a tool result without a call before it")


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The functions a row offers the model (`tools`, a list or its JSON text), in the protocol's shape."""
    tools = row.get("tools")
    if tools in (None, "", []):
        tools = _hermes_tools(row.get(_SHAREGPT[0]))
    if tools in (None, "", []):
        return None
    try:
        tools = json.loads(tools) if isinstance(tools, str) else tools
    except json.JSONDecodeError:
        raise RowRejected("tools is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RowRejected("tools is not a list of function definitions")
    wrapped = [tool if tool.get("type") == "function" and isinstance(tool.get("function"), dict)
               else {"type": "function", "function": tool} for tool in tools]
    if not all(isinstance(tool["function"].get("name"), str) for tool in wrapped):
        raise RowRejected("a tool in tools has no name")
    return wrapped


def user_turn_prompts(conversation: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """One prompt per user turn: the conversation up to and including it (earlier turns are context)."""
    return [conversation[: i + 1] for i, message in enumerate(conversation) if message["role"] == "user"]


def rollout_script(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a rollout asks: the system and user messages, and the recorded tool results by function, in the order
    of the calls they answer. The dataset's answers are another model's words: the target answers every turn
    itself, on its own earlier answers."""
    script: list[dict[str, Any]] = []
    order: dict[str, int] = {}
    for message in conversation:
        if message["role"] == "assistant":
            order = {call["id"]: k for k, call in enumerate(message.get("tool_calls") or [])}
        elif message["role"] == "tool":
            script.append({"role": "tool", "name": message["name"], "content": message["content"],
                           "order": order[message["tool_call_id"]]})
        else:
            script.append(message)
    return _in_call_order(script)


def _in_call_order(script: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results sorted by the position of its call (`order`, then dropped)."""
    ordered: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []
    for message in [*script, None]:
        if message is not None and message["role"] == "tool":
            run.append(message)
            continue
        ordered += [{key: value for key, value in result.items() if key != "order"}
                    for result in sorted(run, key=lambda result: result["order"])]
        run = []
        if message is not None:
            ordered.append(message)
    return ordered


def rollout_id(script: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """A conversation's id: apart from every single prompt's id, so records made under another `data.turns` are
    never taken for a rollout's turns."""
    return prompt_id([{"role": "rollout", "content": ""}, *script], tools)


def _is_valid_utf8(text: str) -> bool:
    """False for lone surrogates and for U+FFFD, the mark load_rows leaves where a byte was not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\ufffd" not in text


def prompt_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """Hash of the messages' (and offered tools') canonical JSON: the same conversation gets the same id in any run
    or source order."""
    canonical = json.dumps(messages if tools is None else [*messages, {"tools": tools}], sort_keys=True,
                           ensure_ascii=False, separators=(",", ":"))
    return sha256_hex(canonical.encode("utf-8"))[:16]


class SeenIds:
    """The prompt ids seen so far and the input row of each, as 8-byte integers (an id is 16 hex digits) in sorted
    arrays: 16 bytes a prompt, where a dict of the hex strings held about 200 (a million prompts' 200 MB). The
    ids since the last merge wait in a small dict."""

    MERGE_EVERY = 1 << 16

    def __init__(self) -> None:
        self._ids = np.empty(0, dtype=np.uint64)
        self._rows = np.empty(0, dtype=np.int64)
        self._recent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._ids) + len(self._recent)

    def row_of(self, prompt_id: str) -> int | None:
        """The row the id was first seen in, or None."""
        key = int(prompt_id, 16)
        if key in self._recent:
            return self._recent[key]
        at = int(np.searchsorted(self._ids, np.uint64(key)))
        return int(self._rows[at]) if at < len(self._ids) and int(self._ids[at]) == key else None

    def add(self, prompt_id: str, row: int) -> None:
        self._recent[int(prompt_id, 16)] = row
        if len(self._recent) >= self.MERGE_EVERY:
            ids = np.concatenate([self._ids, np.fromiter(self._recent, np.uint64, len(self._recent))])
            rows = np.concatenate([self._rows, np.fromiter(self._recent.values(), np.int64, len(self._recent))])
            order = np.argsort(ids, kind="stable")  # two sorted runs: merged, not sorted anew
            self._ids, self._rows, self._recent = ids[order], rows[order], {}


def write_prompt_shards(
    rows: Iterable[dict[str, Any] | UnreadableRow],
    store: RunStore,
    shard_size: int,
    fmt: PromptFormat = "auto",
    source: str = "the dataset",
    turns: str = "each",
    holdout: HoldoutChooser | None = None,
    mode_of: Callable[[str], str] = lambda _: DEFAULT_MODE,
    images: ImageReader | None = None,
) -> PromptLoadResult:
    """Normalize rows in input order, write accepted prompts as shards of `shard_size`, log every rejection.

    With `turns="each"` a multi-turn row gives one prompt per user turn (one training sample per assistant
    turn, each with its own regenerated reasoning); a prompt already seen (a shared first question) is skipped,
    and a row whose prompts were all seen is rejected as a duplicate. With `turns="rollout"` a row is one
    conversation (`turns` user turns), asked turn by turn on the target's own answers by generation.

    `holdout` sees every prompt id with its mode (`mode_of`) to choose the held-out prompts (none without it).
    `images` reads the rows' images (default: paths relative to the working directory, the default limits); each
    is stored in the run once, and a row whose image cannot be used is rejected with the reason.

    Raises DataSourceError when the first readable row has no prompt column (a wrong dataset, not bad rows) and when no
    row at all was accepted.
    """
    shards: list[ShardRef] = []
    batch: list[dict[str, Any]] = []
    rejections: list[dict[str, Any]] = []
    first_row_of = SeenIds()
    holdout = holdout or HoldoutChooser(share=0.0, min_per_mode=0)
    stored = StoredImages(store, images or ImageReader(Path.cwd(), image_limits(ImagesConfig())))
    read = accepted = image_prompts = images_shown = 0
    checked = False
    for index, row in enumerate(rows):
        read += 1
        try:
            if isinstance(row, UnreadableRow):
                raise RowRejected(row.reason)
            if not checked:
                _check_columns(row, fmt, source)
                checked = True
            conversation = stored.stored(normalize_conversation(row, fmt))
            tools = row_tools(row)
        except RowRejected as why:
            rejections.append({"row": index, "stage": "prompts", "reason": str(why)})
            continue
        if turns == "rollout":
            prompts = [rollout_script(conversation)]
            ids = [rollout_id(prompts[0], tools)]
        else:
            asked = _up_to_last_user(conversation)
            prompts = user_turn_prompts(asked) if turns == "each" else [asked]
            ids = [prompt_id(messages, tools) for messages in prompts]
        new = [(turn, pid, messages) for turn, (pid, messages) in enumerate(zip(ids, prompts, strict=True))
               if first_row_of.row_of(pid) is None]
        if not new:
            reason = f"duplicate of id {ids[-1]} (row {first_row_of.row_of(ids[-1])})"
            rejections.append({"row": index, "id": ids[-1], "stage": "prompts", "reason": reason})
            continue
        accepted += 1
        for turn, pid, messages in new:
            first_row_of.add(pid, index)
            holdout.add(pid, mode_of(pid))
            where = {"turns": user_turns(messages)} if turns == "rollout" else {"turn": turn}
            offered = {"tools": tools} if tools else {}
            shown = len(image_names(messages))
            image_prompts, images_shown = image_prompts + bool(shown), images_shown + shown
            batch.append({"id": pid, "messages": messages, "row": index, **where, **offered})
            if len(batch) == shard_size:
                shards.append(store.write_shard("prompts", len(shards), batch))
                batch = []
    if batch:
        shards.append(store.write_shard("prompts", len(shards), batch))
    store.write_jsonl(REJECTED_PATH, rejections)
    if stored.reader.files_read:
        store.write_json(IMAGE_FILES, stored.reader.files_read)
    else:
        store.remove(IMAGE_FILES)
    split = holdout.split()
    store.write_json(PROMPTS_SUMMARY, {"rows": read, "accepted_rows": accepted, "rejected_rows": len(rejections),
                                       "prompts": len(first_row_of), "shards": len(shards),
                                       "holdout": split.model_dump(),
                                       **({"images": len(stored.written), "image_prompts": image_prompts,
                                           "images_shown": images_shown} if stored.written else {})})
    written = {ref.path for ref in shards}
    for stale in store.list("prompts", ".jsonl"):  # left by an earlier run that had more shards
        if stale not in written:
            store.remove(stale)
            store.remove(marker_path(stale))

    result = PromptLoadResult(shards, read, accepted, len(rejections), split, len(stored.written), image_prompts,
                              images_shown)
    assert result.rows == result.accepted + result.rejected
    assert sum(ref.num_records for ref in shards) == len(first_row_of)
    if not result.rows:
        raise DataSourceError(f"{source}: no rows were read; check data.source, data.split and data.limit")
    if not result.accepted:
        raise DataSourceError(
            f"{source}: every one of its {result.rows} rows was rejected; "
            f"see {store.uri}/{REJECTED_PATH} for the reasons"
        )
    return result


def retire_shards_beyond(store: RunStore, count: int) -> list[str]:
    """Remove every later stage's files of prompt shards the layout no longer has (the dataset shrank, or
    `shard_size` grew): their prompts now sit in other shards, and a folder read whole by a trainer must never hold
    a prompt twice. Their answers stay for generation, which adopts them where their prompts are now, then removes
    them. Returns what it removed."""
    retired = [rel for rel in store.shard_files_outside(set(range(count))) if not holds_answers(rel)]
    for rel in retired:
        store.remove(rel)
    return retired


def _check_columns(row: dict[str, Any], fmt: PromptFormat, source: str) -> None:
    """Fail fast on a dataset with no prompt column at all, which per-row rejection would hide."""
    if any(column in row for column, _, _ in _FORMS[fmt]):
        return
    expected = " or ".join(f"`{column}` [{{{rk}, {tk}}}]" for column, rk, tk in _FORMS[fmt])
    raise DataSourceError(
        f"{source}: no prompt column; found columns [{', '.join(map(str, row))}], expected {expected} "
        f"(data.format: {fmt})"
    )


class ImagePromptsUnsupported(UserError):
    """The dataset shows images the run's settings cannot turn into exact samples."""


def check_image_prompts(prompts: PromptLoadResult, profile: ModelProfile, backend: str) -> None:
    """Before any request: image prompts need the profile's image token, and a backend that sends images."""
    if not prompts.image_prompts:
        return
    if profile.image_token is None:
        raise ImagePromptsUnsupported(
            f"{prompts.image_prompts} prompts show images but the model profile names no image_token: set it in "
            "the profile (e.g. `<|media_pad|>` for Kimi-K2.5, `<|image_pad|>` for Qwen-VL), or use a text dataset")
    if backend == "vllm":
        raise ImagePromptsUnsupported(
            f"{prompts.image_prompts} prompts show images, which the vllm hidden-states backend does not send yet: "
            "set hidden_states.backend: transformers")


@dataclass(frozen=True)
class PromptSettings:
    """What the prompt stage's output depends on: the data section, the mode mix (which prompts of each mode are
    held out), the dataset's content fingerprint (a local file edited in place is read again) and that of the local
    image files the stage read last time (a picture redrawn in place is read again; URLs are read once)."""

    data: DataConfig
    modes: list[ModeWeight]
    source_fingerprint: str
    image_files_fingerprint: str = ""  # "" where the stage read no local image file (a text dataset)

    @classmethod
    def from_config(cls, config: PipelineConfig) -> PromptSettings:
        store = RunStore(config.output_uri, config.run_name)
        images = files_fingerprint(store.read_json(IMAGE_FILES)) if store.exists(IMAGE_FILES) else ""
        return cls(config.data, config.generation.mode_mix(config.profile), data_fingerprint(config.data.source),
                   images)


def build_prompt_shards(data: DataConfig, store: RunStore, log: Log = logger,
                        modes: Sequence[ModeWeight] = ()) -> PromptLoadResult:
    """The whole stage for one data config and mode mix (default: one mode), without Prefect."""
    rows = load_rows(data.source, data.split, data.limit)
    result = write_prompt_shards(rows, store, data.shard_size, data.format, source=data.source, turns=data.turns,
                                 holdout=HoldoutChooser(data.holdout, data.holdout_min_per_mode),
                                 mode_of=lambda pid: assign_mode(pid, modes) if modes else DEFAULT_MODE,
                                 images=ImageReader(dataset_folder(data.source), image_limits(data.images)))
    if retired := retire_shards_beyond(store, len(result.shards)):
        log.warning("removed %d files and folders of %s and later shards, made for an earlier shard layout: their "
                    "prompts are in other shards now", len(retired), shard_name(len(result.shards)))
    return result


# Bump `version` when the shards, rejections or summary written for the same data and settings change.
PROMPTS = StageOutput("prompts", version=1, record=lambda settings: PROMPTS_DONE)


@task(name="load-prompts", task_run_name="{run.run_name}/load-prompts", retries=1,
      retry_condition_fn=retry_unless_user_error, persist_result=True, cache_policy=NO_CACHE)
def load_prompts(settings: PromptSettings, run: RunLocation) -> PromptLoadResult:
    """Prefect task: stage 2 for the run folder `run`; shards made under this key already are read from their
    record, not from the dataset."""
    store = run.store()
    key = PROMPTS.key(settings=settings)
    if (done := PROMPTS.done(store, settings, key)) is not None:
        return handed_on(PromptLoadResult.of_record(done["result"]), key)
    try:
        log: Log = get_run_logger()
    except MissingContextError:  # called as a plain function (`load_prompts.fn`)
        log = logger
    store.remove(PROMPTS_DONE)  # nothing vouches for shards while they are cut again
    result = build_prompt_shards(settings.data, store, log, settings.modes)
    store.write_json(PROMPTS_DONE, {"stage_key": key, "result": result.as_record()})
    return result
