"""Cache keys for the stages: everything that changes a result, code included.

Prefect's TASK_SOURCE hashes only the decorated function, not the stage's core functions it calls nor the
shared plumbing; a fix there would silently keep stale results. `StageCode` hashes the whole stage module and
the plumbing modules that shape outputs.
"""

from __future__ import annotations

import hashlib
import sys
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


@cache
def code_version(module_name: str) -> str:
    """sha256 of a stage's source plus the shared modules every stage's output depends on."""
    package = Path(__file__).resolve().parent
    files = [*stage_files(module_name), *(package / f"{name}.py" for name in _PLUMBING)]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


@dataclass
class StageCode(CachePolicy):
    """The code version of the task's stage (see `code_version`)."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any] | None,
                    flow_parameters: dict[str, Any] | None, **kwargs: Any) -> str | None:
        return code_version(task_ctx.task.fn.__module__) if task_ctx else None


STAGE_CACHE = INPUTS + StageCode()
