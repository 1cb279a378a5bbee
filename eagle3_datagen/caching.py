"""Cache keys for the stages: everything that changes a result, code included.

Prefect's TASK_SOURCE hashes only the decorated function, not the stage's core functions it calls nor the
shared plumbing; a fix there would silently keep stale results. `StageCode` hashes the whole stage module and
the plumbing modules that shape outputs, as code: docstrings, comments and field descriptions do not count.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, CachePolicy
from prefect.context import TaskRunContext

_PLUMBING = ("artifacts", "config", "fingerprints", "hidden_state_format", "modes", "profiles", "protocol",
             "storage", "think_tokens")


def stage_files(module_name: str) -> list[Path]:
    """The stage's source: its module, or every module of its package (`tasks.hidden_states.task` → the package)."""
    file = Path(sys.modules[module_name].__file__ or "")
    in_package = module_name.count(".") >= 2 or file.name == "__init__.py"
    return sorted(file.parent.glob("*.py")) if in_package else [file]


# pydantic Field keywords that only document (the deployment form's text): they cannot change an output
_DOC_KEYWORDS = frozenset({"description", "title", "examples"})
_SCOPES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def source_digest(files: list[Path]) -> str:
    """sha256 of the files' code without docstrings, comments and field descriptions: editing what changes no
    output must not invalidate every cached stage of every run."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + _code(file.read_bytes(), file.name) + b"\0")
    return digest.hexdigest()


@cache
def _code(source: bytes, filename: str) -> bytes:
    """The source's syntax tree without what only documents; parsed once (the plumbing is in every stage)."""
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        if isinstance(node, _SCOPES) and ast.get_docstring(node, clean=False) is not None:
            node.body = node.body[1:]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Field":
            node.keywords = [keyword for keyword in node.keywords if keyword.arg not in _DOC_KEYWORDS]
    return ast.dump(tree, annotate_fields=True, include_attributes=False).encode()


_PARSING = threading.Lock()  # two stage modules imported in two threads (Ray workers) parse one at a time


@cache
def code_version(module_name: str) -> str:
    """The digest of a stage's source plus the shared modules every stage's output depends on."""
    package = Path(__file__).resolve().parent
    with _PARSING:
        return source_digest([*stage_files(module_name), *(package / f"{name}.py" for name in _PLUMBING)])


@dataclass(kw_only=True)
class StageCode(CachePolicy):
    """The code version of a stage (see `code_version`), fixed when its module is imported.

    Parsing later, in a task's thread, can fail: CPython 3.11's ast module counts depth in one global, so a parse
    in another thread (a traceback being formatted; a garbage-collected finalizer switches threads mid-parse)
    ends either with "AST constructor recursion depth mismatch".
    """

    version: str

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any] | None,
                    flow_parameters: dict[str, Any] | None, **kwargs: Any) -> str | None:
        return self.version


def stage_cache(module_name: str) -> CachePolicy:
    """The cache policy of the stage whose module is `module_name`: its inputs and its code."""
    return INPUTS + StageCode(version=code_version(module_name))


@dataclass(kw_only=True)
class OutputMadeFrom(CachePolicy):
    """A cached shard result counts only while the stage's output in storage says it was made from the same input.

    A shard's output is one file slot: input A, then B (a dataset re-cut), then A again would find A's cached
    result vouching for the file B's run wrote over it. `record(index)` is the file that names the input's sha256
    under `key`; an output made from other input makes the key another one, so the stage runs again. An output
    made from this input, or none yet, leaves the key as it was, so a re-run of a finished run stays cached.
    Where the record is a marker written after the output, an output without one (a run killed between the two
    writes) is made from nobody knows what, and runs again too.
    """

    input_name: str  # the task's ShardRef parameter the output is made from
    record: Callable[[int], str]  # shard index -> the run-relative JSON file that records it
    key: str
    output: Callable[[int], str] | None = None  # shard index -> the output, where the record is a file apart

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any] | None,
                    flow_parameters: dict[str, Any] | None, **kwargs: Any) -> str | None:
        ref, run = (inputs or {}).get(self.input_name), (inputs or {}).get("run")
        if ref is None or run is None:
            return None
        store, path = run.store(), self.record(ref.index)
        if not store.exists(path):
            unvouched = self.output is not None and store.exists(self.output(ref.index))
            return "output without its record" if unvouched else None
        made_from = store.read_json(path).get(self.key)
        return None if made_from in (None, ref.sha256) else f"output made from {made_from}"
