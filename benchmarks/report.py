"""What every `loraplex bench` suite does with its figures: progress on stderr, JSON on request."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import multiprocessing
import os
import pickle
import platform
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# when the bench began (this module is imported as it starts): the run's metadata
_STARTED = (datetime.datetime.now(datetime.UTC), os.getloadavg())


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's cpuset, taskset),
    which can be fewer than the machine's `os.cpu_count()`."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# the packages whose speed a figure rests on: ours, and the baselines we run (transformers
# + peft in `bench engine`, Ray Serve's routers in `bench router`)
VERSIONED = ("torch", "transformers", "peft", "ray")


def package_versions() -> dict[str, str | None]:
    """Python's and each VERSIONED package's installed version (None: not installed). A
    fresh set-up resolves the baselines anew: on 2026-12-06 a new machine's transformers +
    peft served `bench engine`'s real-model workload in 4.3 s where the published run's took
    5.6, and no run had said which versions either ran."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_metadata() -> dict[str, Any]:
    """How the run went: its date, command, the CPUs it could use and the machine's, the
    1-minute load average when it began and now (a ratio from a loaded machine is read with
    that in mind), and the versions it ran (`package_versions`)."""
    started, before = _STARTED
    return {
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["loraplex", *sys.argv[1:]]),
        "cpus": usable_cpus(),
        "cpus_on_machine": os.cpu_count(),
        "load_average": {"before": round(before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "versions": package_versions(),
    }


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class RoundFailed(RuntimeError):
    """A round run in a process of its own ended without its figures."""


def rounds_apart(round_fn: Callable[[Any], Any], arg: Any, rounds: int) -> list[Any]:
    """`round_fn(arg)`'s result from each of `rounds` processes, one after another, each
    started fresh (spawned: nothing inherited from this process but `arg`), as pyperf runs
    each of its runs in a worker of its own. A round in the same process as the one before
    it inherits what that one left (threads, allocator state, caches), and `bench engine`
    measured it: the real model's base step 8-12 ms slower in a second round in the same
    process than in a first or in a fresh process. `round_fn` must be importable by name;
    its result must pickle. A round that fails raises RoundFailed, after what it printed."""
    spawn = multiprocessing.get_context("spawn")
    out = []
    with tempfile.TemporaryDirectory(prefix="loraplex-round-") as tmp:
        for i in range(rounds):
            log(f"round {i + 1} of {rounds}, in a fresh process")
            path = Path(tmp) / f"round-{i}.pickle"
            child = spawn.Process(target=_round_to_file, args=(round_fn, arg, path))
            child.start()
            child.join()
            if child.exitcode != 0 or not path.exists():
                raise RoundFailed(
                    f"round {i + 1} of {rounds} (pid {child.pid}) ended with exit code "
                    f"{child.exitcode} and no figures; its error is above"
                )
            out.append(pickle.loads(path.read_bytes()))
    return out


def _round_to_file(round_fn: Callable[[Any], Any], arg: Any, path: Path) -> None:
    result = round_fn(arg)
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(result))
    partial.replace(path)


def finite_json(results: Any) -> tuple[Any, dict[str, str]]:
    """`results` with each infinite or NaN float as null (JSON has neither), and why, by
    the key's path: an infinite figure is a ratio whose denominator was 0."""
    why: dict[str, str] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            why[path] = "not a number" if math.isnan(x) else f"{x}: a ratio over 0"
            return None
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
        return x

    return walk(results, ""), why


def write_json(path: Path | None, results: dict) -> None:
    if path is None:
        return
    out, why = finite_json(results)
    if why:
        out["non_finite"] = why
    out["run"] = run_metadata()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, allow_nan=False) + "\n")
    log(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot on the file-only backend (the `bench` extra; no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: float | None = None) -> Path:
    """`fig` laid out and written to `path` (its folder made), then closed."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def median_interval(
    values: list[float], level: float = 0.9, resamples: int = 10_000
) -> tuple[float, float, float]:
    """The median of `values` (one per repetition) and its `level` bootstrap interval: the
    medians of `resamples` draws of as many values with replacement, their (1 - level) / 2
    and (1 + level) / 2 quantiles taken at an order statistic (no interpolation, so an
    infinite ratio stays infinite). Seeded: the same values give the same interval. With 2
    or 3 repetitions the interval is their range (a draw of all the smallest is not rare)."""
    x = np.asarray(values, dtype=float)
    assert x.ndim == 1 and len(x) > 0 and not np.isnan(x).any(), values
    draws = np.median(x[np.random.default_rng(0).integers(0, len(x), (resamples, len(x)))], axis=1)
    tail = (1.0 - level) / 2
    return (
        float(np.median(x)),
        float(np.quantile(draws, tail, method="lower")),
        float(np.quantile(draws, 1.0 - tail, method="higher")),
    )


def over_repetitions(reps: list[Any]) -> Any:
    """Figures of the same shape from each repetition, as one: a number is the median over
    the repetitions that have one (None where none has); beside every ratio (a key with
    "ratio" in its name) its 90% bootstrap interval as `<key>_ci_low` and `<key>_ci_high`;
    dicts by key and lists of one length by position; anything else the repetitions'
    common value, or the list of each repetition's where they differ."""
    first = reps[0]
    if all(isinstance(r, dict) for r in reps):
        out: dict[str, Any] = {}
        for k in dict.fromkeys(k for r in reps for k in r):
            have = [r[k] for r in reps if k in r]
            out[k] = over_repetitions(have)
            if "ratio" in k and _numbers(have):
                values = [v for v in have if v is not None]
                out[k], out[f"{k}_ci_low"], out[f"{k}_ci_high"] = median_interval(values)
            elif "ratio" in k and all(v is None for v in have):
                # undefined in every repetition (0 / 0): the interval is too, and says so
                out[f"{k}_ci_low"] = out[f"{k}_ci_high"] = None
        return out
    if all(isinstance(r, list) for r in reps) and len({len(r) for r in reps}) == 1:
        return [over_repetitions(list(column)) for column in zip(*reps, strict=True)]
    if _numbers(reps):
        values = [v for v in reps if v is not None]
        if not values:
            return None
        median = float(np.median(values))
        whole = all(isinstance(v, int) for v in values) and median.is_integer()
        return int(median) if whole else median
    return first if all(r == first for r in reps) else list(reps)


def _numbers(values: list[Any]) -> bool:
    """Numbers or None, not all None, no bools."""
    return any(v is not None for v in values) and all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values
    )
