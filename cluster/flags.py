"""Command-line flags derived from settings: one flag per field, named after it
(`max_num_seqs` → `--max-num-seqs`), with its type, choices, doc and default as declared
in the settings class. A flag not given is absent from the values, so the class's own
default applies, and the values are validated by the class itself: a flag accepts exactly
what the YAML key it mirrors accepts, and a refusal names the flag.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar

from pydantic import TypeAdapter, ValidationError

from loraplex.cluster.errors import CLIError
from loraplex.settings import declared_fields

T = TypeVar("T")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    owner: type,
    names: Iterable[str] | None = None,
    *,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Flags for `owner`'s fields (`names`, default all), each with the option strings in
    `aliases` (field name -> an older flag) too."""
    declared = declared_fields(owner)
    for name in declared if names is None else names:
        field = declared[name]
        options = [flag(name)] + ([aliases[name]] if aliases and name in aliases else [])
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        kind = _optional_of(field.annotation)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            kwargs |= {"action": "append", "type": typing.get_args(kind)[0]}
        elif typing.get_origin(kind) is Literal:
            choices = typing.get_args(kind)
            kwargs |= {"choices": choices, "type": type(choices[0])}
        else:
            kwargs["type"] = kind
        default = field.get_default(call_default_factory=True)
        shown = "" if default is None or default == [] else f" (default: {default})"
        kwargs["help"] = ((field.description or "") + shown).replace("%", "%%")
        parser.add_argument(*options, **kwargs)


def flag_values(
    args: argparse.Namespace, owner: type, names: Iterable[str] | None = None
) -> dict[str, Any]:
    """The values of `owner`'s flags (`names`, default all) that were given."""
    names = declared_fields(owner) if names is None else names
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def from_flags(args: argparse.Namespace, owner: type[T]) -> T:
    """`owner` built from its flags that were given; CLIError naming each refused flag."""
    return built(lambda: TypeAdapter(owner).validate_python(flag_values(args, owner)))


def built(make: Callable[[], T]) -> T:
    """`make()`, its ValidationError a CLIError naming each refused flag."""
    try:
        return make()
    except ValidationError as e:
        raise CLIError(refusal(e)) from None


def refusal(error: ValidationError) -> str:
    """One line per problem, naming the flag: `--max-lora-rank: Input should be ... (got 0)`."""
    lines = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        if not problem["loc"]:  # a check across fields
            lines.append(message)
            continue
        lines.append(f"{flag(str(problem['loc'][0]))}: {message} (got {problem['input']!r})")
    return "; ".join(lines)


def _optional_of(annotation: Any) -> Any:
    """`X` of `X | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (kind,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kind
    return annotation
