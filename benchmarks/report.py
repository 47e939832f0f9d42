"""What every `loraplex bench` suite does with its figures: progress on stderr, JSON on request."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def finite_json(results: Any) -> tuple[Any, dict[str, str]]:
    """`results` with each infinite or NaN float as null (JSON has neither), and why, by
    the key's path: an infinite figure is a ratio whose denominator was 0."""
    why: dict[str, str] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            why[path] = "not a number" if math.isnan(x) else f"{x}: a ratio over 0"
            return None
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
        return x

    return walk(results, ""), why


def write_json(path: Path | None, results: dict) -> None:
    if path is None:
        return
    out, why = finite_json(results)
    if why:
        out["non_finite"] = why
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, allow_nan=False) + "\n")
    log(f"wrote {path}")
