"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loraplex.cluster import adapters_cli, generate, local_cluster, registry_server
from loraplex.cluster.errors import CLIError

# `bench --section`: each section alone, by the bench it belongs to
SECTIONS = {"autoscale": "fleet", "engine": "sched"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo-assets",
        help="place the demo model (SmolLM2-135M-Instruct, GGUF) and its adapters in DIR",
    )
    demo.add_argument("dir", type=Path)
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="write the small random Llama checkpoint, tokenizer and adapters instead (tests)",
    )

    generate.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench.add_argument(
        "suite",
        choices=["engine", "fleet", "registry", "router", "sched", "report"],
        help="a bench, or `report`: docs/performance.md from the benches' committed JSON",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="smaller model and workload: every key, in a fraction of the full run (on two "
        "quiet cores: engine ~2 min, fleet 10-20 min, router ~19 min)",
    )
    bench.add_argument("--json", type=Path, help="write the figures here")
    bench.add_argument("--trace", type=Path, help="engine, sched: Azure LLM inference trace CSV")
    bench.add_argument(
        "--sim-only",
        action="store_true",
        help="sched, fleet: the simulator sections only (fleet: no validation run)",
    )
    bench.add_argument(
        "--section",
        choices=[*SECTIONS],
        help="a section alone, written to its own JSON: fleet autoscale (a simulated day "
        "under Ray Serve's autoscaler); sched engine (the real engine's section, in engine "
        "time: ~5 min of the full run's ~20)",
    )
    bench.add_argument(
        "--validation-only",
        action="store_true",
        help="fleet: only the simulator's validation against a real run",
    )
    bench.add_argument(
        "--save-run",
        type=Path,
        help="fleet --validation-only: also write the real run's measurements here (requests, "
        "step timings, calibration; a few MB), for --from-run",
    )
    bench.add_argument(
        "--from-run",
        type=Path,
        help="fleet --validation-only: validate the simulator against a real run that "
        "--save-run wrote, without running it (no Ray; seconds instead of ~8 min)",
    )
    bench.add_argument(
        "--scenario",
        choices=["paper", "long-prompt", "bursty"],
        default="paper",
        help="sched: the main workload (paper: seed 004 §5.1); the others run as trace shapes",
    )
    bench.add_argument(
        "--plot",
        type=Path,
        help="sched: the P99 TTFT vs load plot; router, fleet: the goodput figure; fleet "
        "--section autoscale: replicas and P99 TTFT over the day (PNG); written into this folder",
    )
    bench.add_argument(
        "--jobs", type=int, default=1, help="sched: processes running the simulations (1)"
    )
    bench.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="engine: rounds of the whole bench, each in a fresh process when more than one; "
        "the figures are their medians with 90%% bootstrap intervals and every round's are "
        "kept",
    )
    bench.add_argument(
        "--seeds",
        type=int,
        help="sched: arrival draws of the simulator's main scenario (default: 5, --quick 2; "
        "the trace shapes run at most this many)",
    )
    bench.add_argument(
        "--json-dir",
        type=Path,
        default=Path("docs/bench"),
        help="report: the benches' JSON, one SUITE.json each (docs/bench)",
    )
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("docs/performance.md"),
        help="report: the page to write (docs/performance.md)",
    )

    registry_server.add_parser(sub)
    local_cluster.add_parsers(sub)
    adapters_cli.add_parsers(sub)

    args = parser.parse_args(argv)
    try:
        if args.command == "demo-assets":
            return _demo_assets(args)
        if args.command in ("up", "down", "status"):
            return local_cluster.run(args)
        if args.command == "adapters":
            return adapters_cli.run(args)
        if args.command == "registry":
            return registry_server.run(args)
        if args.command == "generate":
            return generate.run_generate(args)
        if args.repeat < 1 or (args.repeat > 1 and args.suite != "engine"):
            raise CLIError(f"--repeat {args.repeat}: engine only, at least 1")
        if args.section is not None and SECTIONS[args.section] != args.suite:
            raise CLIError(
                f"--section {args.section}: a section of `bench {SECTIONS[args.section]}`, "
                f"not of `bench {args.suite}`"
            )
        if (args.save_run or args.from_run) and not (
            args.suite == "fleet" and args.validation_only
        ):
            raise CLIError("--save-run and --from-run: `bench fleet --validation-only` only")
        if args.from_run is not None and not args.from_run.is_file():
            raise CLIError(f"--from-run {args.from_run}: no such file")
        if args.suite == "report":
            from loraplex.benchmarks.performance_page import run_report

            return run_report(args)
        _note_confined_cpus()
        if args.suite == "registry":
            from loraplex.benchmarks.registry.bench import run_bench
        elif args.suite == "router":
            from loraplex.benchmarks.router.suite import run_bench
        elif args.suite == "sched":
            from loraplex.benchmarks.sched.bench import run_bench
        elif args.suite == "fleet" and args.section == "autoscale":
            from loraplex.benchmarks.fleet.autoscale import run_section as run_bench
        elif args.suite == "fleet":
            from loraplex.benchmarks.fleet.bench import run_bench
            from loraplex.benchmarks.fleet.validation import SavedRunError

            try:
                return run_bench(args)
            except SavedRunError as e:
                raise CLIError(str(e)) from None
        else:
            from loraplex.benchmarks.engine.bench import run_bench
        return run_bench(args)
    except CLIError as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        return 2


def _note_confined_cpus() -> None:
    """Say so where a bench may run on fewer CPUs than the machine has (its affinity mask):
    the run's timings and `cpus` are of those, and nothing else would show it."""
    from loraplex.benchmarks.report import log, usable_cpus

    usable, machine = usable_cpus(), os.cpu_count() or 1
    if usable < machine:
        log(
            f"bench: this process may run on {usable} of the machine's {machine} CPUs (its "
            "CPU affinity); its timings are of those"
        )


def _demo_assets(args: argparse.Namespace) -> int:
    def progress(msg: str) -> None:
        print(msg, file=sys.stderr)

    if args.synthetic:
        from loraplex.demo.synthetic import make_synthetic_assets

        assets = make_synthetic_assets(args.dir, progress=progress)
    else:
        from loraplex.demo.assets import make_demo_assets
        from loraplex.demo.smollm import ModelNotFetched

        try:
            assets = make_demo_assets(args.dir, progress=progress)
        except ModelNotFetched as e:
            raise CLIError(str(e)) from None
    print(f"model:    {assets.model}")
    print(f"adapters: {assets.adapters_dir} ({', '.join(assets.adapter_names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
