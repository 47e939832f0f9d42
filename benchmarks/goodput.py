"""What the router benches (real Ray and the fleet simulator) derive from a sweep of offered
rates: goodput at the SLO, ratios against the best Ray router, recovery after a failure,
and the goodput figure."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.report import over_repetitions, pyplot, save_figure

RAY_ROUTERS = ("pow2", "multiplex")
SLO_FACTOR = 5.0  # the SLO is 5x the unloaded TTFT


def goodput(rates: Sequence[float], p99s: Sequence[float | None], slo: float) -> float:
    """The highest offered rate whose p99 TTFT is within `slo`: linear between the swept
    rates around the first crossing; the highest rate if it never crosses, 0 if even the
    lowest misses. A run with no completed request (None) misses.

    A miss that the next rate's run holds is a stall, not a crossing, and is left out: the
    router sustained the higher rate, so the lower one did not exceed what it sustains. A
    p99 rests on a run's 3 slowest requests, and one paused run at a low rate (a GC pause,
    the 2-core machine's other processes) otherwise set a router's goodput for the whole
    repetition: in `bench router`'s run of 13adcf4, multiplexing crossed on zipf at 28
    req/s and then held at 40 and 52; on shift it missed the lowest rate by 8 ms (748 ms
    against 740) and held the next two. A miss at the last rate run has no later run and
    stands. The rule was chosen for those two Ray runs; it applies to every router alike."""
    ys = [math.inf if p is None else p for p in p99s]
    stall = [y > slo and i + 1 < len(ys) and ys[i + 1] <= slo for i, y in enumerate(ys)]
    kept = [(float(r), y) for r, y, s in zip(rates, ys, stall, strict=True) if not s]
    if kept[0][1] > slo:
        return 0.0
    for (r0, y0), (r1, y1) in itertools.pairwise(kept):
        if y1 > slo:
            if math.isinf(y1):
                return r0
            return r0 + (slo - y0) / (y1 - y0) * (r1 - r0)
    return kept[-1][0]


def held_at(p99s: Mapping[str, float | None], slo: float) -> list[str]:
    """The routers whose p99 TTFT of a run held `slo` (a run with no completed request,
    None, did not)."""
    return [r for r, p in p99s.items() if p is not None and p <= slo]


def ratio_vs_best_ray(values: Mapping[str, float | None], higher_is_better: bool) -> float | None:
    """affinity's value over the best Ray router's (the highest, or the lowest)."""
    ours = values.get("affinity")
    theirs = [values[r] for r in RAY_ROUTERS if values.get(r) is not None]
    if ours is None or not theirs:
        return None
    best = max(theirs) if higher_is_better else min(theirs)
    if best == 0:
        return math.inf if ours > 0 else None  # 0 / 0: no router had any
    return ours / best


def comparison(
    routers: Mapping[str, Mapping[str, Any]],
    top_rate: float,
    loads: str,
    reads: str,
    distinct: int | None = None,
    reads_floor: int | None = None,
) -> dict[str, Any]:
    """The keys every router bench reports per workload, from each router's
    `goodput_at_slo_rps` and its `at_reference` figures (`load_seconds`, and device loads and
    store reads under the names `loads` and `reads`); floors over `distinct` adapters
    requested, or each run's own `distinct_adapters` when not given, and the store reads'
    over `reads_floor` where the bench knows it (the adapters new to the fleet in the run:
    router/bench.py `new_adapters`), reported beside them; affinity's store
    reads over multiplexing's (`reads_ratio_vs_multiplex`); and the routers whose p99 held
    the SLO at `top_rate`, the sweep's highest (`held_slo_at_top_rate`): their goodput is
    the grid's top, a floor of what they sustain, so a goodput ratio between two of them
    is 1 by construction and one against another is a bound, not a measurement."""
    good = {r: f["goodput_at_slo_rps"] for r, f in routers.items()}
    at = {r: f["at_reference"] for r, f in routers.items()}
    floor = {
        r: max(1, a["distinct_adapters"] if distinct is None else distinct) for r, a in at.items()
    }
    read_floor = floor if reads_floor is None else {r: max(1, reads_floor) for r in at}
    return {
        "goodput_rps": good,
        "goodput_ratio_vs_best_ray_router": ratio_vs_best_ray(good, higher_is_better=True),
        "held_slo_at_top_rate": {r: g >= top_rate for r, g in good.items()},
        "load_seconds": {r: a["load_seconds"] for r, a in at.items()},
        "load_seconds_ratio_vs_best_ray_router": ratio_vs_best_ray(
            {r: a["load_seconds"] for r, a in at.items()}, higher_is_better=False
        ),
        "loads": {r: a[loads] for r, a in at.items()},
        "reads": {r: a[reads] for r, a in at.items()},
        "reads_ratio_vs_multiplex": _ratio(at, "affinity", "multiplex", reads),
        "loads_vs_floor": {r: a[loads] / floor[r] for r, a in at.items()},
        "reads_vs_floor": {r: a[reads] / read_floor[r] for r, a in at.items()},
        **({} if reads_floor is None else {"reads_floor": reads_floor}),
    }


def held_at_top_note(workload: Mapping[str, Any]) -> str:
    """What the goodput ratio's line adds where routers held the SLO at the sweep's top rate
    (`held_slo_at_top_rate`, per router a bool, or each repetition's where they differ)."""
    held = []
    for router, h in workload.get("held_slo_at_top_rate", {}).items():
        reps = h if isinstance(h, list) else [h]
        if any(reps):
            held.append(router if all(reps) else f"{router} in {sum(reps)} of {len(reps)}")
    if not held:
        return ""
    return f" (held the SLO at the top rate: {', '.join(held)}; a bound from the grid)"


def ratio_at_ceiling(workload: Mapping[str, Any]) -> bool:
    """Whether the workload's goodput ratio against the best Ray router is 1 by the sweep's
    ceiling: in every repetition affinity and a Ray router both held the SLO at the top
    rate (`held_slo_at_top_rate`), so both goodputs are that rate and the sweep never
    found where they part."""
    reps = workload.get("repetitions") or []
    return bool(reps) and all(
        (held := r.get("held_slo_at_top_rate") or {}).get("affinity", False)
        and any(held.get(ray, False) for ray in RAY_ROUTERS)
        for r in reps
    )


def fewest_replicas(holds: Callable[[int], bool], start: int, most: int) -> int | None:
    """The fewest replicas n in [1, most] for which `holds(n)` (the SLO held with n), found
    by doubling from `start` until it holds, then bisecting; None if `most` does not hold.
    Holding is taken to be monotone in n (more replicas never hurt)."""
    assert 1 <= start <= most
    lo, hi, n = 0, None, start  # lo: known not to hold (0: none), hi: known to hold
    while hi is None:
        if holds(n):
            hi = n
        elif n == most:
            return None
        else:
            lo, n = n, min(2 * n, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _ratio(at: Mapping[str, Mapping[str, Any]], ours: str, theirs: str, key: str) -> float | None:
    """`ours`'s figure over `theirs`'s; None where either router did not run or both are 0."""
    if ours not in at or theirs not in at:
        return None
    a, b = at[ours][key], at[theirs][key]
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


def repeated(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One workload's figures over the bench's repetitions (`report.over_repetitions`:
    medians, and each ratio's 90% bootstrap interval beside it), and under `repetitions`
    each repetition's own, less its per-router detail."""
    merged = over_repetitions([{k: v for k, v in r.items() if k != "router_order"} for r in reps])
    merged["repetitions"] = [{k: v for k, v in r.items() if k != "routers"} for r in reps]
    return merged


def recovery_s(
    arrival: np.ndarray, ttft: np.ndarray, kill_at: float, slo: float, window_s: float
) -> float | None:
    """Seconds from the kill until the p99 TTFT of every later window of `window_s` (by
    arrival) is within the SLO; None if the last window still misses."""
    end = float(arrival.max())
    starts = np.arange(kill_at, end, window_s)
    misses = []
    for start in starts:
        inside = ttft[(arrival >= start) & (arrival < start + window_s)]
        misses.append(len(inside) > 0 and float(np.percentile(inside, 99)) > slo)
    if not misses or not any(misses):
        return 0.0
    last = max(i for i, miss in enumerate(misses) if miss)
    if last == len(misses) - 1:
        return None
    return float(starts[last] + window_s - kill_at)


def within_slo_rps(ttft: np.ndarray, requests: int, rate: float, slo: float) -> float:
    """Of `rate` requests per second offered, how many got their first token within the
    SLO: `ttft` holds the first-token times of the `requests` that got one."""
    return rate * float((ttft <= slo).sum()) / requests if requests else 0.0


def plot_goodput(sweeps: Mapping[str, Mapping], path: Path, title: str) -> Path:
    """One panel per workload: goodput (requests/s whose TTFT met the SLO) against the
    offered rate, per router; the dotted diagonal is every request meeting it, and each
    router's goodput at the SLO (its p99 within it) is marked on the x axis. `sweeps[w]`
    has `rates_rps` and `routers[r]` with `within_slo_rps` (one per rate) and
    `goodput_at_slo_rps`."""
    plt = pyplot()
    names = list(sweeps)
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.4), squeeze=False)
    colors = {"affinity": "tab:blue", "pow2": "tab:orange", "multiplex": "tab:green"}
    for ax, name in zip(axes[0], names, strict=True):
        sweep = sweeps[name]
        rates = sweep["rates_rps"]
        ax.plot(rates, rates, ":", color="grey", linewidth=1)
        for router, figures in sweep["routers"].items():
            color = colors.get(router)
            ax.plot(rates, figures["within_slo_rps"], "o-", color=color, label=router, ms=4)
            at = figures["goodput_at_slo_rps"]
            if at > 0:
                ax.plot([at], [0], marker="^", color=color, ms=9, clip_on=False)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("requests/s within the TTFT SLO")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=110)
