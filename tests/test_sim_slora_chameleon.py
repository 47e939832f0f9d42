"""Chameleon on the simulator's S-LoRA (benchmarks/peers/slora_chameleon.py) on hand-built
sequences, each expectation read off seed 004, not off the model:

- §4.1: "on every decode iteration, it can remove and add requests to a batch" — where
  S-LoRA looks at its queue after 10 decode steps (tests/test_sim_slora.py);
- §4.2 with prefetch: the adapter of what is admitted next is loaded ahead, idle cached
  adapters evicted to make room, so the admitted request finds it on the device;
- §4.3.3: a request that cannot start only for want of memory for its adapter is bypassed
  by a younger one predicted to finish before memory frees up, and the younger one is
  squashed (to run again later) once its leaving lets the blocked one start.
"""

from __future__ import annotations

from dataclasses import replace

from loraplex.benchmarks.peers.slora import SLoRAConfig
from loraplex.benchmarks.peers.slora_chameleon import ChameleonOnSLoRA
from loraplex.benchmarks.sim.profiles import a40_llama7b
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest
from loraplex.replica.config import ChameleonParams

SLOT = 512 * 1024  # Llama-7B: K and V of one token, 32 layers x 4096 x fp16
PROFILE = replace(a40_llama7b(), pool_bytes=1000 * SLOT)  # 1000 token slots
PARAMS = ChameleonParams()  # one queue until min_samples (32) arrivals: none here


def adapter(name: str, rank: int) -> AdapterSpec:
    return AdapterSpec(name, rank, a40_llama7b().adapter_bytes(rank))  # 4·rank slots


def chameleon(adapters: list[AdapterSpec], max_req_total_len: int = 256) -> ChameleonOnSLoRA:
    cfg = SLoRAConfig(max_req_total_len=max_req_total_len, prefetch=True)
    return ChameleonOnSLoRA(PROFILE, cfg, PARAMS, adapters, 4096, half_life_s=60.0, cache=True)


def request(rid, name, prompt, output, at, max_tokens=None) -> SimRequest:
    return SimRequest(rid, at, prompt, output, max_tokens or output, name)


def test_admission_every_iteration_and_a_prefetch_that_evicts_idle_cached_adapters():
    sim = chameleon(
        [adapter("A", 8), adapter("B", 96), adapter("C", 96), adapter("D", 64)]
    )  # slots: A 32, B 384, C 384, D 256
    sim.add(request(1, "B", 10, 2, 0.0))
    sim.add(request(2, "C", 10, 2, 0.0))
    while sim.has_work():
        sim.step()
    assert set(sim.adapters.loaded) == {"B", "C"}  # idle, cached
    sim.add(request(3, "A", 10, 100, sim.clock.now))
    sim.step()
    assert sim.stats.misses == 3 and sim.free_slots < sim.slots_of["D"]
    sim.add(request(4, "D", 10, 5, sim.clock.now))
    steps = sim.steps
    sim.step()  # D prefetched: one idle cached adapter (B or C) leaves for it
    assert sim.stats.prefetches == 1 and sim.stats.evictions == 1
    assert "D" in sim.adapters.loaded and len({"B", "C"} & set(sim.adapters.loaded)) == 1
    sim.step()  # the next iteration admits request 4: its adapter is there
    assert sim.steps - steps == 2 and sim.queue.waiting == []
    assert sim.stats.misses == 3 and sim.stats.hits == 1 and sim.stats.alloc_failures == 0
    while sim.has_work():
        sim.step()
    assert sorted(r.request.rid for r in sim.done) == [1, 2, 3, 4]


def test_a_request_blocked_for_its_adapter_is_bypassed_and_the_bypasser_squashed():
    # slots: A 32, B 512, C 32; the pool 1000. S-LoRA's check reserves each request's
    # whole output: R0 (C, 200 in, 300 max) reserves 200 + 1 + 298 = 499 tokens.
    sim = chameleon([adapter("A", 8), adapter("B", 128), adapter("C", 8)], 512)
    predictor = sim.queue.policy.predictor
    for _ in range(8):
        predictor.observe("C", 300)  # C's requests look long, A's short
        predictor.observe("A", 5)
    sim.queue.policy.quotas = [10**6]  # the test is about memory, not quotas
    sim.add(request(0, "C", 200, 20, 0.0, max_tokens=300))  # ends after 20 tokens
    sim.step()
    now = sim.clock.now
    sim.add(request(1, "B", 10, 10, now))  # 499 + 10 + 1 + 9 ... > 1000 - 32 - 512
    sim.add(request(2, "A", 300, 200, now))  # predicted 5 tokens, runs 200
    sim.step()  # the decode step after an admission
    sim.step()
    # R1 fits S-LoRA's check but for B's 512 slots: blocked for its adapter. R2's
    # reservation fits beside R0 (899 + 1 < 1000 - 64), and it is predicted to finish
    # (5 steps) before R0 (299): it bypasses R1.
    assert [r.record.request.rid for r in sim.running] == [0, 2]
    assert sim.queue.policy.num_bypasses == 1
    first_token_2 = sim.running[1].record.first_token
    while 0 in [r.record.request.rid for r in sim.running]:
        sim.step()
    # R0 done; R2 (300 + generated + 181 left) still keeps R1 out, R1 would fit without
    # it: R2 is squashed, R1 runs, R2 comes back after it and recomputes
    sim.step()
    assert sim.squashes == 1
    assert [r.record.request.rid for r in sim.running] == [1]
    while sim.has_work():
        sim.step()
    done = {r.request.rid: r for r in sim.done}
    assert sorted(done) == [0, 1, 2]
    assert done[2].first_token == first_token_2 and done[2].finish > done[1].finish
    assert sim.counters().squashes == 1 and sim.counters().bypasses == 1
