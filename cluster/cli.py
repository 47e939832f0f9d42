"""The `loraplex` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.cluster.errors import CLIError
from loraplex.replica.config import MiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo-assets", help="write a small Llama checkpoint, tokenizer and PEFT adapters"
    )
    demo.add_argument("dir", type=Path)

    gen = sub.add_parser("generate", help="offline batch generation from a JSONL file of requests")
    gen.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint folder")
    gen.add_argument("--adapters", type=Path, help="folder whose subfolders are PEFT adapters")
    gen.add_argument("--input", type=Path, required=True, help="JSONL: one request per line")
    gen.add_argument("--output", type=Path, required=True, help="JSONL results, in input order")
    _engine_options(gen)

    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench.add_argument("suite", choices=["engine", "fleet", "registry", "router", "sched"])
    bench.add_argument("--quick", action="store_true", help="smaller model and workload (< 2 min)")
    bench.add_argument("--json", type=Path, help="write the figures here")
    bench.add_argument("--trace", type=Path, help="engine, sched: Azure LLM inference trace CSV")
    bench.add_argument("--sim-only", action="store_true", help="sched: the simulator section only")
    bench.add_argument(
        "--plot", type=Path, help="router, fleet: write the goodput figure (PNG) into this folder"
    )

    from loraplex.cluster import adapters_cli, local_cluster, registry_server

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
            from loraplex.cluster.generate import run_generate

            return run_generate(args)
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


def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step")
    p.add_argument("--max-loras-per-batch", type=int, default=32)
    p.add_argument("--max-lora-rank", type=int, default=128)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--pool-mib", type=int, help="unified pool size (default 512 MiB on CPU)")
    p.add_argument("--page-kib", type=int, help="page size (default: >= 16 tokens of KV)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks (local processes; gloo on CPU)"
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: $LORAPLEX_KERNELS, else Triton on CUDA and the torch references elsewhere",
    )


def engine_config(args: argparse.Namespace):
    from loraplex.replica.config import EngineConfig
    from loraplex.replica.scheduling.scheduler import SchedulerConfig

    try:
        return EngineConfig(
            model=str(args.model),
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            pool_bytes=args.pool_mib * MiB if args.pool_mib else None,
            page_bytes=args.page_kib * 1024 if args.page_kib else None,
            max_lora_rank=args.max_lora_rank,
            scheduler=SchedulerConfig(
                args.max_num_seqs, args.max_num_batched_tokens, args.max_loras_per_batch
            ),
            seed=args.seed,
            kernels=args.kernels,
            tp=args.tp,
        )
    except ValueError as e:
        raise CLIError(str(e)) from None


def _demo_assets(args: argparse.Namespace) -> int:
    from loraplex.demo.assets import make_demo_assets

    assets = make_demo_assets(args.dir, progress=lambda msg: print(msg, file=sys.stderr))
    print(f"model:    {assets.model_dir}")
    print(f"adapters: {assets.adapters_dir} ({', '.join(assets.adapter_names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
