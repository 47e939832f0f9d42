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
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A lone surrogate can only come from a \uD800-\uDFFF escape: UTF-8 cannot carry one raw.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class NotStrictJSON(ValueError):
    """Valid for Python's json module, not for the JSON standard or for loraplex."""


def loads(data: bytes | str) -> Any:
    """The value of `data`, a JSON text. ValueError (json.JSONDecodeError for text that is
    not JSON at all, NotStrictJSON for what the standard does not allow), RecursionError for
    nesting deeper than Python's stack, UnicodeDecodeError for bytes that are not UTF-8."""
    raw = data.encode() if isinstance(data, str) else data
    value = json.loads(
        raw,
        object_pairs_hook=_no_duplicate_keys,
        parse_constant=_no_constant,
        parse_float=_finite_float,
        parse_int=_int64,
    )
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(value)
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise NotStrictJSON(f"duplicate key {_cut(key)!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> float:
    raise NotStrictJSON(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotStrictJSON(f"number {_cut(text)} is out of the range of a 64-bit float")
    return value


def _int64(text: str) -> int:
    if len(text) > 20:  # int() of thousands of digits is slow (and refused past 4,300)
        raise NotStrictJSON(f"integer {_cut(text)} is out of the 64-bit range")
    value = int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise NotStrictJSON(f"integer {text} is out of the 64-bit range")
    return value


def _refuse_lone_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise NotStrictJSON("a string holds a lone UTF-16 surrogate escape") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
