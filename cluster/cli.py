"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.cluster import adapters_cli, generate, local_cluster, registry_server
from loraplex.cluster.errors import CLIError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo-assets", help="write a small Llama checkpoint, tokenizer and PEFT adapters"
    )
    demo.add_argument("dir", type=Path)

    generate.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench.add_argument("suite", choices=["engine", "fleet", "registry", "router", "sched"])
    bench.add_argument("--quick", action="store_true", help="smaller model and workload (< 2 min)")
    bench.add_argument("--json", type=Path, help="write the figures here")
    bench.add_argument("--trace", type=Path, help="engine, sched: Azure LLM inference trace CSV")
    bench.add_argument("--sim-only", action="store_true", help="sched: the simulator section only")
    bench.add_argument(
        "--plot", type=Path, help="router, fleet: write the goodput figure (PNG) into this folder"
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
        if args.suite == "registry":
            from loraplex.benchmarks.registry import run_bench
        elif args.suite == "router":
            from loraplex.benchmarks.router import run_bench
        elif args.suite == "sched":
            from loraplex.benchmarks.sched import run_bench
        elif args.suite == "fleet":
            from loraplex.benchmarks.fleet import run_bench
        else:
            from loraplex.benchmarks.engine import run_bench
        return run_bench(args)
    except CLIError as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        return 2


def _demo_assets(args: argparse.Namespace) -> int:
    from loraplex.demo.assets import make_demo_assets

    assets = make_demo_assets(args.dir, progress=lambda msg: print(msg, file=sys.stderr))
    print(f"model:    {assets.model_dir}")
    print(f"adapters: {assets.adapters_dir} ({', '.join(assets.adapter_names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
