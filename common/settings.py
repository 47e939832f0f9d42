"""Each setting is declared once; every other place that shows it copies it from there.

A setting (its name, type, bounds, default and one-line doc) is one pydantic `Field` in
the class of the layer that uses it: the engine's in replica/, the router's in router/,
the registry's in registry/. The YAML model, the CLI flags, the chart's values.schema.json
and what crosses Ray take it from that class: by composing the class itself, or, where
the operator sees it under another name or unit, through `setting`:

    class EngineSettings(BaseModel):
        pool_mib: int | None = setting(EngineConfig, "pool_bytes", unit=MiB)

tests/test_settings_once.py fails when two places declare one setting, or when a copy's
annotation differs from its source's.
"""

from __future__ import annotations

import copy
from typing import Any

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

KiB = 1 << 10
MiB = 1 << 20
_UNIT_NAMES = {KiB: "KiB", MiB: "MiB"}
# The config of every settings class (pydantic models and the engine's slotted pydantic
# dataclasses): an unknown key is an error naming it, never silently dropped.
FORBID_EXTRA = ConfigDict(extra="forbid")


def declared_fields(owner: type) -> dict[str, FieldInfo]:
    """The fields of a pydantic model or pydantic dataclass."""
    if issubclass(owner, BaseModel):
        return dict(owner.model_fields)
    fields = getattr(owner, "__pydantic_fields__", None)
    if fields is None:
        raise TypeError(f"{owner.__name__} is neither a pydantic model nor a pydantic dataclass")
    return dict(fields)


def setting(owner: type, name: str, *, unit: int = 1) -> Any:
    """`owner`'s field `name` (default, bounds, doc) for another model to declare under its
    own name; with `unit`, counted in multiples of `unit` of the source's unit (a field in
    bytes shown in MiB: `unit=MiB`). Bounds round inwards; a default must be a multiple."""
    source = declared_fields(owner)[name]
    if unit == 1:
        return copy.copy(source)
    where = f"{owner.__name__}.{name}"
    bounds: dict[str, int] = {}
    for bound in source.metadata:
        if isinstance(bound, annotated_types.Ge):
            bounds["ge"] = -(-int(bound.ge) // unit)
        elif isinstance(bound, annotated_types.Le):
            bounds["le"] = int(bound.le) // unit
        else:
            raise TypeError(f"{where}: {bound!r} has no meaning in units of {unit}")
    default = source.default
    if default is not None:
        assert default % unit == 0, f"{where}: default {default} is not a multiple of {unit}"
        default //= unit
    description = f"{source.description} In {_UNIT_NAMES.get(unit, f'units of {unit}')}."
    return Field(default, description=description, **bounds)


def describe(error: ValidationError) -> str:
    """One line per problem: `replicas.num_replicas: Input should be ... (got 0)`. Values
    of fields named `password` are shown as ***; a model's own check shows no value."""
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "config"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = "unknown setting"
        value = problem.get("input")
        shown = (
            problem["type"] != "missing"
            and bool(problem["loc"])
            and not isinstance(value, dict | list)
        )
        if shown and problem["loc"][-1] == "password":
            value = "***"
        got = f" (got {value!r})" if shown else ""
        lines.append(f"{where}: {message}{got}")
    return "; ".join(lines)
