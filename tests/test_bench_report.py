"""A bench's JSON is valid JSON (no Infinity or NaN): Python's json module, told to refuse
those constants, reads it back, and each one replaced is named with its reason."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.benchmarks.performance_page import SUITES, _run_detail, read_runs, render
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
    written = json.loads(path.read_text(), parse_constant=_refuse)
    assert written.pop("run")  # how the run went (the next test)
    assert written == results


def test_a_bench_json_says_how_its_run_went(tmp_path):
    path = tmp_path / "bench.json"
    write_json(path, {"ratio": 1.5})
    run = json.loads(path.read_text())["run"]
    assert run["command"].startswith("loraplex")
    assert run["cpus"] >= 1 and set(run["load_average"]) == {"before", "after"}
    assert run["date"][:2] == "20"


@contextlib.contextmanager
def _on_one_cpu() -> Iterator[None]:
    """This thread confined to one of the CPUs it may use, then given them all back."""
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        yield
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_bench_json_counts_the_cpus_its_run_could_use(tmp_path):
    """A process confined to fewer CPUs than the machine has (an affinity mask, a
    container's cpuset) records those it could use: on 2026-12-06 a whole session's
    processes had inherited one core of two, and every bench JSON still said 2."""
    path = tmp_path / "bench.json"
    with _on_one_cpu():
        write_json(path, {"ratio": 1.5})
    run = json.loads(path.read_text())["run"]
    assert run["cpus"] == 1
    assert run["cpus_on_machine"] == os.cpu_count()
    # and the versions it ran, the baselines' among them
    assert run["versions"]["torch"] == importlib.metadata.version("torch")
    assert run["versions"]["peft"] == importlib.metadata.version("peft")
    if os.cpu_count() != 1:
        assert f"1 of {os.cpu_count()} CPUs" in _run_detail({"run": run})


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
    reason="needs CPU affinity and two CPUs",
)
def test_a_bench_says_when_it_may_use_fewer_cpus_than_the_machine(capsys):
    from loraplex.cluster.cli import _note_confined_cpus

    with _on_one_cpu():
        _note_confined_cpus()
    assert f"may run on 1 of the machine's {os.cpu_count()} CPUs" in capsys.readouterr().err


def test_the_performance_page_is_the_committed_json_rendered():
    """docs/performance.md is generated (`loraplex bench report`): edited by hand, or the
    JSON changed without regenerating it, this fails."""
    root = Path(__file__).resolve().parents[1]
    runs = read_runs(root / "docs" / "bench")
    assert (root / "docs" / "performance.md").read_text() == render(runs)


def test_the_headline_table_marks_targets_and_runs(tmp_path):
    (tmp_path / "registry.json").write_text(
        json.dumps(
            {
                "register_per_s": 2000.0,
                "propagation_p99_ms": 80.0,
                "quick": True,
                "run": {"date": "2026-11-26T18:00:00+00:00", "load_average": {"before": 1.0}},
            }
        )
    )
    page = render(read_runs(tmp_path))
    rows = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| `")}
    assert "| 2,000 | >= 500 | yes |" in rows["| `registry` `register_per_s`"]
    assert "| 80 | <= 50 | **no** |" in rows["| `registry` `propagation_p99_ms`"]
    assert "not in this run" in rows["| `registry` `restart_resync_s`"]
    assert "2026-11-26 quick" in rows["| `registry` `register_per_s`"]
    assert "not run" in rows["| `engine` `speedup_vs_peft`"]
    assert all(f"### {suite}" in page for suite in SUITES)


@pytest.mark.parametrize(
    ("key", "value", "shown", "mark"),
    [
        ("speedup_vs_peft", 3.9956, "3.996", "**no**"),  # >= 4
        ("speedup_vs_peft", 4.0004, "4", "yes"),
        ("lora_overhead", 0.1500001, "0.1500001", "**no**"),  # <= 0.15
    ],
)
def test_a_figure_beside_its_target_shows_the_digits_that_decide_it(
    tmp_path, key: str, value: float, shown: str, mark: str
):
    """Rounded to 3 digits, 3.9956 read "4 | >= 4 | **no**" (bench engine, 2026-12-06): a
    figure shows as many digits as it takes to be on its target's side."""
    (tmp_path / "engine.json").write_text(json.dumps({key: value, "quick": True}))
    rows = render(read_runs(tmp_path)).splitlines()
    row = next(line for line in rows if line.startswith(f"| `engine` `{key}`"))
    assert f"| {shown} | " in row and f"| {mark} |" in row, row


def test_an_infinite_ratio_is_shown_as_such_not_as_missing(tmp_path):
    """A goodput ratio over a baseline's 0 is written as null with its reason; the page
    shows it as infinite (and a >= target as met), not as a figure the run lacks."""
    results = {
        "workloads": {
            "hot": {
                "goodput_ratio_vs_best_ray_router": math.inf,
                "goodput_ratio_vs_best_ray_router_ci_low": 1.3,
            }
        },
        "quick": True,
    }
    write_json(tmp_path / "router.json", results)
    page = render(read_runs(tmp_path))
    rows = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| `")}
    key = "| `router` `workloads.hot.goodput_ratio_vs_best_ray_router_ci_low`"
    assert "| 1.3 | >= 1.0 | yes |" in rows[key]
    infinite = rows.get("| `router` `workloads.shift.goodput_ratio_vs_best_ray_router`")
    assert infinite is not None and "not in this run" in infinite  # absent: said so
    results["workloads"]["shift"] = {"goodput_ratio_vs_best_ray_router": math.inf}
    write_json(tmp_path / "router.json", results)
    page = render(read_runs(tmp_path))
    rows = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| `")}
    shown = rows["| `router` `workloads.shift.goodput_ratio_vs_best_ray_router`"]
    assert "∞" in shown and "| >= 1.2 | yes |" in shown, shown


def test_a_ratio_the_sweep_never_separated_is_not_counted_as_met(tmp_path):
    """The quick run of 2026-11-28: on hot, affinity and multiplexing both held the SLO at
    the sweep's top rate (64.4 req/s) in all three repetitions, so both goodputs were that
    rate and the ratio 1.0 was the ceiling, shown as "yes" against a target of >= 1.0."""
    top = {"affinity": 64.4, "pow2": 57.6, "multiplex": 64.4}
    held = {"affinity": True, "pow2": False, "multiplex": True}
    rep = {"goodput_rps": top, "held_slo_at_top_rate": held}
    parted = {
        "goodput_rps": {**top, "affinity": 50.0},
        "held_slo_at_top_rate": {**held, "affinity": False},
    }
    results = {
        "workloads": {
            "hot": {"goodput_ratio_vs_best_ray_router_ci_low": 1.0, "repetitions": [rep] * 3},
            "zipf": {
                "goodput_ratio_vs_best_ray_router_ci_low": 1.0,
                "repetitions": [rep, parted, rep],
            },
        },
        "quick": True,
    }
    write_json(tmp_path / "router.json", results)
    page = render(read_runs(tmp_path))
    rows = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| `")}
    hot = rows["| `router` `workloads.hot.goodput_ratio_vs_best_ray_router_ci_low`"]
    assert "| 1 | >= 1.0 | — (all held the SLO at the top rate) |" in hot
    zipf = rows["| `router` `workloads.zipf.goodput_ratio_vs_best_ray_router_ci_low`"]
    assert "| 1 | >= 1.0 | yes |" in zipf


@pytest.mark.parametrize(
    ("floor", "peer_reads", "mark"),
    [
        (46, 46, "| **no** (multiplexing at the floor: each new adapter read once) |"),
        (46, 74, "| 0.625 | <= 0.7 | yes |"),
        # the warm-up reads the whole catalog: one re-read is above a floor of 0 (reads over
        # max(1, floor) is 1 there, which the mark once took for the floor)
        (0, 1, "| 0.75 | <= 0.7 | **no** |"),
        (0, 0, "| **no** (multiplexing at the floor: each new adapter read once) |"),
    ],
    ids=["at-floor", "above-floor", "one-re-read", "no-read"],
)
def test_a_reads_ratio_against_a_peer_at_the_floor_says_so(floor, peer_reads, mark):
    """The quick run of 2026-12-02: at the reference rate affinity and multiplexing each
    read exactly the adapters new to the fleet in every repetition (zipf 37 / 47 / 46), so
    the ratio 1.0 cannot reach <= 0.7: still a miss, with why beside it. A peer above the
    floor gets the plain mark."""
    ours = {46: 46.25, 0: 0.75}[floor] if peer_reads != 74 else 46.25
    results = {
        "workloads": {
            "zipf": {
                "reads_ratio_vs_multiplex": ours / peer_reads if peer_reads else math.inf,
                "reads_floor": floor,
                "reads": {"affinity": ours, "pow2": 97, "multiplex": peer_reads},
                "reads_vs_floor": {"multiplex": peer_reads / max(1, floor)},
            }
        },
        "quick": True,
    }
    page = render({"router": results})
    (row,) = (
        line for line in page.splitlines() if "`workloads.zipf.reads_ratio_vs_multiplex`" in line
    )
    assert mark in row, row


@pytest.mark.parametrize(
    ("clairvoyant", "mark"),
    [
        (0.699, "| **no** (a clairvoyant fleet of whole replicas: 0.699) |"),
        (0.55, "| 0.902 | <= 0.6 | **no** |"),  # reachable by such a fleet: a plain miss
        (None, "| 0.902 | <= 0.6 | **no** |"),  # a run from before the bound
    ],
    ids=["bound-above-target", "bound-below-target", "no-bound"],
)
def test_the_hours_against_the_static_fleet_say_where_a_clairvoyant_fleet_lands(clairvoyant, mark):
    """The quick day of 2026-11-28: lora's hours 0.902 of the static fleet's against a
    target of 0.6, which is the day's mean rate over its peak: only fractional replicas
    reach it. Where a clairvoyant fleet of whole replicas misses it too, the miss says so."""
    bound = {} if clairvoyant is None else {"replica_hours_clairvoyant_vs_static": clairvoyant}
    results = {"autoscale": {"replica_hours_ratio_vs_static": 0.902, **bound}, "quick": True}
    page = render({"autoscale": results})
    (row,) = (
        line for line in page.splitlines() if "`autoscale.replica_hours_ratio_vs_static`" in line
    )
    assert mark in row, row


def test_a_reads_ratio_of_two_routers_that_read_nothing_says_so():
    """The quick run of 2026-12-02 (the warm-up reading the whole catalog): affinity and
    multiplexing each read no adapter at the reference rate, so the ratio has no value;
    the table said "not in this run"."""
    results = {
        "workloads": {
            "zipf": {"reads_floor": 0, "reads": {"affinity": 0.0, "pow2": 97.0, "multiplex": 0.0}}
        },
        "quick": True,
    }
    page = render({"router": results})
    (row,) = (
        line for line in page.splitlines() if "`workloads.zipf.reads_ratio_vs_multiplex`" in line
    )
    assert "| — (0 / 0: neither read an adapter) | <= 0.7 | — |" in row, row


# A module-level state a round could leave behind: a fresh process starts it at 0.
_ROUNDS_SEEN_HERE = [0]


def _engine_round(args):
    """A stand-in for one round of `bench engine`: who ran it, and what it found left."""
    _ROUNDS_SEEN_HERE[0] += 1
    if args.fail:
        raise RuntimeError("this round broke")
    return {
        "pid": os.getpid(),
        "rounds_seen": _ROUNDS_SEEN_HERE[0],
        "x_ratio": 1.0 + args.k,
        "prefix": {},  # the bench prints its prefix section (stubbed below) from the results
    }


def _engine_args(tmp_path, fail=False):
    import argparse

    return argparse.Namespace(repeat=3, json=tmp_path / "engine.json", fail=fail, k=0.5)


def test_each_round_of_bench_engine_repeat_runs_in_a_fresh_process(tmp_path, monkeypatch):
    """`bench engine --repeat N`: a round in the process of the one before it inherits
    what that one left, and measured slower for it; each round gets its own process (and
    none runs in the bench's), its figures come back, and the medians are taken as before."""
    from loraplex.benchmarks.engine import bench

    monkeypatch.setattr(bench, "_one_round", _engine_round)
    monkeypatch.setattr(bench, "_print_table", lambda results: None)
    monkeypatch.setattr(bench, "print_prefix", lambda prefix: None)

    assert bench.run_bench(_engine_args(tmp_path)) == 0
    data = json.loads((tmp_path / "engine.json").read_text())
    pids = [r["pid"] for r in data["repetitions"]]
    assert len(set(pids)) == 3 and os.getpid() not in pids, pids
    assert [r["rounds_seen"] for r in data["repetitions"]] == [1, 1, 1]
    assert data["x_ratio"] == 1.5 and data["x_ratio_ci_low"] == data["x_ratio_ci_high"] == 1.5
    assert _ROUNDS_SEEN_HERE == [0]


def test_a_round_that_fails_stops_the_bench_with_which_round_and_writes_nothing(
    tmp_path, monkeypatch, capfd
):
    from loraplex.benchmarks.engine import bench
    from loraplex.benchmarks.report import RoundFailed

    monkeypatch.setattr(bench, "_one_round", _engine_round)
    with pytest.raises(RoundFailed, match=r"round 1 of 3 .* exit code 1"):
        bench.run_bench(_engine_args(tmp_path, fail=True))
    assert "this round broke" in capfd.readouterr().err
    assert not (tmp_path / "engine.json").exists()


@pytest.mark.parametrize(
    ("draws", "shown", "mark"),
    [
        ([-1.16, -0.86], "-1.16 (worst of 2 draws; each -1.16, -0.86)", "**no**"),
        ([0.03, 0.08, 0.02], "0.02 (worst of 3 draws; each 0.03, 0.08, 0.02)", "yes"),
    ],
)
def test_a_target_for_every_draw_is_read_from_the_worst_draw(draws, shown, mark):
    """bench sched's engine target asks loraplex's Chameleon to lead its own FIFO on P99 in
    every arrival draw: the table shows the worst draw's reduction (met only if it leads
    there too) and every draw's beside it, not the pooled key, which one draw can carry."""
    results = {
        "engine": {"p99_ttft_reduction": 0.5, "p99_ttft_reduction_per_draw": draws},
        "quick": False,
    }
    page = render({"sched": results})
    (row,) = (line for line in page.splitlines() if "`engine.p99_ttft_reduction_per_draw`" in line)
    assert f"| {shown} | > 0 | {mark} |" in row, row
