"""Chameleon's squash (seed 004 §4.3.3): a request R2 that bypassed a request R1 — R1's
adapter found no room — is squashed (preempted, recomputed later) once R1 would fit if R2
left and does not fit while it stays; R1 is then admitted in the same step and R2 waits
behind it. Checked on the policy alone (a hand-made `room`), and through the real
Scheduler, KV cache and adapter cache on a pool of 16 pages whose page counts are worked
out by hand in the comments."""

from __future__ import annotations

import torch

from loraplex.benchmarks.sim.replica import AdapterMeta, SimLayout
from loraplex.replica.memory.adapter_cache import AdapterCache, CacheConfig
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.memory.pool import UnifiedPool
from loraplex.replica.memory.transfer import Immediate
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.chameleon import Chameleon, ChameleonParams
from loraplex.replica.scheduling.policy import Admit
from loraplex.replica.scheduling.queue_math import OutputPredictor
from loraplex.replica.scheduling.scheduler import Scheduler, SchedulerConfig
from loraplex.replica.sequence import SeqStatus, Sequence

# 2 layers x (K, V) x 4 heads x 16 = 256 fp32 per token: a page of 1024 holds 4 tokens
MODEL = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "torch_dtype": "float32",
}
PAGE_ELEMS = 1024
PAGE_BYTES = 4 * PAGE_ELEMS


def seq(rid: str, prompt: int, max_tokens: int, adapter: str) -> Sequence:
    return Sequence(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), adapter, 0.0, None)


def test_the_policy_squashes_the_fewest_bypassers_and_requeues_them_behind_the_blocked():
    ch = Chameleon(
        ChameleonParams(),
        OutputPredictor(),
        max_len=1000,
        capacity=lambda: 10_000,
        adapter_bytes=lambda name: 1,
        adapter_tokens=lambda name: 0,
        max_adapter_bytes=lambda: 1,
    )
    long = seq("run", 5, 100, "a")
    ch.add(long, 0.0)
    ch.admit(0.0, lambda s: Admit.OK)
    r1, r2, r3 = seq("R1", 5, 40, "big"), seq("R2", 5, 2, "a"), seq("R3", 5, 1, "a")
    for s in (r1, r2, r3):
        ch.add(s, 0.0)
    ch.admit(1.0, lambda s: Admit.NO_ROOM if s is r1 else Admit.OK)
    assert ch.num_bypasses == 2 and [s.request_id for s in ch.waiting()] == ["R1"]
    # room is there already: nothing to squash, admission will take R1
    assert ch.to_squash(2.0, lambda s, leaving: True) == []
    # no room even if both left: let them run
    assert ch.to_squash(2.0, lambda s, leaving: False) == []
    # room once one of them leaves: the most recently admitted goes (R3), only it
    squashed = ch.to_squash(2.0, lambda s, leaving: len(leaving) >= 1)
    assert squashed == [r3] and ch.num_squashes == 1
    ch.left(r3, 2.0, finished=False)  # what the scheduler's preempt does
    ch.requeue(r3, 2.0)
    assert [s.request_id for s in ch.waiting()] == ["R1", "R3"]
    off = Chameleon(
        ChameleonParams(squash=False),
        OutputPredictor(),
        1000,
        lambda: 10_000,
        lambda n: 1,
        lambda n: 0,
        lambda: 1,
    )
    assert off.to_squash(0.0, lambda s, leaving: len(leaving) >= 1) == []


def _step(scheduled: list[tuple[Sequence, int]]) -> None:
    """What the engine does with a schedule: compute the tokens, sample one per row."""
    for s, n in scheduled:
        s.num_computed += n
        if s.num_computed >= s.num_tokens:
            s.output_ids.append(0)


def test_the_scheduler_squashes_a_bypasser_when_the_blocked_request_would_fit_without_it():
    cfg = ModelConfig.from_dict(MODEL)
    pool = UnifiedPool(16, PAGE_ELEMS, torch.float32, torch.device("meta"))
    kv = KVCache(pool, cfg)
    assert kv.block_size == 4
    cache = AdapterCache(
        pool,
        cfg,
        clock=lambda: 0.0,
        config=CacheConfig(keep_idle=True),
        layout=SimLayout(PAGE_BYTES),
        transfer=Immediate(),
    )
    for name, pages in (("a", 1), ("c", 1), ("big", 6)):
        cache.add(AdapterMeta(name, 8, pages * PAGE_BYTES))
    sched = Scheduler(
        SchedulerConfig(
            policy="chameleon",
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_loras_per_batch=8,
            chameleon=ChameleonParams(min_samples=1000),
            tenant_fairness=False,  # the policy is Chameleon itself: its quotas set below
        ),
        kv,
        cache,
        max_len=256,
        clock=lambda: 0.0,
    )
    sched.policy.quotas = [10_000]  # token quotas are not what this test is about
    x2, x1 = seq("X2", 28, 50, "a"), seq("X1", 8, 50, "a")
    sched.add(x2)
    sched.add(x1)
    # step 1: a (1 page), X2's 28 tokens (7 blocks), X1's 8 (2 blocks): 10 used, 6 free
    _step(sched.schedule())
    assert pool.num_free == 6
    r1, r2 = seq("R1", 4, 50, "big"), seq("R2", 3, 2, "c")
    sched.add(r1)
    sched.add(r2)
    # step 2: X2 and X1 take a block each for their next token (4 free). R1 needs 6 pages
    # for big + 1 block: no room, nothing idle to evict. R2 (predicted 2 tokens, the
    # running ones 49) bypasses it: c (1 page) + 1 block. 2 free.
    step2 = sched.schedule()
    assert [s.request_id for s, _ in step2] == ["X2", "X1", "R2"]
    assert sched.policy.num_bypasses == 1 and pool.num_free == 2
    _step(step2)
    # X1 ends: its 3 blocks come back (5 free). R1 needs 7: 5 + nothing idle does not do;
    # 5 + R2's block + c (its only pin is R2's) does. R2 is squashed, R1 admitted (c
    # evicted for R1's KV block), R2 waits behind R1 with its KV gone.
    sched.finish(x1, "stop")
    assert pool.num_free == 5
    step3 = sched.schedule()
    assert sched.num_squashes == 1 and sched.policy.num_squashes == 1
    assert [s.request_id for s, _ in step3] == ["X2", "R1"]
    assert r1.status is SeqStatus.RUNNING and cache.is_resident("big")
    assert r2.status is SeqStatus.WAITING and r2.num_computed == 0 and r2.num_preemptions == 1
    assert [s.request_id for s in sched.waiting] == ["R2"]
    pool.check_invariants()
    # everyone finishes: R2 runs again once memory frees
    _step(step3)
    for s in (x2, r1):
        sched.finish(s, "stop")
    step4 = sched.schedule()
    assert [s.request_id for s, _ in step4] == ["R2"]
