"""Whether a stage's output is done: storage says so, and nothing else does.

A stage's key is the digest of its inputs (the shards it reads, by content hash), its settings and its output
version. The stage writes the key beside its output (in the shard's marker, report or index); the output is done
when storage holds a record whose key equals the key computed now. The task checks that first and hands the
output on as Prefect's Cached state (`handed_on`); Prefect's own result cache is not used, so a cached result can
never stand for an output that storage no longer holds (settings A, B, then A again; a deleted folder).

Code is not in the key: an upgrade that refactors a stage reuses every output. A stage bumps its `version` when
its output changes, and `tests/unit/test_output_versions.py` (a fixed input and the digest of its output per
stage) fails when the output changes without a bump.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from pydantic import BaseModel

from eagle3_datagen.storage import RunStore

T = TypeVar("T")


def canonical(value: Any) -> Any:
    """`value` as plain JSON values, the same in every process. Fields left at their defaults are left out: a
    new setting that changes nothing while unset changes no key."""
    if isinstance(value, BaseModel):
        return canonical(value.model_dump(mode="json", exclude_defaults=True))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: canonical(getattr(value, field.name)) for field in dataclasses.fields(value)
                if not _at_default(field, getattr(value, field.name))}
    if isinstance(value, dict):
        return {str(key): canonical(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"a stage key cannot hold a {type(value).__name__}")


def _at_default(field: dataclasses.Field[Any], value: Any) -> bool:
    if field.default is not dataclasses.MISSING:
        return bool(value == field.default)
    if field.default_factory is not dataclasses.MISSING:
        return bool(value == field.default_factory())
    return False


@dataclass(frozen=True)
class StageOutput:
    """A stage's claim on storage: its name, its output version, and where the key an output was made under
    (`stage_key`) is recorded, given the stage's first input (a shard's `ShardRef`): a JSON file of the run, or
    with `marked` the output file whose completion marker records it (and vouches for the file's size)."""

    stage: str
    version: int
    record: Callable[[Any], str]
    marked: bool = False

    def key(self, **inputs: Any) -> str:
        """The digest of the stage, its output version and `inputs` (the shards read, the settings)."""
        payload = {"stage": self.stage, "version": self.version, "inputs": canonical(inputs)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def done(self, store: RunStore, first: Any, key: str) -> dict[str, Any] | None:
        """The record of the output made from `first` when it holds `key` (the output is done); None otherwise."""
        path = self.record(first)
        if self.marked:
            recorded = store.read_marker(path)
        else:
            try:
                recorded = store.read_json(path)
            except FileNotFoundError:
                return None
        return recorded if isinstance(recorded, dict) and recorded.get("stage_key") == key else None


def handed_on(value: T, key: str) -> T:
    """An output storage holds under `key` already, handed on without work: inside a task run as Prefect's Cached
    state (the UI and the command's stage lines count it so, and Prefect's own cache is never asked), as itself in
    a plain call."""
    from prefect.context import TaskRunContext
    from prefect.states import Completed

    if TaskRunContext.get() is None:
        return value
    return cast(T, Completed(data=value, name="Cached", message=f"stored under stage key {key[:12]}"))
