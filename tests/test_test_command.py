"""The suite's own command: the README gives it, `.ci/run` runs exactly it, and
`scripts/test.sh` passes pytest's exit status on (5, no test collected, fails CI)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command():
    readme = (REPO / "README.md").read_text()
    section = readme.split("Whole test suite", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.S)
    assert command, "the README's test command is not in a bash block after 'Whole test suite'"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert command.group(1).strip() in ci, f".ci/run does not run {command.group(1)!r}"


def test_the_test_script_passes_on_pytests_exit_status_when_nothing_is_collected():
    python = REPO / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("scripts/test.sh runs .venv's pytest: run scripts/setup.sh first")
    done = subprocess.run(
        ["bash", "scripts/test.sh", "tests/test_layers.py", "-k", "no_such_test_anywhere"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 5, done.stdout[-2000:] + done.stderr[-2000:]
