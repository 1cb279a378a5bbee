"""The tiny models the tests serve: the ones `make setup` built, else built now."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def built_model(variable: str, build: Callable[[], Path]) -> Path:
    """The model folder $`variable` names when it is built (`make setup` builds them all), else `build()`."""
    given = os.environ.get(variable)
    if given and (Path(given) / "model.safetensors").is_file():
        return Path(given)
    return build()
