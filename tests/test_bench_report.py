"""A bench's JSON is valid JSON (no Infinity or NaN): Python's json module, told to refuse
those constants, reads it back, and each one replaced is named with its reason."""

from __future__ import annotations

import json
import math

import pytest

from loraplex.benchmarks.report import write_json


def _refuse(constant: str):
    raise ValueError(f"not JSON: {constant}")


def test_infinite_and_nan_figures_are_written_as_null_with_their_reason(tmp_path):
    path = tmp_path / "out" / "bench.json"
    write_json(path, {"w": {"ratio": math.inf, "p99": [0.5, math.nan]}, "n": 3, "s": "x"})

    data = json.loads(path.read_text(), parse_constant=_refuse)
    assert data["w"] == {"ratio": None, "p99": [0.5, None]}
    assert data["n"] == 3 and data["s"] == "x"
    assert set(data["non_finite"]) == {"w.ratio", "w.p99[1]"}
    assert "ratio over 0" in data["non_finite"]["w.ratio"]
    with pytest.raises(ValueError):  # the oracle refuses what json.dumps writes by default
        json.loads(json.dumps({"r": math.inf}), parse_constant=_refuse)


def test_finite_figures_are_written_unchanged(tmp_path):
    path = tmp_path / "bench.json"
    results = {"a": [1, 2.5, None], "b": {"c": True}}
    write_json(path, results)
    assert json.loads(path.read_text(), parse_constant=_refuse) == results
