#!/usr/bin/env bash
# The whole test suite, in two runs: the tests that start no Ray cluster on two processes
# (pytest-xdist; they are CPU-bound and independent, ~10.5 min alone, ~5.5 on two), then the
# tests marked `ray` in this process, one after the other, with the machine to themselves as
# before: each starts real Ray clusters whose timings two cores are sized for.
# With arguments it is one plain pytest run of them (a file, a -k expression, ...).
# Exit status: the first run's that failed, else 0; pytest's 5 (no test collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
workers=${LORAPLEX_TEST_WORKERS:-2}
status=0
printf '\n==> tests without Ray, on %s processes\n' "$workers"
"${PYTEST[@]}" -m "not ray" -n "$workers" || status=$?
printf '\n==> tests with a real Ray cluster, one at a time\n'
"${PYTEST[@]}" -m ray || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
