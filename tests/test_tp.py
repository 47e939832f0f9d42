"""Tensor parallelism on CPU (gloo, local worker processes) against tp = 1.

A mixed-adapter workload with continuous batching (requests join while others decode, more
than 16 decode steps) runs at tp = 1 and at tp = 2: greedy tokens must be identical and
logits within float32 tolerance. The tp = 2 pool is small, so adapters are evicted and
placed again; after every step each worker must hold exactly rank 0's placements (same
pages) and its pages must hold its own shard of each adapter.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from loraplex.checkpoint_shape import CheckpointError
from loraplex.cluster.cli import main
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.memory.adapters import load_adapter
from loraplex.replica.parallel.handles import WorkerFailed
from loraplex.replica.parallel.shard import ShardPlan
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.scheduler import SchedulerConfig

pytestmark = pytest.mark.slow

PAGE = 64 * 1024
# (prompt length, adapter, max_tokens, step at which it arrives)
WORKLOAD = [
    (7, "chat-r16", 20, 0),
    (3, None, 18, 0),
    (12, "math-r64", 20, 0),
    (5, "sql-r8", 17, 0),
    (9, "translate-r64", 18, 2),
    (4, "chat-r16", 16, 4),
    (6, "summary-r48", 17, 6),
    (8, "legal-r8", 17, 9),
    (2, "code-r32", 16, 12),
]


def _engine(demo_assets, tp: int, pool_pages: int, cache: CacheConfig | None = None) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            cache=cache or CacheConfig(loading="sync"),
            model=str(demo_assets.model),
            dtype="float32",
            pool_bytes=pool_pages * PAGE,
            page_bytes=PAGE,
            scheduler=SchedulerConfig(max_num_seqs=4, max_loras_per_batch=4),
            tp=tp,
            tp_launcher="process",
        )
    )
    try:
        for name in demo_assets.adapter_names:
            engine.add_adapter(name, demo_assets.adapters_dir / name)
    except BaseException:
        engine.close()
        raise
    return engine


def _live_placements(engine: LLMEngine) -> dict[str, tuple[int, ...]]:
    live = dict(engine.adapters.resident)
    for seq in engine.scheduler.running:
        if seq.lora is not None:
            live.setdefault(seq.lora.name, seq.lora)
    return {name: tuple(r.pages) for name, r in live.items()}


def _serve(engine: LLMEngine, check=None):
    """Run WORKLOAD; {request: (tokens, [logits per token])}."""
    out: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    step = 0
    vocab = engine.model_config.vocab_size
    while step == 0 or engine.has_unfinished():
        for i, (n, adapter, max_tokens, arrival) in enumerate(WORKLOAD):
            if arrival == step:
                prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(i))
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=0, ignore_eos=True, return_logits=True
                )
                engine.add_request(prompt.tolist(), params, adapter, request_id=f"r{i}")
                out[f"r{i}"] = ([], [])
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].append(o.logits)
        if check is not None:
            check(engine, step)
        step += 1
    return out, step


@pytest.mark.parametrize(
    "cache",
    [CacheConfig(loading="sync"), CacheConfig(loading="thread", prefetch=2)],
    ids=["sync-loads", "copy-thread-and-prefetch"],
)
def test_tp2_matches_tp1_with_eviction_on_every_rank(demo_assets, cache):
    reference = _engine(demo_assets, tp=1, pool_pages=256)
    expected, _ = _serve(reference)
    reference.close()

    mc = reference.model_config
    shards = {
        name: ShardPlan(mc, 1, 2).shard_adapter(
            load_adapter(demo_assets.adapters_dir / name, name, mc, 128)
        )
        for name in demo_assets.adapter_names
    }
    checked = []

    def consistent(engine: LLMEngine, step: int) -> None:
        live = _live_placements(engine)
        (state,) = engine.tp.worker_state()
        assert {name: pages for name, (pages, _) in state.items()} == live, f"step {step}"
        if step % 5 == 0:
            for name, (_, tensors) in state.items():
                for key, (a, bt) in tensors.items():
                    want_a, want_bt = shards[name].modules[key]
                    assert torch.equal(a, want_a) and torch.equal(bt, want_bt), (name, key)
                checked.append(name)

    # room for about 3 adapters' shards; rank 0 may copy its shard on a thread while the
    # workers place theirs when the adapter turns resident
    engine = _engine(demo_assets, tp=2, pool_pages=40, cache=cache)
    try:
        got, steps = _serve(engine, consistent)
        assert engine.adapters.stats.evictions > 0, "the small pool should have evicted"
        assert engine.tp.comm.sent.lora > 0 and engine.tp.comm.sent.base > 0
    finally:
        engine.close()
    assert steps >= 17 and checked
    assert got.keys() == expected.keys()
    for rid, (tokens, logits) in expected.items():
        assert got[rid][0] == tokens, rid
        assert len(got[rid][1]) == len(logits) >= 16
        for a, b in zip(got[rid][1], logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_dying_worker_fails_the_step_and_never_hangs(demo_assets):
    engine = _engine(demo_assets, tp=2, pool_pages=64)
    try:
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        engine.add_request([1, 2, 3], params, "chat-r16")
        engine.step()
        worker = engine.tp.workers[0]
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.join(10)
        assert engine.tp.failure() == "tp workers [1] are not running"
        start = time.monotonic()
        with pytest.raises((WorkerFailed, RuntimeError)):
            for _ in range(3):
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 15


def test_tp_must_divide_the_model(demo_assets):
    with pytest.raises(CheckpointError, match="tp=3 must divide"):
        LLMEngine(EngineConfig(model=str(demo_assets.model), tp=3, tp_launcher="process"))


def test_generate_with_tp2_writes_what_tp1_writes(demo_assets, tmp_path: Path):
    requests = [
        {"prompt_token_ids": [5, 6, 7, 8], "adapter": "chat-r16", "max_tokens": 8},
        {"prompt_token_ids": [9, 10], "max_tokens": 8},
        {"prompt_token_ids": [11, 12, 13], "adapter": "math-r64", "max_tokens": 8},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r | {"temperature": 0}) for r in requests) + "\n")
    results = {}
    for tp in (1, 2):
        dest = tmp_path / f"out-tp{tp}.jsonl"
        argv = ["generate", "--model", str(demo_assets.model), "--adapters",
                str(demo_assets.adapters_dir), "--input", str(src), "--output", str(dest),
                "--dtype", "float32", "--pool-mib", "16", "--tp", str(tp)]  # fmt: skip
        assert main(argv) == 0
        results[tp] = [json.loads(line)["token_ids"] for line in dest.read_text().splitlines()]
    assert results[2] == results[1]
    assert all(len(t) == 8 for t in results[2])


def test_bench_reports_the_tp_figures(tmp_path: Path):
    from test_bench_smoke import TINY

    from loraplex.benchmarks.engine import bench as bench_engine

    model_dir, heavy, light, _ = bench_engine._build_assets(tmp_path, TINY.model)
    tp = bench_engine._tensor_parallel(model_dir, heavy, light, TINY)
    assert tp["resident_adapters"] == len(heavy) + len(light)
    # every matrix is cut in two; pages round up a little
    assert 0.45 < tp["adapter_bytes_per_rank_ratio"] < 0.6
    assert 0 < tp["lora_comm_ratio"] < tp["lora_comm_ratio_heavy"]
    assert tp["step_time_ratio_tp2_vs_tp1"] > 0


def test_tp2_with_triton_kernels_matches_tp1_torch(demo_assets):
    """The Triton backend under tensor parallelism (the workers inherit TRITON_INTERPRET
    on CPU): sliced LoRA inputs, the all-reduced [T, R] shrink output, decode attention."""
    if torch.cuda.is_available():
        pytest.skip("runs the Triton kernels interpreted on CPU; CUDA runs them natively")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = []
    for tp, kernels in ((1, "torch"), (2, "triton")):
        engine = LLMEngine(
            EngineConfig(
                model=str(demo_assets.model),
                dtype="float32",
                pool_bytes=64 * PAGE,
                page_bytes=PAGE,
                tp=tp,
                tp_launcher="process",
                kernels=kernels,
            )
        )
        try:
            for name in ("chat-r16", "math-r64"):
                engine.add_adapter(name, demo_assets.adapters_dir / name)
            params = SamplingParams(
                max_tokens=4, temperature=0, ignore_eos=True, return_logits=True
            )
            logits: list[torch.Tensor] = []
            outs = engine.generate(
                [[5, 6, 7, 8], [9, 10], [11, 12, 13]],
                [params] * 3,
                ["chat-r16", None, "math-r64"],
                on_output=lambda o, sink=logits: sink.append(o.logits),
            )
        finally:
            engine.close()
        results.append(([o.token_ids for o in outs], logits))
    (tokens1, logits1), (tokens2, logits2) = results
    assert tokens2 == tokens1
    for a, b in zip(logits2, logits1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_tp2_remove_and_readd_between_steps_matches_tp1(demo_assets):
    """Host-tier changes reach every rank in order: remove an adapter and register another
    checkpoint under its name between two steps, while a request still holds the old one."""
    adapters = demo_assets.adapters_dir
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    results = []
    for tp in (1, 2):
        engine = _engine(demo_assets, tp=tp, pool_pages=128)
        try:
            engine.add_request([4, 5, 6], params, "chat-r16", request_id="old")
            outs = {"old": [], "new": []}
            for step in range(8):
                if step == 2:
                    engine.remove_adapter("chat-r16")
                    engine.add_adapter("chat-r16", adapters / "translate-r64")
                    engine.add_request([4, 5, 6], params, "chat-r16", request_id="new")
                for o in engine.step():
                    outs[o.request_id].append((o.new_token_ids[0], o.logits))
        finally:
            engine.close()
        results.append(outs)
    for rid in ("old", "new"):
        assert len(results[1][rid]) == len(results[0][rid]) == 6
        for (t2, l2), (t1, l1) in zip(results[1][rid], results[0][rid], strict=True):
            assert t2 == t1, rid
            torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)
    # the replacement is another adapter: the same prompt continues differently
    assert [t for t, _ in results[0]["new"]] != [t for t, _ in results[0]["old"]]


def test_tp2_tied_embeddings_and_a_vocab_tp_does_not_divide(tmp_path: Path):
    """The LM head is read from the embedding's rows, and the last rank pads its vocab
    share with zero rows that the gather trims."""
    from loraplex.demo.synthetic import ModelSpec, write_checkpoint

    spec = ModelSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     vocab_size=321, tie_word_embeddings=True)  # fmt: skip
    write_checkpoint(tmp_path, spec, seed=3, with_tokenizer=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    results = []
    for tp in (1, 2):
        engine = LLMEngine(
            EngineConfig(
                model=str(tmp_path),
                dtype="float32",
                pool_bytes=4 << 20,
                tp=tp,
                tp_launcher="process",
            )  # fmt: skip
        )
        try:
            logits: list[torch.Tensor] = []
            (out,) = engine.generate(
                [[7, 300, 320, 1]],
                [params],
                [None],
                on_output=lambda o, sink=logits: sink.append(o.logits),
            )
        finally:
            engine.close()
        results.append((out.token_ids, logits))
    assert results[1][0] == results[0][0]
    for a, b in zip(results[1][1], results[0][1], strict=True):
        assert a.shape == (321,)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
