"""loraplex's cache folder: what set-up fetches (the demo model) and what is built on first
use (LoRA's compiled CPU loops), on this machine."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LORAPLEX_CACHE_DIR"


def cache_dir() -> Path:
    """$LORAPLEX_CACHE_DIR, else ~/.cache/loraplex."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "loraplex").expanduser()
