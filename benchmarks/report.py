"""What every `loraplex bench` suite does with its figures: progress on stderr, JSON on request."""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

# when the bench began (this module is imported as it starts): the run's metadata
_STARTED = (datetime.datetime.now(datetime.UTC), os.getloadavg())


def run_metadata() -> dict[str, Any]:
    """How the run went: its date, command, cores and the 1-minute load average when it
    began and now (a ratio from a loaded machine is read with that in mind)."""
    started, before = _STARTED
    return {
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["loraplex", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "load_average": {"before": round(before[0], 2), "after": round(os.getloadavg()[0], 2)},
    }


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
    out["run"] = run_metadata()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, allow_nan=False) + "\n")
    log(f"wrote {path}")
