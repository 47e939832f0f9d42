"""Scheduling policies on hand-built cases: the quota arithmetic, K-means cut-offs of
minimal WCSS, the output predictor, FIFO / SJF-with-aging order, Chameleon's two-phase
admission and its bypass starvation guard. Expected values are worked out by hand from
the formulas of seed 004 §4.3."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest

from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.chameleon import Chameleon, ChameleonParams
from loraplex.replica.scheduling.policy import FIFO, Admit, SJFAging
from loraplex.replica.scheduling.queue_math import (
    OutputPredictor,
    QueueLoad,
    choose_cutoffs,
    kmeans_1d,
    token_quotas,
    weighted_request_size,
)
from loraplex.replica.sequence import Sequence

CHAMELEON = ChameleonParams()  # the paper's weights and K_max


def seq(rid: str, prompt: int, max_tokens: int, adapter: str | None = None) -> Sequence:
    return Sequence(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), adapter, 0.0, None)


class Recorder:
    """try_admit that answers from a table (default OK) and records what it was asked."""

    def __init__(self, answers: dict[str, Admit] | None = None, capacity: int = 1000):
        self.answers = answers or {}
        self.asked: list[str] = []
        self.admitted: list[str] = []
        self.capacity = capacity

    def __call__(self, s: Sequence) -> Admit:
        self.asked.append(s.request_id)
        if len(self.admitted) >= self.capacity:
            return Admit.FULL
        answer = self.answers.get(s.request_id, Admit.OK)
        if answer is Admit.OK:
            self.admitted.append(s.request_id)
        return answer


# -- arithmetic ----------------------------------------------------------------------------


def test_quota_minimums_follow_the_mm1_bound_and_the_rest_is_split_by_weight():
    small = QueueLoad(max_size=100, duration_s=2.0, rate=1.0, weight=1.0)
    large = QueueLoad(max_size=1000, duration_s=10.0, rate=0.1, weight=3.0)
    # Tok_min = S·D·(1/SLO + λ): 100·2·(0.2 + 1) = 240 and 1000·10·(0.2 + 0.1) = 3000;
    # the remaining 20000 − 3240 = 16760 split 1 : 3 = 4190 : 12570.
    assert token_quotas([small, large], 20_000, slo_s=5.0) == [240 + 4190, 3000 + 12570]
    # Minimums over the total (3240 > 1620): every minimum scaled by 1620 / 3240 = 1/2,
    # the paper's ratio 240 : 3000 kept (the paper's quotas: no floor).
    assert token_quotas([small, large], 1620, slo_s=5.0) == [120, 1500]


def test_overloaded_quotas_keep_the_minimums_ratio_whatever_the_weights():
    # The paper's Tok_min with the minimums over the total: the weights (λ·mean tokens)
    # play no part, each queue gets its minimum times the same factor. Minimums
    # 1000·4·(0.2 + 1) = 4800 and 400·4·(0.2 + 0.25) = 720; total 1000: 869.6 and 130.4.
    skewed = QueueLoad(max_size=1000, duration_s=4.0, rate=1.0, weight=1.0 * 100)
    even = QueueLoad(max_size=400, duration_s=4.0, rate=0.25, weight=0.25 * 400)
    assert token_quotas([skewed, even], 1000, slo_s=5.0) == [870, 130]
    heavy = QueueLoad(max_size=400, duration_s=4.0, rate=0.25, weight=1e6)
    assert token_quotas([skewed, heavy], 1000, slo_s=5.0) == [870, 130]
    assert token_quotas([], 100, 5.0) == []


def test_no_queue_quota_is_left_under_two_of_its_largest_requests():
    """The quota floor (`quota_floor_requests`, off by default) at two: the paper's split
    leaves the large queue 702 tokens for requests of 1000, one at a time; the floor
    raises it to 2000 and takes the difference from the queues above their own floors in
    proportion to what they hold above them, so none is pushed under its own."""
    assert ChameleonParams().quota_floor_requests is None
    small = QueueLoad(max_size=100, duration_s=2.0, rate=5.0, weight=50.0)
    mid = QueueLoad(max_size=200, duration_s=2.0, rate=2.0, weight=20.0)
    large = QueueLoad(max_size=1000, duration_s=2.0, rate=0.1, weight=3.0)
    # paper: minimums 100·2·(0.2 + 5) = 1040, 200·2·(0.2 + 2) = 880, 1000·2·(0.2 + 0.1)
    # = 600; the other 2480 of 5000 split 50 : 20 : 3 -> [2739, 1559, 702]
    assert token_quotas([small, mid, large], 5000, 5.0) == [2739, 1559, 702]
    # floors 200, 400, 2000: the large queue short by 1298, taken from the others in
    # proportion to what they hold above their floors, 2539 : 1159 -> 891 and 407
    floored = token_quotas([small, mid, large], 5000, 5.0, floor_requests=2)
    assert floored == [2739 - 891, 1559 - 407, 2000]
    # a pool larger than every floor and every minimum: the floor changes nothing
    assert token_quotas([small, large], 40_000, 5.0, floor_requests=2) == token_quotas(
        [small, large], 40_000, 5.0
    )
    # the floors, 200 and 2000, over the pool of 1100: split in their ratio
    assert token_quotas([small, large], 1100, 5.0, floor_requests=2) == [100, 1000]
    # an empty queue (max_size 0) has no floor and gives what it holds above it
    empty = QueueLoad(max_size=0, duration_s=0.0, rate=0.0, weight=0.0)
    assert token_quotas([small, empty, large], 3000, 5.0, floor_requests=2)[2] >= 2000


def two_rank_chameleon(params: ChameleonParams, capacity: int) -> Chameleon:
    """Chameleon over adapters `r8` and `r64` (8 and 64 bytes, no pool tokens), requests of
    up to 1,000 tokens, `capacity` tokens to split."""
    return Chameleon(
        params,
        OutputPredictor(),
        max_len=1000,
        capacity=lambda: capacity,
        adapter_bytes=lambda name: {"r8": 8, "r64": 64}[name],
        adapter_tokens=lambda name: 0,
        max_adapter_bytes=lambda: 64,
    )


def test_chameleon_applies_the_quota_floor_at_refresh():
    """Through the policy: the queue of the large requests is scaled under two of them by
    the paper's rule and holds two with a floor of two."""

    def refreshed(**params) -> Chameleon:
        ch = two_rank_chameleon(
            ChameleonParams(refresh_s=10.0, min_samples=40, slo_s=5.0, **params), 2_000
        )
        for i in range(36):
            ch.add(seq(f"s{i}", 20, 20, "r8"), i * 0.1)
        for i in range(4):
            ch.add(seq(f"l{i}", 800, 150, "r64"), 3.6 + i * 0.1)
        ch.admit(4.0, Recorder(capacity=0))
        return ch

    paper, floored = refreshed(), refreshed(quota_floor_requests=2)
    assert len(paper.cutoffs) >= 1 and sum(paper.quotas) == sum(floored.quotas) == 2_000
    largest = max(e.need for e in floored.entries.values())
    assert paper.quotas[-1] < 2 * largest <= floored.quotas[-1]


def test_p99_quotas_size_minimums_for_the_tail_and_grant_them_largest_queue_first():
    """The departure reported apart (quota_percentile, off by default): M/M/1 time in
    system is exponential with rate μ − λ, so its P99 <= SLO needs μ − λ >= ln(100)/SLO.
    Over the pool, scaling every minimum alike leaves the largest queue one request;
    granting largest first (each at most half of what is left) keeps its minimum."""
    assert ChameleonParams().quota_percentile is None
    small = QueueLoad(max_size=100, duration_s=2.0, rate=1.0, weight=1.0)
    large = QueueLoad(max_size=1000, duration_s=10.0, rate=0.1, weight=3.0)
    p99 = math.log(100) / 5.0
    mins = [100 * 2 * (p99 + 1.0), 1000 * 10 * (p99 + 0.1)]  # 384.2 and 10210.3
    quotas = token_quotas([small, large], 40_000, slo_s=5.0, percentile=0.99)
    assert quotas[0] >= mins[0] and quotas[1] >= mins[1] and sum(quotas) == 40_000
    # over the pool (Σ 10595 > 6000): the large queue's minimum is capped at half the
    # pool, the small queue takes the rest; the paper's scaling would give it 5782
    assert token_quotas([small, large], 6000, slo_s=5.0, percentile=0.99) == [3000, 3000]
    mid = QueueLoad(max_size=500, duration_s=2.0, rate=0.2, weight=1.0)
    # 3 queues, total 11000 (Σ 11716 over it): large 10211 capped at 5500; mid
    # 500·2·(0.921 + 0.2) = 1121.03, rounded up; small the rest
    assert token_quotas([small, mid, large], 11_000, 5.0, 0.99) == [4378, 1122, 5500]


def test_wrs_is_degree_two_in_the_adapter_size():
    ab = (CHAMELEON.a, CHAMELEON.b)
    base = weighted_request_size(50, 100, 10, 100, 200, 40, *ab)
    assert base == pytest.approx((0.4 * 0.5 + 0.6 * 0.5) * 0.25)
    assert weighted_request_size(50, 100, 20, 100, 200, 40, *ab) == pytest.approx(2 * base)


def test_k_is_the_one_of_minimal_wcss_as_in_the_paper():
    rng = np.random.default_rng(0)
    sizes = np.concatenate(
        [rng.normal(1.0, 0.1, 300), rng.normal(10.0, 0.5, 100), rng.normal(20.0, 0.5, 50)]
    )
    cutoffs, wcss = choose_cutoffs(sizes, k_max=4)
    # seed 004 §4.3.4: "picks the K that yields minimal WCSS" — here K = 4 (a 10% elbow
    # would have stopped at 3)
    assert len(wcss) == 4 and wcss[3] < wcss[2] < wcss[1] < wcss[0]
    assert len(cutoffs) == 3
    centroids, _ = kmeans_1d(sizes, 3)
    assert centroids == pytest.approx([1.0, 10.0, 20.0], abs=0.2)


def test_ties_in_wcss_go_to_the_fewest_queues():
    # two distinct sizes: K = 2, 3, 4 all reach WCSS 0, and the fewest queues win
    two = np.array([1.0] * 30 + [4.0] * 10)
    assert choose_cutoffs(two, CHAMELEON.k_max)[0] == [2.5]
    assert choose_cutoffs(np.full(10, 3.0), CHAMELEON.k_max)[0] == []
    assert choose_cutoffs(np.array([]), CHAMELEON.k_max)[0] == []


def test_output_predictor_learns_per_adapter_and_caps_at_max_tokens():
    p = OutputPredictor(quantile=0.5, min_samples=4)
    assert p.predict("a", 300) == 300  # nothing seen: max_tokens
    for _ in range(4):
        p.observe("a", 100)
    assert 100 <= p.predict("a", 1000) <= 128  # a bucket edge at or above 100
    assert p.predict("a", 50) == 50
    p.observe("b", 8)
    assert p.predict("b", 1000) == p.predict("a", 1000) or p.predict("b", 1000) <= 128
    for _ in range(4):
        p.observe("b", 8)
    assert p.predict("b", 1000) == 8  # its own histogram once it has min_samples


# -- FIFO and SJF ----------------------------------------------------------------------------


def test_fifo_blocks_behind_its_head():
    fifo = FIFO()
    for rid in ("a", "b", "c"):
        fifo.add(seq(rid, 4, 4), 0.0)
    rec = Recorder({"a": Admit.NO_ROOM})
    fifo.admit(0.0, rec)
    assert rec.asked == ["a"] and rec.admitted == []
    rec = Recorder()
    fifo.admit(1.0, rec)
    assert rec.admitted == ["a", "b", "c"] and len(fifo) == 0


def test_fifo_and_sjf_let_others_pass_a_request_whose_adapter_is_loading():
    """A loading adapter's request keeps its place while the ones behind it start; a request
    that cannot start for any other reason still blocks the rest."""
    fifo = FIFO()
    sjf = SJFAging(OutputPredictor())
    for rid, out in (("a", 4), ("b", 5), ("c", 6), ("d", 7)):  # SJF's order is FIFO's here
        fifo.add(seq(rid, 4, out), 0.0)
        sjf.add(seq(rid, 4, out), 0.0)
    for policy in (fifo, sjf):
        rec = Recorder({"a": Admit.LOADING, "c": Admit.NO_ROOM})
        policy.admit(0.0, rec)
        assert rec.asked == ["a", "b", "c"] and rec.admitted == ["b"]
        assert [s.request_id for s in policy.waiting()] == ["a", "c", "d"]
        rec = Recorder()
        policy.admit(1.0, rec)
        assert rec.admitted == ["a", "c", "d"] and len(policy) == 0


def test_sjf_orders_by_predicted_output_and_ages_the_long_ones():
    sjf = SJFAging(OutputPredictor(), aging_tokens_per_s=10.0)
    sjf.add(seq("long", 4, 500), now=0.0)
    sjf.add(seq("short", 4, 20), now=0.0)
    assert [s.request_id for s in sjf.waiting()] == ["short", "long"]
    # 100 s later a fresh short request: the long one aged 10 tokens/s: 500 − 1000 < 20 − 0
    sjf.add(seq("fresh", 4, 20), now=100.0)
    assert [s.request_id for s in sjf.waiting()] == ["short", "long", "fresh"]
    rec = Recorder(capacity=2)
    sjf.admit(100.0, rec)
    assert rec.admitted == ["short", "long"] and [s.request_id for s in sjf.waiting()] == ["fresh"]


def test_sjf_remove_and_requeue():
    sjf = SJFAging(OutputPredictor())
    a, b = seq("a", 4, 50), seq("b", 4, 10)
    sjf.add(a, 0.0)
    sjf.add(b, 0.0)
    sjf.remove(b)
    assert sjf.waiting() == [a] and len(sjf) == 1
    sjf.requeue(b, 5.0)  # a preempted request comes back first
    assert sjf.waiting() == [b, a]


# -- Chameleon -------------------------------------------------------------------------------


def chameleon(quotas: list[int], cutoffs: list[float], **params) -> Chameleon:
    """Requests without adapters (size factor 1), max_len 100: WRS = 0.004·in + 0.006·out."""
    ch = Chameleon(
        ChameleonParams(refresh_s=1e9, **params),
        OutputPredictor(),
        max_len=100,
        capacity=lambda: sum(quotas),
        adapter_bytes=lambda name: 1,
        adapter_tokens=lambda name: 0,
        max_adapter_bytes=lambda: 1,
    )
    ch.cutoffs, ch.quotas = cutoffs, list(quotas)
    ch.queues = [deque() for _ in quotas]
    ch.used = [0] * len(quotas)
    ch.last_refresh = 0.0
    return ch


def test_two_phase_admission_quotas_first_then_spare_smallest_queue_first():
    # small: in 5 + out 5 = 10 tokens, WRS 0.05 -> queue 0; large: 50 + 50, WRS 0.5 -> queue 1
    ch = chameleon([30, 100], [0.2])
    smalls = [seq(f"s{i}", 5, 5) for i in range(5)]
    for s in smalls:
        ch.add(s, 0.0)
    ch.add(seq("L", 50, 50), 0.0)
    assert [len(q) for q in ch.queues] == [5, 1]
    rec = Recorder()
    ch.admit(0.0, rec)
    # phase 1: queue 0 within 30 tokens (3 requests), queue 1 within 100 (1); no spare left
    assert rec.admitted == ["s0", "s1", "s2", "L"]
    assert ch.used == [30, 100]

    # the same with no large request: queue 1's unused 100 tokens go to queue 0 in phase 2
    ch = chameleon([30, 100], [0.2])
    for s in [seq(f"s{i}", 5, 5) for i in range(5)]:
        ch.add(s, 0.0)
    rec = Recorder()
    ch.admit(0.0, rec)
    assert rec.admitted == ["s0", "s1", "s2", "s3", "s4"]


def test_a_queue_whose_head_does_not_fit_memory_leaves_the_next_queues_their_turn():
    """Seed 004 §4.1: "on every iteration, Chameleon tries to take requests from all
    queues"; in Algorithm 1 a request that does not fit ends its own queue's put_batch,
    and generate_batch goes on to the next queue. A small queue's head too large for the
    memory left (FULL: its prompt and worst-case output) must not keep the large queue's
    head, which fits, out of the batch."""
    ch = chameleon([30, 100], [0.2])
    ch.add(seq("s0", 5, 5), 0.0)
    ch.add(seq("L", 50, 50), 0.0)
    rec = Recorder({"s0": Admit.FULL})
    ch.admit(0.0, rec)
    assert rec.asked == ["s0", "L"] and rec.admitted == ["L"]
    assert [len(q) for q in ch.queues] == [1, 0]  # s0 keeps its place


def test_a_finished_request_returns_its_quota():
    ch = chameleon([20, 100], [0.2])
    a, b, c = seq("a", 5, 5), seq("b", 5, 5), seq("c", 5, 5)
    for s in (a, b, c):
        ch.add(s, 0.0)
    ch.add(seq("L", 50, 50), 0.0)  # keeps queue 1 non-empty enough to hold its spare
    ch.admit(0.0, Recorder(capacity=3))
    assert ch.used[0] == 20 and len(ch.queues[0]) == 1
    ch.left(a, 1.0, finished=True)
    assert ch.used[0] == 10
    rec = Recorder()
    ch.admit(1.0, rec)
    assert "c" in rec.admitted


def test_a_queue_whose_quota_is_below_one_request_still_runs_one_at_a_time():
    """Scaled quotas (minimums over the pool) can leave a queue less than one of its
    requests; seed 004's put_batch would then never admit it. A queue with nothing
    running starts its head over quota, and only its head: one request's worth."""
    ch = chameleon([30, 60], [0.2])  # queue 1's quota, 60, is below a request's 100
    big = [seq(f"L{i}", 50, 50) for i in range(3)]
    for s in big:
        ch.add(s, 0.0)
    assert [s.request_id for s in ch.upcoming()][:1] == ["L0"]  # prefetch agrees
    rec = Recorder()
    ch.admit(0.0, rec)
    assert rec.admitted == ["L0"] and ch.used == [0, 100]
    rec = Recorder()
    ch.admit(1.0, rec)
    assert rec.admitted == []  # L1 waits while L0 holds more than the quota
    ch.left(big[0], 2.0, finished=True)
    rec = Recorder()
    ch.admit(2.0, rec)
    assert rec.admitted == ["L1"]


def test_requests_sharing_an_adapter_charge_its_tokens_to_their_queue_once():
    """An adapter's memory is held once however many running requests use it; the paper's
    per-request charge (share_adapter_tokens=False) counts it once per request."""

    def make(share: bool) -> Chameleon:
        ch = Chameleon(
            ChameleonParams(refresh_s=1e9, share_adapter_tokens=share),
            OutputPredictor(),
            max_len=100,
            capacity=lambda: 1000,
            adapter_bytes=lambda name: 1,
            adapter_tokens=lambda name: {"a": 40, "b": 30}[name],
            max_adapter_bytes=lambda: 1,
        )
        ch.last_refresh = 0.0
        return ch

    ch = make(share=True)
    x, y, z = seq("x", 5, 5, "a"), seq("y", 5, 5, "a"), seq("z", 5, 5, "b")
    for s in (x, y, z):
        ch.add(s, 0.0)
    ch.admit(0.0, Recorder())
    assert ch.used == [10 + 10 + 10 + 40 + 30]  # a's 40 tokens once
    ch.left(x, 1.0, finished=True)
    assert ch.used == [10 + 10 + 40 + 30]  # y still holds a
    ch.left(y, 1.0, finished=True)
    assert ch.used == [10 + 30]
    ch.left(z, 1.0, finished=True)
    assert ch.used == [0] and ch.holders == {}
    ch = make(share=False)
    for s in (seq("x", 5, 5, "a"), seq("y", 5, 5, "a")):
        ch.add(s, 0.0)
    ch.admit(0.0, Recorder())
    assert ch.used == [2 * (10 + 40)]


def test_service_time_d_is_measured_from_admission_not_arrival():
    # D of the quota formula is the time to process a request: a request that waited 10 s
    # and then ran 2 s is recorded as 2 s, so a queue's wait does not inflate its D.
    ch = chameleon([100, 100], [0.2], starve_s=1e9)
    a = seq("a", 5, 5)
    ch.add(a, 0.0)
    ch.admit(10.0, Recorder())  # phase 1
    assert ch.num_starving == 0
    ch.left(a, 12.0, finished=True)
    assert list(ch.served) == [(ch.served[0][0], 2.0)]
    assert ch.queue_loads(12.0)[0].duration_s == 2.0
    # admitted by the starvation guard: the same
    b = seq("b", 5, 5)
    ch.add(b, 20.0)
    ch.p = ChameleonParams(refresh_s=1e9, starve_s=1.0)
    ch.admit(25.0, Recorder())
    assert ch.num_starving == 1
    ch.left(b, 26.5, finished=True)
    assert ch.served[-1][1] == 1.5


def test_an_empty_queue_may_start_its_head_over_quota():
    ch = chameleon([5, 100], [0.2])  # quota 5 < one small request's 10 tokens
    ch.add(seq("L", 50, 50), 0.0)
    ch.add(seq("s", 5, 5), 0.0)
    rec = Recorder()
    ch.admit(0.0, rec)
    assert "s" in rec.admitted


def test_bypass_only_for_requests_predicted_to_finish_before_memory_frees():
    ch = chameleon([1000], [])
    running = seq("run", 5, 10)  # predicted to finish in 10 decode steps
    ch.add(running, 0.0)
    ch.admit(0.0, Recorder())
    blocked, quick, slow = seq("R1", 5, 40), seq("R2", 5, 2), seq("R3", 5, 50)
    for s in (blocked, quick, slow):
        ch.add(s, 0.0)
    rec = Recorder({"R1": Admit.NO_ROOM})
    ch.admit(0.0, rec)
    # R2 (3 steps <= 10) overtakes R1; R3 (51 steps > 10) may not: the queue stops there
    assert rec.asked == ["R1", "R2"] and rec.admitted == ["R2"]
    assert ch.num_bypasses == 1


def test_bypass_waits_for_the_memory_the_blocked_request_needs_not_the_first_to_free():
    """§4.3.3: R2 may bypass R1 if "how soon will the memory needed by R1 become
    available" is longer than R2's execution. R1 here needs both running requests gone:
    its memory frees in 40 steps, not in the 10 after which the first one leaves, so a
    20-step R2 may pass it (and a 50-step one may not)."""
    ch = chameleon([1000], [])
    first, second = seq("A", 5, 10), seq("B", 5, 40)
    for s in (first, second):
        ch.add(s, 0.0)
    ch.admit(0.0, Recorder())

    def room(waiting: Sequence, leaving: list[Sequence]) -> bool:
        return {first, second} <= set(leaving)

    assert ch.to_squash(0.0, room) == []  # the host asks before each admission
    blocked, medium, slow = seq("R1", 5, 60), seq("R2", 5, 20), seq("R3", 5, 50)
    for s in (blocked, medium, slow):
        ch.add(s, 0.0)
    rec = Recorder({"R1": Admit.NO_ROOM})
    ch.admit(0.0, rec)
    assert rec.asked == ["R1", "R2"] and rec.admitted == ["R2"]
    assert ch.num_bypasses == 1


def test_the_starvation_guard_caps_how_often_one_request_is_overtaken():
    ch = chameleon([10_000], [], max_bypass=2)
    ch.add(seq("run", 5, 100), 0.0)
    ch.admit(0.0, Recorder())
    ch.add(seq("R1", 5, 40), 0.0)
    quick = {f"q{i}": seq(f"q{i}", 5, 1) for i in range(5)}
    for s in quick.values():
        ch.add(s, 0.0)
    for _ in range(3):
        rec = Recorder({"R1": Admit.NO_ROOM}, capacity=1)
        ch.admit(0.0, rec)
        for rid in rec.admitted:
            ch.left(quick[rid], 0.0, finished=True)
    assert ch.num_bypasses == 2
    assert [s.request_id for s in ch.waiting()][:2] == ["R1", "q2"]  # R1 now blocks its queue
    rec = Recorder({"R1": Admit.NO_ROOM})
    ch.admit(0.0, rec)
    assert rec.admitted == []


def test_requests_whose_adapter_is_loading_do_not_block_their_queue():
    ch = chameleon([1000], [])
    for rid in ("a", "b"):
        ch.add(seq(rid, 5, 5), 0.0)
    rec = Recorder({"a": Admit.LOADING})
    ch.admit(0.0, rec)
    assert rec.admitted == ["b"] and [s.request_id for s in ch.waiting()] == ["a"]


def test_refresh_clusters_arrivals_into_queues_and_splits_the_capacity():
    ch = two_rank_chameleon(ChameleonParams(refresh_s=10.0, min_samples=30, slo_s=5.0), 100_000)
    for i in range(20):
        ch.add(seq(f"s{i}", 20, 20, "r8"), i * 0.1)
        ch.add(seq(f"l{i}", 800, 150, "r64"), i * 0.1)
    ch.admit(2.0, Recorder(capacity=0))  # 40 arrivals >= min_samples: first clustering
    assert len(ch.cutoffs) == 1 and [len(q) for q in ch.queues] == [20, 20]
    assert {s.adapter for s in ch.queues[0]} == {"r8"}
    assert sum(ch.quotas) == 100_000
    assert ch.quotas[1] > ch.quotas[0]  # the large requests' token demand is larger


def test_a_request_that_waited_past_starve_s_goes_first_over_quota():
    ch = chameleon([20, 100], [0.2], starve_s=10.0)
    ch.add(seq("L-old", 50, 50), 0.0)
    ch.admit(0.0, Recorder(capacity=0))
    ch.used[1] = 100  # the large queue's quota is taken by running requests
    for i in range(3):
        ch.add(seq(f"s{i}", 5, 5), 11.0)
    rec = Recorder(capacity=1)  # one batch slot left
    ch.admit(11.0, rec)
    assert rec.admitted == ["L-old"] and ch.num_starving == 1


def test_waiting_lists_requests_in_the_order_admission_takes_them():
    # queue 0 (10-token requests) has 30 tokens of quota, queue 1 (100-token ones) 100:
    # admission takes s0-s2 and L0, then, as quota returns, a request per queue in turn.
    ch = chameleon([30, 100], [0.2])
    for i in range(5):
        ch.add(seq(f"s{i}", 5, 5), 0.0)
    for i in range(2):
        ch.add(seq(f"L{i}", 50, 50), 0.0)
    order = [s.request_id for s in ch.waiting()]
    assert order == ["s0", "s1", "s2", "L0", "s3", "L1", "s4"]
    rec = Recorder()
    ch.admit(0.0, rec)  # the oracle: what admission itself takes first
    assert rec.admitted == order[:4]


def test_the_queue_left_empty_gives_its_quota_to_the_next_in_waiting_order():
    ch = chameleon([30, 100], [0.2])
    for i in range(5):
        ch.add(seq(f"s{i}", 5, 5), 0.0)
    order = [s.request_id for s in ch.waiting()]
    rec = Recorder()
    ch.admit(0.0, rec)
    assert order == rec.admitted == ["s0", "s1", "s2", "s3", "s4"]  # phase 2: the spare


def test_wrs_normalises_by_the_workloads_largest_input_and_output():
    # seed 004 §4.3.1: in / MaxInputSize and out / MaxOutputSize. "p" requests: 1000 in,
    # 20 out; "o" requests: 100 in, 400 out. By the workload's maxima (1000, 400):
    # p = 0.4 + 0.6·0.05 = 0.43, o = 0.04 + 0.6 = 0.64 — "o" is the larger. By max_len
    # (4096) for both, "p" would be: 0.0977 + 0.0029 against 0.0098 + 0.0586.
    ch = Chameleon(
        ChameleonParams(refresh_s=1e9, min_samples=10**6),
        OutputPredictor(min_samples=1),
        max_len=4096,
        capacity=lambda: 10**6,
        adapter_bytes=lambda name: 1,
        adapter_tokens=lambda name: 0,
        max_adapter_bytes=lambda: 1,
    )
    kinds = (("p", 1000, 20), ("o", 100, 400))
    for i in range(8):
        for name, prompt, out in kinds:
            ch.add(seq(f"{name}{i}", prompt, out, name), 0.0)
    ch.admit(0.0, Recorder())
    for s in list(ch.running):
        s.output_ids = [1] * s.params.max_tokens
        ch.left(s, 1.0, finished=True)
    for i in range(8, 12):
        for name, prompt, out in kinds:
            ch.add(seq(f"{name}{i}", prompt, out, name), 2.0)
    ch.refresh(2.0)
    assert len(ch.cutoffs) == 1
    assert [{s.adapter for s in q} for q in ch.queues] == [{"p"}, {"o"}]
    assert (ch.max_in, ch.max_out) == (1000, 400)


def test_the_starvation_guard_is_off_unless_set():
    # not in the paper: by default a request that waited past the SLO gets no precedence
    assert ChameleonParams().starve_s is None
    ch = chameleon([20, 100], [0.2])
    ch.add(seq("L-old", 50, 50), 0.0)
    ch.admit(0.0, Recorder(capacity=0))
    ch.used[1] = 100  # the large queue's quota is taken by running requests
    for i in range(3):
        ch.add(seq(f"s{i}", 5, 5), 3 * CHAMELEON.slo_s)
    rec = Recorder(capacity=1)
    ch.admit(3 * CHAMELEON.slo_s, rec)
    assert rec.admitted == ["s0"] and ch.num_starving == 0
