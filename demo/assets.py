"""The demo assets: the real model (SmolLM2-135M-Instruct, a GGUF file fetched at set-up,
see `smollm.py`) and the demo adapters trained for it (committed under `adapters/`, see
`scripts/train_adapters.py`), copied into one folder that `loraplex up`, `generate` and the README
use. `loraplex demo-assets --synthetic` writes the small random model of `synthetic.py`
instead (fast tests)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.demo.behaviours import BEHAVIOURS
from loraplex.demo.smollm import GGUF_NAME, MODEL_ID, demo_model_path

ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"
DEMO_ADAPTERS = tuple(b.adapter for b in BEHAVIOURS)
DEMO_MODEL_ID = MODEL_ID
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True, slots=True)
class DemoAssets:
    model: Path  # a checkpoint folder or a .gguf file
    adapters_dir: Path
    adapter_names: tuple[str, ...]


def demo_assets_complete(dest: Path) -> DemoAssets | None:
    """The demo assets already in `dest`, or None when something is missing."""
    model = dest / "model" / GGUF_NAME
    adapters = dest / "adapters"
    if model.is_file() and all(
        (adapters / n / f).is_file() for n in DEMO_ADAPTERS for f in ADAPTER_FILES
    ):
        return DemoAssets(model, adapters, DEMO_ADAPTERS)
    return None


def make_demo_assets(dest: Path, *, progress: Callable[[str], None] | None = None) -> DemoAssets:
    """dest/model/<the GGUF> (a hard link to the set-up cache where the file system allows,
    else a copy) and dest/adapters/<name>/ for every demo adapter. ModelNotFetched when
    set-up has not fetched the model."""
    report = progress or (lambda _message: None)
    source = demo_model_path()
    model = dest / "model" / GGUF_NAME
    model.parent.mkdir(parents=True, exist_ok=True)
    if not model.is_file() or model.stat().st_size != source.stat().st_size:
        report(f"placing {MODEL_ID} ({source.stat().st_size >> 20} MiB, GGUF) at {model}")
        partial = model.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        try:
            os.link(source, partial)
        except OSError:
            shutil.copyfile(source, partial)
        partial.replace(model)
    adapters = dest / "adapters"
    for name in DEMO_ADAPTERS:
        report(f"writing adapter {name} to {adapters / name}")
        (adapters / name).mkdir(parents=True, exist_ok=True)
        for file in ADAPTER_FILES:
            shutil.copyfile(ADAPTERS_DIR / name / file, adapters / name / file)
    return DemoAssets(model, adapters, DEMO_ADAPTERS)
