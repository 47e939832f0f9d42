"""`loraplex bench fleet --section autoscale`: Ray Serve's autoscaler over a simulated day,
with Ray's default policy, loraplex's `lora` policy and a static fleet sized for the peak
(benchmarks/sim/scaling.py runs the policies as Serve does; the affinity router routes).

The day (stated values, FULL / QUICK):
    fleet        benchmarks/fleet/bench.py's (H100 SXM5 + Llama-2-7B, its engine, host tier,
                 store and router settings); replicas start in `model_load_s` (21.7 s)
    arrivals     the Azure conversation trace's arrival process (its own gaps, then gaps drawn
                 from them as the day needs), time-warped onto a diurnal rate: trough at the
                 start and end, peak at the middle, PEAK_TO_TROUGH = 5 x; the peak is
                 peak_replicas (12 / 4) x the fleet bench's reference load (0.65 of a
                 replica's capacity). Without the trace, Poisson arrivals (the trace
                 reader's stated stand-in) warped the same way
    day          day_s of simulated time: 4 h / 1 h (a day compressed: Serve's delays are
                 not, so the compressed day is the harder case for every policy)
    adapters     10,000 / 2,000, ranks 8-128, Zipf(1) popularity; at the middle of the
                 requests (the peak) the ranking rotates by half the catalog (the fleet
                 bench's `shift` workload)
    lengths      the trace's, output capped at 1,024
    Serve        for both autoscaled policies Serve's defaults (look_back_period_s 30,
                 upscale_delay_s 30), min_replicas 1, max_replicas 2 x peak_replicas,
                 initial_replicas 1; downscale_delay_s as each policy is run
    ray_default  Ray's `replica_queue_length_autoscaling_policy`, run as-is, at each
                 `target_ongoing_requests` of `targets` x Serve's `downscale_delay_s` of
                 DOWNSCALE_DELAYS (Serve's default 600 s, and the lora config's 30 s);
                 its best: the fewest replica-hours among the settings with SLO attainment
                 >= 0.99 (else the highest attainment)
    lora         `LoraAutoscalingPolicy` with its default settings, in the recommended
                 config (docs/cluster.md): Serve's downscale_delay_s
                 LORA_DOWNSCALE_DELAY_S, the policy having its own delay and cool-down.
                 The defaults of its square-root headroom (β 0.5, the band's 0.7) were
                 chosen on the quick day among four pairs (0.35-0.75; 2026-12-05), so the
                 full day and the steady load are their held-out checks
    lora_proportional  the same with the headroom the policy had before (`headroom:
                 proportional`, target_utilisation 0.7, scale_down_utilisation 0.63): what
                 the square-root headroom changes
    static       peak_replicas all day (Serve's min = max)
    steady       the same fleet at a steady load, for "no flapping": the day's mean rate all
                 through (the trace's arrival process at that constant rate), Zipf(1)
                 without the shift, ray_default at its best setting and lora; their scale
                 events are counted after STEADY_WARMUP_S (10 min: the first replicas are
                 asked for and up). The day itself cannot show flapping apart from
                 following its ramp: every change of the count there has a cause in the
                 rate

SLO: the fleet bench's, 5 x the mean unloaded TTFT of the day's requests. Keys:
    autoscale.replica_hours_ratio_vs_ray_default   lora's replica-hours / ray_default's best
    autoscale.replica_hours_ratio_vs_static        lora's / the static fleet's
    autoscale.replica_hours_ratio_vs_ray_default_proportional  lora_proportional's / ray_default's
    autoscale.replica_hours_clairvoyant_vs_static  a fleet that knows the rate, of whole
                                                   replicas each at most at the static
                                                   fleet's peak load, up and down at once
                                                   (`clairvoyant_replica_hours`) / the
                                                   static fleet's: where lora's ratio
                                                   could go at best
    autoscale.slo_attainment.<policy>              share of requests with TTFT within the SLO
    autoscale.slo_attainment_vs_ray_default        lora's attainment - ray_default's
    autoscale.requests_lost                        requests that never finished (0: asserted)
    autoscale.scale_events_per_hour.<policy>       changes of Serve's target count per hour
    autoscale.steady.scale_events_per_hour.<policy>  the same at the steady load, after the
                                                   warm-up
Replica-hours count a replica from the moment Serve asks for it until it has stopped.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.benchmarks.engine.bench import DEFAULT_TRACE
from loraplex.benchmarks.fleet import bench as fb
from loraplex.benchmarks.fleet import workloads as fw
from loraplex.benchmarks.goodput import SLO_FACTOR
from loraplex.benchmarks.report import log, pyplot, save_figure, write_json
from loraplex.benchmarks.sim.scaling import Scaling, ScalingRecord, model_load_s, simulate_scaling
from loraplex.benchmarks.sim.workload import SimRequest, Trace, read_trace
from loraplex.router.autoscaling import Homes, serve_autoscaling_config

PEAK_TO_TROUGH = 5.0
REFERENCE_LOAD = 0.65  # of a replica's capacity: the fleet bench's reference rate
WINDOW_S = 300.0  # the figure's P99 TTFT windows
SERVE_DOWNSCALE_DELAY_S = 600.0  # Serve's default
LORA_DOWNSCALE_DELAY_S = 30.0  # the recommended lora config's: one look-back window
# lora's utilisation settings before its square-root headroom (2026-12-05)
PROPORTIONAL_UTILISATION = {"target_utilisation": 0.7, "scale_down_utilisation": 0.63}
DOWNSCALE_DELAYS = (SERVE_DOWNSCALE_DELAY_S, LORA_DOWNSCALE_DELAY_S)  # Ray default's sweep
STEADY_WARMUP_S = 600.0  # the steady run's events are counted after this


@dataclass(frozen=True, slots=True)
class DayShape:
    day_s: float
    adapters: int
    peak_replicas: int
    targets: tuple[float, ...]  # Ray's target_ongoing_requests swept


FULL = DayShape(day_s=4 * 3600.0, adapters=10_000, peak_replicas=12, targets=(16, 24, 32, 48, 64))
QUICK = DayShape(day_s=3600.0, adapters=2_000, peak_replicas=4, targets=(16, 24, 32, 48))


def diurnal_arrivals(trace: Trace, day_s: float, peak_rps: float, seed: int) -> np.ndarray:
    """The trace's arrival process warped onto `diurnal_rate`: unit-rate trace times s (the
    trace repeated as needed) are mapped to t with Lambda(t) = s, Lambda the rate's
    integral."""
    grid = np.linspace(0.0, day_s, 100_001)
    rate = diurnal_rate(grid, day_s, peak_rps)
    cumulative = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))])
    return np.interp(_unit_times(trace, cumulative[-1], seed), cumulative, grid)


def diurnal_rate(t: np.ndarray, day_s: float, peak: float) -> np.ndarray:
    """The day's rate at times `t`: trough + (peak - trough) x (1 - cos 2 pi t / day) / 2,
    the trough peak / PEAK_TO_TROUGH."""
    trough = peak / PEAK_TO_TROUGH
    return trough + (peak - trough) * (1 - np.cos(2 * np.pi * t / day_s)) / 2


def steady_arrivals(trace: Trace, duration_s: float, rate_rps: float, seed: int) -> np.ndarray:
    """The trace's arrival process at a constant `rate_rps` for `duration_s`."""
    return _unit_times(trace, rate_rps * duration_s, seed) / rate_rps


def _unit_times(trace: Trace, end: float, seed: int) -> np.ndarray:
    """The trace's arrival times at unit rate up to `end`: its own gaps, then gaps drawn
    from them as needed."""
    gaps = np.diff(trace.timestamps)
    gaps = gaps / gaps.mean()  # unit rate
    need = int(end * 1.2) + 10
    draws = np.random.default_rng(seed).integers(0, len(gaps), max(0, need - len(gaps)))
    unit = np.cumsum(np.concatenate([gaps, gaps[draws]])[:need])
    return unit[unit < end]


def clairvoyant_replica_hours(peak_replicas: int, day_s: float) -> float:
    """The replica-hours of a fleet that knows the day's rate: at each moment the fewest
    whole replicas that keep every replica at or below the static fleet's load at the peak
    (REFERENCE_LOAD of its capacity), each up the moment it is wanted and gone the moment
    it is not. The rate is `diurnal_rate`, so in replicas it runs from
    peak_replicas / PEAK_TO_TROUGH to peak_replicas. Fractional replicas would need the
    day's mean over its peak, (1 + 1 / PEAK_TO_TROUGH) / 2 = 0.6 of the static fleet's
    hours; whole ones need more, the most where the peak is a few replicas (4: 0.70)."""
    in_replicas = diurnal_rate(np.linspace(0.0, day_s, 1_000_001), day_s, peak_replicas)
    wanted = np.ceil(in_replicas - 1e-9)  # whole replicas; exact multiples not rounded up
    return float(wanted.mean()) * day_s / 3600


def day_requests(
    fleet: fb.Fleet, shape: DayShape, names: list[str], seed: int
) -> tuple[list[SimRequest], float]:
    peak = shape.peak_replicas * REFERENCE_LOAD * fleet.capacity_per_replica
    at = diurnal_arrivals(fleet.trace, shape.day_s, peak, seed)
    lengths = fw.Lengths(trace=fleet.trace, max_tokens=fb.MAX_TOKENS)
    reqs = fw.requests("shift", names, len(at), float(len(at)) / shape.day_s, lengths, seed)
    return [dataclasses.replace(r, arrival=float(t)) for r, t in zip(reqs, at, strict=True)], peak


def steady_requests(
    fleet: fb.Fleet, shape: DayShape, names: list[str], rate_rps: float, seed: int
) -> list[SimRequest]:
    at = steady_arrivals(fleet.trace, shape.day_s, rate_rps, seed)
    lengths = fw.Lengths(trace=fleet.trace, max_tokens=fb.MAX_TOKENS)
    reqs = fw.requests("zipf", names, len(at), rate_rps, lengths, seed)
    return [dataclasses.replace(r, arrival=float(t)) for r, t in zip(reqs, at, strict=True)]


def measure(quick: bool, trace_path: Path | None = None) -> dict[str, Any]:
    shape = QUICK if quick else FULL
    fleet = fb.calibrate(fb.QUICK if quick else fb.FULL, read_trace(trace_path or DEFAULT_TRACE))
    adapters = fw.catalog(shape.adapters, fleet.profile.adapter_bytes)
    catalog = {a.name: a for a in adapters}
    reqs, peak = day_requests(fleet, shape, [a.name for a in adapters], seed=26)
    sample = reqs[:: max(1, len(reqs) // 5000)]
    slo = SLO_FACTOR * fb.unloaded_ttft_s(fleet.profile, sample, catalog)
    startup = model_load_s(fleet.profile)
    log(
        f"autoscale: {len(reqs)} requests over {shape.day_s / 3600:.1f} h, peak {peak:.1f} req/s, "
        f"{shape.adapters} adapters, SLO {slo:.3f} s, replica start-up {startup:.1f} s; "
        f"trace {fleet.trace.source}"
    )
    setup = fleet.setup(
        2 * shape.peak_replicas, adapters
    )  # max_homes_per_adapter: the most replicas
    serve = {"min_replicas": 1, "max_replicas": 2 * shape.peak_replicas, "initial_replicas": 1}

    def day(
        name: str,
        autoscaling: dict[str, Any],
        replicas: int = 1,
        requests: list[SimRequest] = reqs,
        warmup_s: float = 0.0,
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        homes = Homes(setup.affinity.home_utilisation, setup.affinity.max_homes_per_adapter)
        scaling = Scaling(serve_autoscaling_config(autoscaling, homes), startup)
        run, record = simulate_scaling(
            "affinity",
            requests,
            catalog,
            dataclasses.replace(setup, num_replicas=replicas),
            scaling,
        )
        out = summarize(run, record, slo, shape.day_s, warmup_s)
        log(
            f"autoscale {name:22}: {out['replica_hours']:.2f} replica-h, SLO attainment "
            f"{out['slo_attainment']:.4f}, p99 {out['p99_ttft_s']:.3f} s, "
            f"{out['scale_events_per_hour']:.1f} events/h ({time.perf_counter() - t0:.0f} s, "
            f"load avg {os.getloadavg()[0]:.1f})"
        )
        return out

    settings = {
        f"{target:g}@{delay:g}s": (target, delay)
        for target in shape.targets
        for delay in DOWNSCALE_DELAYS
    }
    sweep = {
        key: day(
            f"ray_default target {target:g}, downscale {delay:g} s",
            {
                **serve,
                "policy": "requests",
                "target_ongoing_requests": target,
                "downscale_delay_s": delay,
            },
        )
        for key, (target, delay) in settings.items()
    }
    best = best_setting(sweep)
    lora = {**serve, "policy": "lora", "downscale_delay_s": LORA_DOWNSCALE_DELAY_S}
    proportional = {"headroom": "proportional", **PROPORTIONAL_UTILISATION}
    policies = {
        "ray_default": sweep[best],
        "lora": day("lora", lora),
        "lora_proportional": day("lora proportional", {**lora, "lora": proportional}),
        "static": day(
            "static",
            {"min_replicas": shape.peak_replicas, "max_replicas": shape.peak_replicas},
            shape.peak_replicas,
        ),
    }
    # the same fleet at a steady load: the day's mean rate all through, Zipf(1) without the
    # shift; its scale events are counted once the first replicas have come up
    mean_rps = len(reqs) / shape.day_s
    steady_reqs = steady_requests(fleet, shape, [a.name for a in adapters], mean_rps, seed=26)
    steady = {
        "ray_default": day(
            f"steady ray_default {best}",
            {
                **serve,
                "policy": "requests",
                "target_ongoing_requests": settings[best][0],
                "downscale_delay_s": settings[best][1],
            },
            requests=steady_reqs,
            warmup_s=STEADY_WARMUP_S,
        ),
        "lora": day("steady lora", lora, requests=steady_reqs, warmup_s=STEADY_WARMUP_S),
    }
    hours = {p: r["replica_hours"] for p, r in policies.items()}
    return {
        "profile": fleet.profile.name,
        "trace": fleet.trace.source,
        "day_s": shape.day_s,
        "adapters": shape.adapters,
        "requests": len(reqs),
        "peak_rps": peak,
        "peak_to_trough": PEAK_TO_TROUGH,
        "slo_s": slo,
        "replica_startup_s": startup,
        "static_replicas": shape.peak_replicas,
        "ray_default_target_ongoing_requests": float(settings[best][0]),
        "ray_default_downscale_delay_s": settings[best][1],
        "lora_downscale_delay_s": LORA_DOWNSCALE_DELAY_S,
        "ray_default_sweep": {t: _brief(r) for t, r in sweep.items()},
        "replica_hours_ratio_vs_ray_default": hours["lora"] / hours["ray_default"],
        "replica_hours_ratio_vs_static": hours["lora"] / hours["static"],
        "replica_hours_ratio_vs_ray_default_proportional": (
            hours["lora_proportional"] / hours["ray_default"]
        ),
        # what no policy of whole replicas at the static fleet's peak load can go below
        "replica_hours_clairvoyant_vs_static": (
            clairvoyant_replica_hours(shape.peak_replicas, shape.day_s) / hours["static"]
        ),
        "slo_attainment": {p: r["slo_attainment"] for p, r in policies.items()},
        "slo_attainment_vs_ray_default": (
            policies["lora"]["slo_attainment"] - policies["ray_default"]["slo_attainment"]
        ),
        "requests_lost": sum(
            r["requests_lost"] for r in [*policies.values(), *sweep.values(), *steady.values()]
        ),
        "scale_events_per_hour": {p: r["scale_events_per_hour"] for p, r in policies.items()},
        "policies": policies,
        "steady": {
            "rate_rps": mean_rps,
            "requests": len(steady_reqs),
            "warmup_s": STEADY_WARMUP_S,
            "scale_events_per_hour": {
                p: r["scale_events_per_hour_after_warmup"] for p, r in steady.items()
            },
            "policies": {p: _brief_steady(r) for p, r in steady.items()},
        },
    }


def best_setting(sweep: dict[str, dict[str, Any]]) -> str:
    meeting = [t for t, r in sweep.items() if r["slo_attainment"] >= 0.99]
    if meeting:
        return min(meeting, key=lambda t: sweep[t]["replica_hours"])
    return max(sweep, key=lambda t: sweep[t]["slo_attainment"])


def summarize(
    run, record: ScalingRecord, slo: float, day_s: float, warmup_s: float = 0.0
) -> dict[str, Any]:
    ttft = run.ttft
    windows = []
    for start in np.arange(0.0, day_s, WINDOW_S):
        inside = (run.arrival >= start) & (run.arrival < start + WINDOW_S)
        p99 = float(np.percentile(ttft[inside], 99)) if inside.any() else None
        windows.append({"t_s": float(start), "p99_ttft_s": p99})
    return {
        "replica_hours": record.replica_seconds / 3600,
        "slo_attainment": float(np.mean(ttft <= slo)),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "requests": run.requests,
        "requests_lost": run.requests - len(ttft),
        "streams_resumed": run.streams_resumed,
        "stopped_with_requests": record.stopped_with_requests,
        "store_reads": run.counters.get("store_reads", 0),
        "scale_events": record.scale_events,
        "scale_events_per_hour": record.scale_events / (day_s / 3600),
        "scale_events_per_hour_after_warmup": sum(t >= warmup_s for t in record.event_times)
        / ((day_s - warmup_s) / 3600),
        "max_replicas": max(n for _, n in record.timeline),
        "replicas_timeline": [[round(t, 1), n] for t, n in record.timeline],
        "p99_ttft_windows": windows,
    }


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("replica_hours", "slo_attainment", "p99_ttft_s", "scale_events_per_hour")
    return {k: r[k] for k in keys}


def _brief_steady(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("scale_events", "scale_events_per_hour_after_warmup", "max_replicas")
    return {**_brief(r), **{k: r[k] for k in keys}, "replicas_timeline": r["replicas_timeline"]}


def timeline_table(results: dict[str, Any], rows: int = 12) -> str:
    """The most replicas held and the worst window's P99 TTFT, per policy, in each of `rows`
    slices of the day, as a markdown table."""
    policies = results["policies"]
    every = results["day_s"] / rows
    header = " | ".join(f"{p} replicas | {p} P99 TTFT (s)" for p in policies)
    lines = [f"| t (min) | {header} |", "|" + "---|" * (1 + 2 * len(policies))]
    for t in np.arange(0.0, results["day_s"], every):
        cells = [f"{t / 60:.0f}"]
        for r in policies.values():
            timeline = r["replicas_timeline"]
            before = [n for at, n in timeline if at <= t][-1:]
            held = before + [n for at, n in timeline if t < at < t + every]
            p99 = [
                w["p99_ttft_s"]
                for w in r["p99_ttft_windows"]
                if t <= w["t_s"] < t + every and w["p99_ttft_s"] is not None
            ]
            cells.append(str(max(held)) if held else "-")
            cells.append(f"{max(p99):.2f}" if p99 else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_day(results: dict[str, Any], path: Path) -> Path:
    """The day as a figure: replicas held (above) and each 5-minute window's P99 TTFT
    against the SLO (below), per policy, over the day's minutes."""
    plt = pyplot()
    colors = {
        "ray_default": "tab:orange",
        "lora": "tab:blue",
        "lora_proportional": "tab:cyan",
        "static": "tab:grey",
    }
    fig, (held, tail) = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True)
    end = results["day_s"] / 60
    for policy, r in results["policies"].items():
        color = colors.get(policy)
        label = (
            f"{policy}: {r['replica_hours']:.2f} replica-h, "
            f"SLO attainment {r['slo_attainment']:.4f}"
        )
        times = [t / 60 for t, _ in r["replicas_timeline"]] + [end]
        counts = [n for _, n in r["replicas_timeline"]]
        held.stairs(counts, times, color=color, label=label, linewidth=1.6, baseline=None)
        windows = [w for w in r["p99_ttft_windows"] if w["p99_ttft_s"] is not None]
        tail.plot(
            [(w["t_s"] + WINDOW_S / 2) / 60 for w in windows],
            [w["p99_ttft_s"] for w in windows],
            "o-",
            color=color,
            ms=3,
        )
    tail.axhline(results["slo_s"], color="tab:red", linestyle=":", label="SLO")
    held.set_ylabel("replicas held")
    held.set_ylim(bottom=0)
    held.legend(fontsize=7, loc="upper left")
    tail.set_ylabel(f"P99 TTFT, {WINDOW_S / 60:.0f}-min windows (s)")
    tail.set_ylim(bottom=0)
    tail.set_xlabel("minute of the day")
    tail.legend(fontsize=7)
    for ax in (held, tail):
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{results['requests']} requests, peak {results['peak_rps']:.1f} req/s, "
        f"{results['adapters']} adapters ({results['profile']}); Ray's default at "
        f"target_ongoing_requests {results['ray_default_target_ongoing_requests']:g}, "
        f"downscale {results['ray_default_downscale_delay_s']:g} s",
        fontsize=8,
    )
    return save_figure(fig, path, dpi=110)


def run_section(args) -> int:
    started = time.perf_counter()
    results = measure(bool(args.quick), args.trace)
    out = {"quick": bool(args.quick), "autoscale": results}
    out["seconds"] = time.perf_counter() - started
    if getattr(args, "plot", None):
        log(f"figure: {plot_day(results, Path(args.plot) / 'autoscale_day.png')}")
    print(timeline_table(results))
    for key in (
        "replica_hours_ratio_vs_ray_default",
        "replica_hours_ratio_vs_static",
        "replica_hours_clairvoyant_vs_static",
    ):
        print(f"autoscale.{key}: {results[key]:.3f}")
    for key in ("slo_attainment", "scale_events_per_hour"):
        for policy, value in results[key].items():
            print(f"autoscale.{key}.{policy}: {value:.4g}")
    for policy, value in results["steady"]["scale_events_per_hour"].items():
        print(f"autoscale.steady.scale_events_per_hour.{policy}: {value:.4g}")
    print(f"autoscale.requests_lost: {results['requests_lost']}")
    write_json(args.json, out)
    return 0
