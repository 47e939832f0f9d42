#!/usr/bin/env bash
# mypy over the modules whose types are kept exact (pyproject's [tool.mypy] has the options).
# The folders are mapped onto `loraplex.*` by setuptools' package-dir, which mypy cannot
# read: it checks them through a tree of links laid out as the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/loraplex"
for f in common/*.py; do ln -s "$PWD/$f" "$tree/loraplex/"; done
for p in cluster demo replica router registry kernels benchmarks; do ln -s "$PWD/$p" "$tree/loraplex/$p"; done
MYPYPATH="$tree" .venv/bin/mypy \
  -p loraplex.router.policy \
  -p loraplex.replica.memory.pool \
  -m loraplex.replica.demand \
  -m loraplex.router.autoscaling \
  -p loraplex.registry \
  -m loraplex.adapter_format \
  -m loraplex.errors \
  -m loraplex.checkpoint_shape
