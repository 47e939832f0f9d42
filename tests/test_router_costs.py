"""The step timings `bench router` records for the simulator's CPU profile
(benchmarks/router/costs.py): a stream that lets the fit tell each term apart."""

from __future__ import annotations

from dataclasses import replace

from loraplex.benchmarks.router import bench as rb
from loraplex.benchmarks.router.assets import replica_engine_config, write_assets
from loraplex.benchmarks.router.costs import measure_router_costs


def test_the_calibration_stream_mixes_base_rows_adapters_and_prefill_bursts(tmp_path):
    """Steps whose tokens are not all LoRA tokens (base-model requests among them), steps
    of several adapters, and prefill steps of several prompts: with LoRA requests alone,
    joining one at a time, the fit could not separate the LoRA terms from a token's cost
    and fitted them 0."""
    w = replace(rb.QUICK, num_adapters=16)
    model_dir, sources = write_assets(tmp_path, w)
    config, _ = replica_engine_config(model_dir, sources, w)
    _, calibration = measure_router_costs(config, sources, w)
    steps = [load for load, seconds in calibration["steps"] if seconds > 0]
    assert len(steps) >= 8 * w.max_num_seqs
    assert all(1 <= s.rows <= w.max_num_seqs and s.adapters <= s.rows for s in steps)
    assert any(s.token_rank < 8 * s.tokens for s in steps)  # rank 8 is the smallest
    assert max(s.adapters for s in steps) >= 4
    assert max(s.tokens - s.rows for s in steps) >= 4 * w.prompt_tokens[0]  # several prompts
