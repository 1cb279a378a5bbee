"""The configuration reference (docs/config-reference.md), rendered from the config model itself.

Every key's type, default and description come from `PipelineConfig`, so the reference cannot drift from what
the config accepts; a unit test fails when the committed file differs from what this renders.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from eagle3_datagen.config import PipelineConfig

REGENERATE = "make docs"

_HEADER = f"""# Configuration reference

Every key of a run's YAML config, generated from the config model (`eagle3_datagen/config.py`) by
`{REGENERATE}`: edit the field descriptions there, not this file. The annotated example, model profiles and
thinking modes are in [configuration.md](configuration.md).
"""


_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _bounded(name: str, metadata: list[Any]) -> str:
    """`int > 0`, `float >= 0`, `float in [0, 1]`: a number type with the bounds its field declares."""
    bounds = {kind: getattr(m, kind) for m in metadata if (kind := type(m).__name__.lower()) in _SIGNS}
    low = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
    high = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds["le"]) if "le" in bounds else None
    if low and high:
        return f"{name} in {low[0]}{low[1]}, {high[1]}{high[0]}"
    return " ".join([name, *(f"{_SIGNS[kind]} {value}" for kind, value in bounds.items())])


def _type(annotation: Any, metadata: list[Any] | None = None) -> str:
    """How a field's type reads in the reference: `each | last | rollout`, `int > 0, optional`, `list[str]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type(args[0], [*(metadata or []), *annotation.__metadata__])
    if origin in (Union, types.UnionType):
        text = " | ".join(_type(arg) for arg in args if arg is not type(None))
        return f"{text}, optional" if type(None) in args else text
    if origin is Literal:
        return " | ".join(str(arg) for arg in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type(arg) for arg in args)}]"
    if _is_model(annotation):
        return "object"
    if annotation is Any:
        return "any"
    return _bounded(annotation.__name__, metadata or [])


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory else field.default
    if isinstance(value, BaseModel):
        return "its keys' defaults"
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def _nested(name: str, annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """The model a field holds (itself, in a list or in a dict by name) and how its keys continue: `.`, `[].`,
    `.<mode>.`; None for a plain value."""
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    inner = args[0] if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1 else annotation
    origin, inner_args = get_origin(inner), get_args(inner)
    if _is_model(inner):
        return ".", inner
    if origin is list and _is_model(inner_args[0]):
        return "[].", inner_args[0]
    if origin is dict and _is_model(inner_args[1]):
        return f".<{name.removesuffix('s')}>.", inner_args[1]
    return None


def _rows(fields: dict[str, FieldInfo], prefix: str) -> Iterator[str]:
    """One row per key; a list or dict of models is followed by the keys of its entries."""
    for name, field in fields.items():
        cells = (f"`{prefix}{name}`", f"`{_type(field.annotation, field.metadata)}`", _default(field),
                 " ".join((field.description or "").split()))
        yield "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
        if nested := _nested(name, field.annotation):
            yield from _rows(nested[1].model_fields, f"{prefix}{name}{nested[0]}")


def _table(rows: Iterator[str]) -> str:
    return "| key | type | default | description |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"


def render(model: type[BaseModel] = PipelineConfig) -> str:
    """The reference: a table of the top-level keys, then one per section in the model's order."""
    top = {name: field for name, field in model.model_fields.items() if not _nested(name, field.annotation)}
    parts = [_HEADER, "## Top level\n", _table(_rows(top, ""))]
    for name, field in model.model_fields.items():
        if nested := _nested(name, field.annotation):
            required = " Required." if field.is_required() else ""
            rows = _rows(nested[1].model_fields, name + nested[0])
            parts += [f"## {name}\n", f"{field.description}{required}\n", _table(rows)]
    return "\n".join(parts)
