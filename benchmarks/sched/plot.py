"""The plot `loraplex bench sched --plot DIR` writes: P99 TTFT against load per system
(seed 004 Fig. 11's axes), the mean over arrival seeds with their range shaded, the SLO as
a dashed line. Needs matplotlib (the `bench` extra, which scripts/setup.sh installs)."""

from __future__ import annotations

from pathlib import Path

from loraplex.benchmarks.report import pyplot, save_figure

STYLE = {
    "slora": ("#d62728", "o"),
    "fifo_nocache": ("#7f7f7f", "s"),
    "fifo_cache": ("#bcbd22", "s"),
    "sjf": ("#9467bd", "v"),
    "chameleon_nocache": ("#17becf", "^"),
    "chameleon": ("#1f77b4", "^"),
    "loraplex": ("#2ca02c", "D"),
}


def plot_p99_ttft(sim: dict, out_dir: Path) -> Path:
    fig, ax = pyplot().subplots(figsize=(7.5, 4.5), dpi=120)
    for name, rows in sim["systems"].items():
        color, marker = STYLE.get(name, ("black", "."))
        keys = sorted(rows, key=float)  # the grid and the system's own points past it
        loads = [float(k) for k in keys]
        p99 = [rows[k]["p99_ttft_s"] for k in keys]
        ax.plot(loads, p99, marker=marker, color=color, label=name, linewidth=1.4, markersize=4)
        lo = [rows[k]["p99_ttft_s_min"] for k in keys]
        hi = [rows[k]["p99_ttft_s_max"] for k in keys]
        ax.fill_between(loads, lo, hi, color=color, alpha=0.12, linewidth=0)
    ax.axhline(sim["slo_s"], color="red", linestyle="--", linewidth=1, label="SLO")
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xlabel(
        "load (requests / s, Poisson)" if sim["scenario"] != "bursty" else "load (requests / s)"
    )
    ax.set_ylabel("P99 TTFT (s)")
    ax.set_title(
        f"{sim['profile']}, {sim['adapters']} adapters, scenario {sim['scenario']}: "
        f"mean of {sim['seeds']} arrival seeds (range shaded)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return save_figure(fig, out_dir / f"sched_p99_ttft_{sim['scenario']}.png")
