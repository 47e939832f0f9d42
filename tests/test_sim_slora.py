"""The simulator's S-LoRA follows S-LoRA's code on hand-built sequences. Every expectation
below is read off S-LoRA's source (S-LoRA/S-LoRA, commit c1ddf48), not off the model:

- slora/server/router/manager.py `RouterManager._step`: with no running batch, a batch is
  formed, its adapters loaded (on the compute stream), everything synchronised, the batch
  prefilled; with one, 10 decode steps (`max_wait_tokens`) pass before the queue is looked
  at; at the 5th and 7th (`has_wait_tokens == 5, 7`) the adapters of `next_batch()` are
  prefetched. `_handle_finish_req` offloads, after a decode step that finished a request,
  every adapter the batch no longer uses; `_filter_runing_batch` offloads all of them
  once the batch is empty.
- model_infer/infer_adapter.py `offload_adapters`: an adapter tagged by the latest
  prefetch (`prefetch_tag[dir] == cur_tag`) stays; `load_adapters(prefetch=True)` toggles
  `cur_tag` and tags what it is given; each of load_lora_A / load_lora_B copies the whole
  `w_combined`, so a load moves twice the adapter.
- req_queue.py `_can_add_new_req`: sorted by tokens left, the batch's worst-case KV is
  max_i(left_i · (i+1) + Σ_{j<=i} held_j); a request fits if that stays below
  max_total_token_num less 4·rank slots per distinct adapter; FIFO stops at the first
  request that does not fit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplex.benchmarks.peers.slora import SLoRAConfig, SLoRAQueue, SLoRAReplica, SReq, _peak_kv
from loraplex.benchmarks.sim.profiles import StepLoad, a40_llama7b
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest

SLOT = 512 * 1024  # Llama-7B: K and V of one token, 32 layers x 4096 x fp16
PROFILE = replace(a40_llama7b(), pool_bytes=1000 * SLOT)  # 1000 token slots


def adapter(name: str, rank: int) -> AdapterSpec:
    return AdapterSpec(name, rank, a40_llama7b().adapter_bytes(rank))


ADAPTERS = [adapter("A", 8), adapter("B", 16), adapter("C", 32)]


def request(rid: int, name: str, prompt: int, output: int, at: float = 0.0) -> SimRequest:
    return SimRequest(rid, at, prompt, output, output, name)  # max_new_tokens = output


def test_the_admission_bound_is_s_loras_worst_case_kv():
    # held 11 and 11, left 2 and 29: sorted by left, 29·1 + 11 = 40 and 2·2 + 22 = 26
    assert _peak_kv([11, 11], [2, 29]) == 40
    slots = {"A": 32, "B": 64}.get
    queue = SLoRAQueue(max_total_tokens=200, batch_max_tokens=1000, running_max_req_size=10)
    rec = None
    big = SReq(rec, "A", 150, 100, 100)  # 151 + 99 = 250 > 200 - 32: does not fit
    small = SReq(rec, "B", 5, 5, 5)
    queue.append(big)
    queue.append(small)
    assert queue.generate_new_batch(None, slots) is None  # FIFO: the small one waits too
    fits = SReq(rec, "A", 100, 60, 60)  # 101 + 59 = 160 < 200 - 32
    queue.waiting = [fits, small]
    # with small: held [101, 6], left [59, 4]: 59 + 101 = 160, 4·2 + 107 = 115; adapters
    # 32 + 64 = 96: 160 >= 200 - 96, so small stops the batch
    assert queue.generate_new_batch(None, slots) == [fits]
    assert queue.waiting == [small]


def test_loads_offloads_and_prefetches_follow_s_loras_router_loop():
    cfg = SLoRAConfig(max_req_total_len=256, prefetch=True)
    sim = SLoRAReplica(PROFILE, cfg, ADAPTERS)
    assert sim.tot_size == 1000 and sim.slots_of == {"A": 32, "B": 64, "C": 128}
    sim.add(request(1, "A", 10, 3))
    sim.add(request(2, "B", 10, 30))
    # step 1: both admitted, A and B loaded before the prefill, the step waits for both
    # copies (2x the adapter each, the link shared) then prefills 20 tokens
    assert sim.step()
    assert set(sim.adapters.loaded) == {"A", "B"} and sim.stats.misses == 2
    copies = (2 * (ADAPTERS[0].nbytes + ADAPTERS[1].nbytes)) / PROFILE.link_bytes_per_s
    prefill = PROFILE.step_time(
        StepLoad(20, 20, 10 * 8 + 10 * 16, ADAPTERS[0].nbytes + ADAPTERS[1].nbytes)
    )
    first = copies + 2 * PROFILE.load_setup_s + prefill
    assert sim.clock.now == pytest.approx(first, rel=1e-6)
    # the critical path waited for both copies: mean_load_ms's numerator is each load's
    # time, critical_wait_ms's this wait over the loads waited for (not the prefetches)
    assert sim.stats.wait_seconds == pytest.approx(copies + 2 * PROFILE.load_setup_s, rel=1e-6)
    assert sim.stats.waited_loads == 2
    sim.add(request(3, "C", 10, 5, at=sim.clock.now))
    # decodes 1-2: request 1's third token ends it; A is offloaded, B (in use) stays
    sim.step()
    assert set(sim.adapters.loaded) == {"A", "B"}
    sim.step()
    assert set(sim.adapters.loaded) == {"B"} and sim.stats.evictions == 1
    # decodes 3-5; before the 6th (has_wait_tokens == 5) C is prefetched for the queue head
    for _ in range(3):
        sim.step()
    assert "C" not in sim.adapters.loaded
    sim.step()
    assert set(sim.adapters.loaded) == {"B", "C"} and sim.stats.prefetches == 1
    # decodes 7-10 (the 8th prefetches again: C already there, tagged anew); request 3
    # has waited the whole window: still queued after the 10th decode step
    for _ in range(4):
        sim.step()
    assert sim.stats.prefetches == 1 and sim.adapters.prefetch_tag["C"] == sim.adapters.cur_tag
    assert [r.record.request.rid for r in sim.queue.waiting] == [3]
    assert sim.steps == 11
    # step 12: the mini-batch [3] is admitted; C is on the device: a hit, no wait
    sim.step()
    assert sim.queue.waiting == [] and sim.stats.hits == 1 and sim.stats.misses == 2
    assert sim.steps == 12
    # request 3 ends 4 decodes later; C is not used any more but carries the latest
    # prefetch tag: it stays
    for _ in range(4):
        sim.step()
    assert set(sim.adapters.loaded) == {"B", "C"} and sim.stats.evictions == 1
    # request 2 ends: the batch is empty and every adapter goes
    while sim.has_work():
        sim.step()
    assert sim.adapters.loaded == {} and sim.stats.evictions == 3
    assert sim.stats.loads == 3 and sim.stats.alloc_failures == 0
    assert sim.stats.waited_loads == 2  # C, prefetched, was on the device when admitted
    assert [r.request.rid for r in sorted(sim.done, key=lambda r: r.request.rid)] == [1, 2, 3]


def test_a_prefetch_tag_is_lost_when_a_later_prefetch_does_not_renew_it():
    """Two prefetches toggle cur_tag; an adapter the second one did not tag is offloaded at
    the next finish like any other."""
    sim = SLoRAReplica(PROFILE, SLoRAConfig(max_req_total_len=256), ADAPTERS)
    adapters = sim.adapters
    assert adapters.load(["C"], prefetch=True, free_slots=1000) == ["C"]
    assert adapters.load(["B"], prefetch=True, free_slots=1000) == ["B"]
    assert adapters.offload({"A"}) == ["C"]
    assert set(adapters.loaded) == {"B"}
    # a prefetch stops at the first missing adapter that does not fit the free slots,
    # and tags what it looked at up to there
    assert adapters.load(["A", "C", "B"], prefetch=True, free_slots=100) == ["A"]
    assert "B" not in adapters.prefetch_tag or adapters.prefetch_tag["B"] != adapters.cur_tag
