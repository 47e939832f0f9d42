"""What every `loraplex bench` suite does with its figures: progress on stderr, JSON on request."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_json(path: Path | None, results: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {path}")
