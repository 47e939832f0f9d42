"""CLI flags derived from the settings (cluster/flags.py): each `loraplex generate` engine
flag and each `loraplex registry` limit accepts what the YAML key of the same setting
accepts, refuses the rest naming the flag, and makes the same engine as the YAML config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import annotated_types
import pytest

from loraplex.adapter_format import AdapterLimits
from loraplex.cluster import generate, registry_server
from loraplex.cluster.config import LoraplexConfig
from loraplex.cluster.errors import CLIError
from loraplex.cluster.flags import flag, from_flags
from loraplex.replica.config import build_engine_config
from loraplex.replica.settings import EngineSettings
from loraplex.settings import declared_fields


def parser_of(add_parser) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex")
    add_parser(parser.add_subparsers(dest="command"))
    return parser


GENERATE = parser_of(generate.add_parser)
REQUIRED = ["generate", "--model", "m", "--input", "in.jsonl", "--output", "out.jsonl"]


def bounds(owner: type) -> list[tuple[str, str, object]]:
    """(field, ge|le, bound) for every bounded field of `owner`."""
    found = []
    for name, field in declared_fields(owner).items():
        for bound in field.metadata:
            if isinstance(bound, annotated_types.Ge):
                found.append((name, "ge", bound.ge))
            elif isinstance(bound, annotated_types.Le):
                found.append((name, "le", bound.le))
    return found


@pytest.mark.parametrize(("name", "side", "bound"), bounds(EngineSettings))
def test_each_engine_flag_has_the_yaml_keys_bounds(name, side, bound):
    inside, outside = (bound, bound - 1) if side == "ge" else (bound, bound + 1)
    # low_watermark may reach 1 only with high_watermark there too (a check across fields)
    more = {"high_watermark": 1.0} if name == "low_watermark" else {}
    given = [*REQUIRED, *(a for k, v in more.items() for a in (flag(k), str(v)))]
    ok = GENERATE.parse_args([*given, flag(name), str(inside)])
    assert getattr(from_flags(ok, EngineSettings), name) == inside
    LoraplexConfig(engine={name: inside, **more})  # the YAML key takes it too
    bad = GENERATE.parse_args([*given, flag(name), str(outside)])
    with pytest.raises(CLIError, match=f"^{flag(name)}: Input should be"):
        from_flags(bad, EngineSettings)
    with pytest.raises(ValueError, match=f"engine.{name}"):
        LoraplexConfig(engine={name: outside, **more})


def test_every_key_of_the_yaml_engine_section_is_a_generate_flag(capsys):
    with pytest.raises(SystemExit):
        GENERATE.parse_args(["generate", "--help"])
    usage = capsys.readouterr().out
    missing = [f for f in [*map(flag, declared_fields(EngineSettings)), "--tp"] if f not in usage]
    assert not missing


def test_generate_flags_make_the_engine_the_yaml_config_makes(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    values = {
        "dtype": "float16",
        "device": "cpu",
        "max_model_len": 256,
        "pool_mib": 48,
        "page_kib": 128,
        "max_lora_rank": 32,
        "max_num_seqs": 5,
        "max_num_batched_tokens": 300,
        "max_loras_per_batch": 3,
        "seed": 11,
        "scheduler_policy": "sjf",
        "tenant_fairness": False,
        "eviction": "gdsf",
        "adapter_loading": "sync",
        "prefetch": 2,
        "low_watermark": 0.1,
        "high_watermark": 0.2,
        "host_mib": 64,
        "kernels": "torch",
        "dense_gemm": "torch",
        "kv_cache_dtype": "bfloat16",
        "enable_prefix_caching": False,
        "share_base_prefix": True,
        "stream_events_per_s": 120.0,
        "stream_events_per_s_per_stream": 10.0,
    }
    assert set(values) == set(declared_fields(EngineSettings))  # every setting, not defaults
    argv = [*REQUIRED, "--tp", "2"]
    for name, value in values.items():
        if isinstance(value, bool):  # --x / --no-x
            argv.append(flag(name) if value else flag(name).replace("--", "--no-", 1))
        else:
            argv += [flag(name), str(value)]
    args = GENERATE.parse_args(argv)
    args.model = model
    from_cli = generate.engine_config(args)
    config = LoraplexConfig(model=str(model), engine=values, replicas={"tp": 2})
    assert from_cli == build_engine_config(config.engine_config())
    assert (from_cli.pool_bytes, from_cli.page_bytes) == (48 << 20, 128 << 10)
    assert from_cli.cache.host_bytes == 64 << 20
    assert from_cli.scheduler.tenant_fairness is False
    assert (from_cli.enable_prefix_caching, from_cli.share_base_prefix) == (False, True)
    # both were dropped on the way to the engine: a replica streamed at the defaults
    assert (from_cli.stream_events_per_s, from_cli.stream_events_per_s_per_stream) == (120, 10)


def test_a_cross_field_refusal_is_the_yaml_one():
    args = GENERATE.parse_args([*REQUIRED, "--low-watermark", "0.3", "--high-watermark", "0.1"])
    with pytest.raises(CLIError, match="low_watermark \\(0.3\\) must not exceed high_watermark"):
        from_flags(args, EngineSettings)


def test_registry_rank_limit_is_the_engines():
    registry = parser_of(registry_server.add_parser)
    top = declared_fields(AdapterLimits)["max_lora_rank"].metadata
    (le,) = [b.le for b in top if isinstance(b, annotated_types.Le)]
    args = registry.parse_args(["registry", "--model", "m", "--max-lora-rank", str(le + 1)])
    with pytest.raises(CLIError, match="--max-lora-rank"):
        from_flags(args, AdapterLimits)
    with pytest.raises(ValueError, match="engine.max_lora_rank"):
        LoraplexConfig(engine={"max_lora_rank": le + 1})
