"""Prefix caching against two oracles: the engine with prefix caching off, and transformers +
PEFT (teacher-forced, as in test_engine_oracle.py).

Scripts of requests arrive in waves, so later requests find the blocks earlier ones filled:
prefixes shared over 0, 1 and many blocks, the same tokens under another adapter (no hit),
prompts ending on and just past a block boundary, and a later turn of a conversation
whose prompt holds the earlier turn's generated tokens (blocks filled during decode). With
caching on, every request's greedy tokens equal those with caching off and its logits are
within 1e-4 of them; both match PEFT. The second script runs in a small pool with a prefill
budget that is not a multiple of the block size: requests are preempted, cached blocks are
evicted, and block boundaries fall inside prefill chunks — at tp = 1 and tp = 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from test_engine_oracle import Driver, Run, check_against_oracle, demo_engine, token_prompt

from loraplex.replica.engine import LLMEngine
from loraplex.replica.scheduling.scheduler import SchedulerConfig

pytestmark = [
    pytest.mark.oracle,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

SAME_ATOL = 1e-4  # float32 throughout: caching on vs off, and vs PEFT (seen: < 1e-5)
BS = 8  # tokens per block: 16 KiB pages of the demo model's fp32 KV (2 KiB per token)
PAGE = 16 * 1024


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: Callable[[dict[str, Run]], list[int]]  # from the runs so far (a later turn)
    max_tokens: int
    adapter: str | None
    at_step: int = 0
    after: str | None = None  # arrives once this request has finished
    cached: int | None = None  # prompt tokens it must find cached (None: not checked)


def fixed(ids: list[int]) -> Callable[[dict[str, Run]], list[int]]:
    return lambda runs: ids


def serve(engine: LLMEngine, script: list[Req], max_steps: int = 400) -> dict[str, Run]:
    driver = Driver(engine)
    pending = list(script)
    while pending or engine.has_unfinished():
        assert driver.num_steps < max_steps, "the engine made no progress"
        for req in [r for r in pending if _arrived(r, driver)]:
            driver.add(req.rid, req.prompt(driver.runs), req.max_tokens, req.adapter)
            pending.remove(req)
        driver.step()
    for run in driver.runs.values():
        assert run.finish_reason == "length" and len(run.tokens) == run.max_tokens, run.request_id
    engine.pool.check_invariants()
    return driver.runs


def _arrived(req: Req, driver: Driver) -> bool:
    if driver.num_steps < req.at_step:
        return False
    if req.after is None:
        return True
    before = driver.runs.get(req.after)
    return before is not None and before.finish_reason is not None


def assert_same(on: dict[str, Run], off: dict[str, Run]) -> float:
    """Identical greedy tokens, logits within SAME_ATOL; the largest difference."""
    assert on.keys() == off.keys()
    worst = 0.0
    for rid, run in off.items():
        assert on[rid].tokens == run.tokens, rid
        diff = float((torch.stack(on[rid].logits) - torch.stack(run.logits)).abs().max())
        assert diff <= SAME_ATOL, f"{rid}: logits differ by {diff:.3g} with caching on"
        worst = max(worst, diff)
    return worst


P_A, P_B, P_C = token_prompt(40, 101), token_prompt(21, 102), token_prompt(30, 103)

SHARING = [
    Req("a", fixed(P_A), 6, "sql-r8"),
    Req("b", fixed(P_B), 6, None),
    Req("c", fixed(P_C), 12, "chat-r16"),
    # step 2: the first wave's prompts are in the cache
    Req("one-block", fixed(P_A[:8] + token_prompt(13, 201)), 8, "sql-r8", 2, cached=8),
    Req("many-blocks", fixed(P_A + token_prompt(7, 202)), 8, "sql-r8", 2, cached=40),
    Req("no-block", fixed(P_C[:5] + token_prompt(20, 203)), 8, "chat-r16", 2, cached=0),
    Req("other-adapter", fixed(P_A + token_prompt(7, 204)), 8, "code-r32", 2, cached=0),
    Req("base-model", fixed(P_A + token_prompt(7, 205)), 8, None, 2, cached=0),
    Req("same-prompt", fixed(P_B), 8, None, 2, cached=16),  # never its last token
    Req("ends-on-boundary", fixed(P_B[:16]), 8, None, 2, cached=8),
    Req("past-boundary", fixed(P_B[:17]), 8, None, 2, cached=16),
    # c's next turn: its prompt, its 12 generated tokens (11 computed, during decode), more
    Req(
        "next-turn",
        lambda runs: runs["c"].prompt_ids + runs["c"].tokens + token_prompt(6, 206),
        8,
        "chat-r16",
        after="c",
        cached=40,
    ),
]


def test_shared_prefixes_match_caching_off_and_peft(demo_assets, oracle_logits):
    adapters = ("sql-r8", "chat-r16", "code-r32")
    off = serve(
        demo_engine(demo_assets, adapters, page_bytes=PAGE, enable_prefix_caching=False), SHARING
    )
    engine = demo_engine(demo_assets, adapters, page_bytes=PAGE)
    assert engine.kv.block_size == BS
    on = serve(engine, SHARING)

    for req in SHARING:
        if req.cached is not None:
            assert on[req.rid].seq.num_cached_tokens == req.cached, req.rid
        assert off[req.rid].seq.num_cached_tokens == 0
    stats = engine.stats()["prefix_cache"]
    hits = sum(r.cached for r in SHARING if r.cached)
    assert stats["hit_tokens"] == hits
    assert stats["prompt_tokens_computed"] == stats["prompt_tokens"] - hits
    assert engine.stats()["preemptions"] == 0

    assert_same(on, off)
    check_against_oracle(list(on.values()), oracle_logits, atol=SAME_ATOL)


def _pressure_script(shared: list[int]) -> list[Req]:
    """Many requests on one 36-token prefix (4.5 blocks) in a pool too small for them."""
    return [
        Req("p0", fixed(shared + token_prompt(9, 301)), 24, "sql-r8"),
        Req("p1", fixed(shared + token_prompt(5, 302)), 4, "sql-r8"),  # ends early
        Req("p2", fixed(token_prompt(20, 303)), 24, None),
        Req("p3", fixed(shared + token_prompt(9, 304)), 20, "support-r12"),
        Req("p4", fixed(shared[:8] + token_prompt(15, 305)), 16, "sql-r8"),
        Req("p5", fixed(shared + token_prompt(14, 306)), 12, "sql-r8", after="p1"),
        Req(
            "p6",
            lambda runs: runs["p1"].prompt_ids + runs["p1"].tokens + token_prompt(5, 307),
            12,
            "sql-r8",
            after="p1",
        ),
        Req("p7", fixed(shared[:20] + token_prompt(30, 308)), 12, "legal-r8", at_step=10),
        Req("p8", fixed(shared + token_prompt(3, 309)), 12, None, at_step=12),
    ]


PRESSURE_ADAPTERS = ("sql-r8", "legal-r8", "support-r12")


def _pressure_engine(demo_assets, tp: int = 1, **overrides) -> LLMEngine:
    page = PAGE // tp  # tp = 2 holds half the KV heads per rank: the same 8 tokens a block
    return demo_engine(
        demo_assets,
        PRESSURE_ADAPTERS,
        page_bytes=page,
        pool_bytes=40 * page,
        scheduler=SchedulerConfig(max_num_batched_tokens=12),  # chunks end mid-block
        tp=tp,
        tp_launcher="process",
        **overrides,
    )


def _check_pressure_run(engine: LLMEngine) -> None:
    stats = engine.stats()
    prefix = stats["prefix_cache"]
    assert engine.kv.block_size == BS
    assert stats["preemptions"] > 0, "the pool should have preempted"
    assert prefix["evictions"] > 0, "cached blocks should have been evicted"
    assert prefix["hit_blocks"] > 0


@pytest.fixture(scope="module")
def pressure_off(demo_assets) -> dict[str, Run]:
    engine = _pressure_engine(demo_assets, enable_prefix_caching=False)
    return serve(engine, _pressure_script(token_prompt(36, 300)))


def test_preemption_eviction_and_chunk_boundaries_match_caching_off_and_peft(
    demo_assets, oracle_logits, pressure_off
):
    engine = _pressure_engine(demo_assets)
    on = serve(engine, _pressure_script(token_prompt(36, 300)))
    _check_pressure_run(engine)
    # a request found cached blocks and then prefilled the rest over a block boundary
    # inside a 12-token chunk
    assert any(
        r.seq.num_cached_tokens and len(r.prompt_ids) - r.seq.num_cached_tokens > 12
        for r in on.values()
    )
    assert_same(on, pressure_off)
    check_against_oracle(list(on.values()), oracle_logits, atol=SAME_ATOL)
    check_against_oracle(list(pressure_off.values()), oracle_logits, atol=SAME_ATOL)


@pytest.mark.slow
def test_tp2_with_prefix_caching_matches_tp1_without(demo_assets, oracle_logits, pressure_off):
    engine = _pressure_engine(demo_assets, tp=2, dtype="float32")
    try:
        on = serve(engine, _pressure_script(token_prompt(36, 300)))
        _check_pressure_run(engine)
    finally:
        engine.close()
    assert_same(on, pressure_off)
    check_against_oracle(list(on.values()), oracle_logits, atol=SAME_ATOL)
