"""JSON as RFC 8259 has it, for untrusted input (every part may use this floor module).

Python's `json` reads more than the standard: `NaN`, `Infinity` and `-Infinity`; `1e400` as
inf; a 400-digit integer; a later duplicate key silently replacing an earlier one; and a lone
surrogate escape (`"\\ud800"`) as a str that cannot be encoded again. Each of these reached a
500 further in (a 422 handler that cannot serialise the value it echoes, an OverflowError
converting to float, a UnicodeEncodeError). `loads` refuses them all with a ValueError that
names the problem, so the edge answers 400 before anything else reads the value.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A lone surrogate can only come from a \uD800-\uDFFF escape: UTF-8 cannot carry one raw.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class NotStrictJSON(ValueError):
    """Valid for Python's json module, not for the JSON standard or for loraplex. `path` is
    where in the value the problem is (object keys and list indexes; empty when unknown)."""

    def __init__(self, problem: str, path: tuple[str | int, ...] = ()) -> None:
        where = ".".join(str(step) for step in path)
        super().__init__(f"{where}: {problem}" if where else problem)
        self.problem = problem
        self.path = path


class _Refused:
    """Stands in the parsed value for a number the standard does not allow, so that the
    error can name where it was (the parser's hooks do not know)."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


def loads(data: bytes | str) -> Any:
    """The value of `data`, a JSON text. ValueError (json.JSONDecodeError for text that is
    not JSON at all, NotStrictJSON for what the standard does not allow), RecursionError for
    nesting deeper than Python's stack, UnicodeDecodeError for bytes that are not UTF-8."""
    raw = data.encode() if isinstance(data, str) else data
    refused: list[_Refused] = []

    def refuse(problem: str) -> _Refused:
        refused.append(_Refused(problem))
        return refused[-1]

    def finite_float(text: str) -> float | _Refused:
        value = float(text)
        if math.isfinite(value):
            return value
        return refuse(f"number {_cut(text)} is out of the range of a 64-bit float")

    def int64(text: str) -> int | _Refused:
        # int() of thousands of digits is slow (and refused past 4,300)
        if len(text) <= 20 and INT64_MIN <= (value := int(text)) <= INT64_MAX:
            return value
        return refuse(f"integer {_cut(text)} is out of the 64-bit range")

    value = json.loads(
        raw,
        object_pairs_hook=_no_duplicate_keys,
        parse_constant=lambda name: refuse(f"{name} is not a JSON number"),
        parse_float=finite_float,
        parse_int=int64,
    )
    if refused:
        path, found = _first(value, lambda item: isinstance(item, _Refused))
        raise NotStrictJSON(found.problem if found else refused[0].problem, path)
    if _SURROGATE_ESCAPE.search(raw):
        path, found = _first(value, _lone_surrogate)
        if found is not None:
            raise NotStrictJSON("a string holds a lone UTF-16 surrogate escape", path)
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise NotStrictJSON(f"duplicate key {_cut(key)!r}")
        out[key] = value
    return out


def _lone_surrogate(item: Any) -> bool:
    if not isinstance(item, str):
        return False
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _first(value: Any, wanted: Callable[[Any], bool]) -> tuple[tuple[str | int, ...], Any]:
    """(path, item) of the first item of `value` (depth first, keys included) that is
    `wanted`; ((), None) if none is."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if wanted(item):
            return path, item
        if isinstance(item, dict):
            for key, child in reversed(item.items()):
                if wanted(key):
                    return (*path, key), key
                stack.append(((*path, key), child))
        elif isinstance(item, list):
            stack.extend(((*path, i), child) for i, child in reversed(list(enumerate(item))))
    return (), None


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
