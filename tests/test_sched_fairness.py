"""Fair admission across tenants (replica/scheduling/fairness.py) on hand-built cases with a
fake clock: a flooding tenant does not delay another tenant's request; idle time is no
credit; generated tokens count twice a prompt token (VTC's weights); and within each tenant
the requests are admitted exactly as that tenant's own policy (FIFO, SJF, Chameleon) admits
them given the same slots, the policy alone being the oracle. Then the real engine: a
request of a second tenant overtakes a queued flood and gets the offline engine's tokens."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from loraplex.demo.assets import DemoAssets
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.chameleon import Chameleon, ChameleonParams
from loraplex.replica.scheduling.fairness import TenantFair
from loraplex.replica.scheduling.policy import FIFO, Admit, QueuePolicy, SJFAging
from loraplex.replica.scheduling.queue_math import OutputPredictor
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.replica.sequence import SeqStatus, Sequence


def seq(rid: str, tenant: str | None, prompt: int = 8, max_tokens: int = 8, adapter=None):
    s = Sequence(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), adapter, 0.0, None)
    s.tenant = tenant
    return s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


class Steps:
    """A batch of `slots` admissions per step (FULL past them), with per-request answers
    (default OK); records what each step admitted, and marks admitted requests running."""

    def __init__(self, slots: int, answers: dict[str, Admit] | None = None) -> None:
        self.slots = slots
        self.answers = answers or {}
        self.steps: list[list[str]] = []

    def run(self, policy: QueuePolicy, now: float) -> list[str]:
        admitted: list[str] = []

        def try_admit(s: Sequence) -> Admit:
            if len(admitted) >= self.slots:
                return Admit.FULL
            answer = self.answers.get(s.request_id, Admit.OK)
            if answer is Admit.OK:
                admitted.append(s.request_id)
                s.status = SeqStatus.RUNNING
            return answer

        policy.admit(now, try_admit)
        self.steps.append(admitted)
        return admitted

    @property
    def order(self) -> list[str]:
        return [rid for step in self.steps for rid in step]


def fifo() -> QueuePolicy:
    return FIFO()


def test_a_queued_flood_does_not_delay_another_tenants_request():
    clock = Clock()
    fair, plain = TenantFair(fifo), FIFO()
    flood = [seq(f"a{i}", "a") for i in range(50)]
    for s in flood:
        fair.add(s, clock.now)
    plain_flood = [seq(f"a{i}", "a") for i in range(50)]
    for s in plain_flood:
        plain.add(s, clock.now)
    fair_steps, plain_steps = Steps(slots=4), Steps(slots=4)
    fair_steps.run(fair, clock.tick())
    plain_steps.run(plain, clock.now)
    b, plain_b = seq("b0", "b"), seq("b0", "b")
    fair.add(b, clock.now)
    plain.add(plain_b, clock.now)
    admitted = fair_steps.run(fair, clock.tick())
    # b's counter is lifted to a's (no credit for arriving late, none owed either): a takes
    # the tie, then b, whose prompt then weighs as much as each of a's
    assert admitted == ["a4", "b0", "a5", "a6"]
    # FIFO alone serves b after the whole flood: 12 more steps of 4
    for _ in range(13):
        plain_steps.run(plain, clock.tick())
    assert plain_steps.order.index("b0") == 50


def test_idle_time_is_no_credit_and_turns_follow_the_tokens_served():
    clock = Clock()
    fair = TenantFair(fifo)
    steps = Steps(slots=100)
    for i in range(10):  # a is served alone for a while: 10 requests x 8 prompt tokens
        fair.add(seq(f"early{i}", "a"), clock.now)
    steps.run(fair, clock.tick())
    assert fair.counters["a"] == 80
    for i in range(6):
        fair.add(seq(f"a{i}", "a"), clock.now)
    for i in range(6):
        fair.add(seq(f"b{i}", "b"), clock.now)
    assert fair.counters["b"] == 80  # lifted to a's: b's idle past buys it nothing
    admitted = Steps(slots=8).run(fair, clock.tick())
    assert admitted == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    # a request of b twice as large costs b two of a's turns
    fair2 = TenantFair(fifo)
    fair2.add(seq("big", "b", prompt=16), 0.0)
    fair2.add(seq("b-next", "b", prompt=8), 0.0)
    for i in range(4):
        fair2.add(seq(f"a{i}", "a", prompt=8), 0.0)
    assert Steps(slots=6).run(fair2, 1.0) == ["big", "a0", "a1", "b-next", "a2", "a3"]


def test_generated_tokens_count_double_a_prompt_token():
    fair = TenantFair(fifo)
    long_gen = seq("a-long", "a", prompt=4)
    fair.add(long_gen, 0.0)
    Steps(slots=1).run(fair, 1.0)  # a: 4
    for i in range(3):
        fair.add(seq(f"a{i}", "a", prompt=4), 1.0)
        fair.add(seq(f"b{i}", "b", prompt=4), 1.0)  # b lifted to 4
    long_gen.output_ids = [7] * 10  # 10 tokens generated: a at 4 + 2 x 10 = 24
    assert Steps(slots=6).run(fair, 2.0) == ["b0", "b1", "b2", "a0", "a1", "a2"]
    assert fair.counters == {"a": 24 + 12, "b": 4 + 12}
    long_gen.output_ids = [7] * 12
    fair.left(long_gen, 3.0, finished=True)  # the last 2 tokens are charged as it ends
    assert fair.counters["a"] == 40


def test_a_preempted_request_is_not_charged_again_and_keeps_its_place():
    fair = TenantFair(fifo)
    first = seq("a0", "a", prompt=10)
    fair.add(first, 0.0)
    fair.add(seq("a1", "a", prompt=10), 0.0)
    Steps(slots=1).run(fair, 1.0)
    assert fair.counters["a"] == 10
    first.status = SeqStatus.WAITING  # as Scheduler.preempt leaves it
    fair.left(first, 2.0, finished=False)
    fair.requeue(first, 2.0)
    assert [s.request_id for s in fair.waiting()] == ["a0", "a1"]
    assert Steps(slots=1).run(fair, 3.0) == ["a0"] and fair.counters["a"] == 10
    first.status = SeqStatus.RUNNING
    fair.left(first, 4.0, finished=False)  # aborted while running: forgotten
    assert first not in fair._charged


def preempt(fair: TenantFair, victims: list[Sequence], now: float) -> None:
    """What Scheduler.preempt does to the policy."""
    for s in victims:
        s.status = SeqStatus.WAITING
        fair.left(s, now, finished=False)
        fair.requeue(s, now)


def decode(seqs: list[Sequence]) -> None:
    """A step of the running requests: one token each."""
    for s in seqs:
        if s.status is SeqStatus.RUNNING:
            s.output_ids.append(5)
            s.num_computed += 1


def test_a_full_batch_gives_slots_back_to_a_tenant_under_its_share():
    """Four slots, all taken by a's long requests: b's request gets one of them back at the
    next step (the a request least computed, the latest on a tie), b's second request
    another, and b never more than its share (2 of 4); a alone keeps all four."""
    fair = TenantFair(fifo, slots=4)
    flood = [seq(f"a{i}", "a") for i in range(20)]
    for s in flood:
        fair.add(s, 0.0)
    assert Steps(slots=4).run(fair, 1.0) == ["a0", "a1", "a2", "a3"]
    for s, computed in zip(flood[:4], (12, 9, 9, 11), strict=True):
        s.num_computed, s.output_ids = computed, [5] * (computed - 8)
    assert fair.to_squash(2.0, lambda s, leaving: True) == [], "a alone keeps the batch"
    fair.add(seq("b0", "b"), 2.0)
    decode(flood)
    victims = fair.to_squash(3.0, lambda s, leaving: True)
    assert victims == [flood[2]]
    preempt(fair, victims, 3.0)
    assert Steps(slots=1).run(fair, 3.0) == ["b0"]
    for i in (1, 2):
        fair.add(seq(f"b{i}", "b"), 4.0)
    decode(flood)
    victims = fair.to_squash(4.0, lambda s, leaving: True)
    assert victims == [flood[1]]
    preempt(fair, victims, 4.0)
    assert Steps(slots=1).run(fair, 4.0) == ["b1"]
    decode(flood)
    assert fair.to_squash(5.0, lambda s, leaving: True) == [], "b holds its share: 2 of 4"
    assert [s.request_id for s in fair.waiting()][:3] == ["b2", "a1", "a2"]


def test_no_slot_is_given_back_to_a_tenant_served_more_or_without_room():
    """b was served 1000 tokens before a's flood: its counter stays above a's, so a's turn
    comes first and nothing is preempted for b. Once a's counter passes b's, a slot is given
    back only if b's request then fits (`room`)."""
    fair = TenantFair(fifo, slots=2)
    big = seq("b-big", "b", prompt=1000)
    fair.add(big, 0.0)
    Steps(slots=1).run(fair, 0.0)
    big.status = SeqStatus.FINISHED
    fair.left(big, 1.0, finished=True)
    flood = [seq(f"a{i}", "a") for i in range(6)]
    for s in flood:
        fair.add(s, 1.0)
    assert Steps(slots=2).run(fair, 1.0) == ["a0", "a1"]
    fair.add(seq("b0", "b"), 2.0)
    assert fair.counters == {"a": 16, "b": 1000}
    assert fair.to_squash(2.0, lambda s, leaving: True) == []
    flood[0].output_ids = [1] * 500  # a: 16 + 2 x 500, past b
    assert fair.to_squash(3.0, lambda s, leaving: False) == [], "b would not fit even so"
    assert fair.to_squash(3.0, lambda s, leaving: True) == [flood[1]]


def test_waiting_merges_the_tenants_as_admission_would():
    fair = TenantFair(fifo)
    for i in range(3):
        fair.add(seq(f"a{i}", "a"), 0.0)
    for i in range(2):
        fair.add(seq(f"b{i}", "b"), 0.0)
    assert [s.request_id for s in fair.waiting()] == ["a0", "b0", "a1", "b1", "a2"]
    assert len(fair) == 5
    fair.remove(fair.waiting()[1])
    assert [s.request_id for s in fair.waiting()] == ["a0", "b1", "a1", "a2"]


# -- within a tenant: the policy's own order -----------------------------------------------


def chameleon_policy() -> QueuePolicy:
    return Chameleon(
        ChameleonParams(min_samples=8, refresh_s=5.0, slo_s=4.0, max_bypass=2),
        OutputPredictor(),
        max_len=256,
        capacity=lambda: 400,
        adapter_bytes=lambda name: {None: 1, "big": 8, "small": 2}[name],
        adapter_tokens=lambda name: {None: 0, "big": 32, "small": 8}[name],
        max_adapter_bytes=lambda: 8,
    )


def sjf_policy() -> QueuePolicy:
    return SJFAging(OutputPredictor(), aging_tokens_per_s=4.0)


POLICIES: dict[str, Callable[[], QueuePolicy]] = {
    "fifo": fifo,
    "sjf": sjf_policy,
    "chameleon": chameleon_policy,
}


def workload(tenant: str, n: int, seed: int) -> list[tuple[float, Sequence]]:
    """(arrival time, request): sizes, outputs and adapters varied, arrivals spread."""
    rng = itertools.count(seed)
    out = []
    for i in range(n):
        k = next(rng)
        adapter = [None, "big", "small"][k % 3]
        s = seq(f"{tenant}{i}", tenant, prompt=4 + (k * 7) % 60, max_tokens=2 + (k * 13) % 90)
        s.adapter = adapter
        out.append((0.25 * (i // 4), s))
    return out


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_tenant_is_admitted_in_its_own_policys_order(name: str):
    """Two tenants (one offering 3x the other) through the fair policy, with some requests
    refused for a while (adapter loading, no room); then each tenant's requests replayed
    through its policy alone, given in each step the slots it got: the same admissions, in
    the same order. Running requests finish after 2 steps, generating tokens."""
    make = POLICIES[name]
    arrivals = sorted(workload("a", 36, 1) + workload("b", 12, 5), key=lambda x: x[0])
    refused = {"a3": Admit.LOADING, "a7": Admit.NO_ROOM, "b2": Admit.ADAPTER_CAP}

    def drive(policy: QueuePolicy, requests, slots: list[int]) -> list[list[str]]:
        """Steps of the run: arrivals due are added, running requests that have run 2 steps
        leave (finished), then the step admits within its slots (none past the list)."""
        clock, pending, running = Clock(), list(requests), {}
        steps: list[list[str]] = []
        by_id = {s.request_id: s for _, s in requests}
        for step in range(200):
            now = clock.tick(0.1)
            while pending and pending[0][0] <= now:
                policy.add(pending.pop(0)[1], now)
            for rid, started in list(running.items()):
                if step - started >= 2:
                    s = by_id[rid]
                    s.output_ids = [3] * 5
                    policy.left(s, now, finished=True)
                    s.status = SeqStatus.FINISHED
                    del running[rid]
            answers = {k: v for k, v in refused.items() if step < 6}
            taken = Steps(slots[step] if step < len(slots) else 0, answers)
            admitted = taken.run(policy, now)
            running.update((rid, step) for rid in admitted)
            steps.append(admitted)
            if not pending and not len(policy) and not running:
                break
        return steps

    fair_steps = drive(TenantFair(make), arrivals, [3] * 200)
    assert sum(map(len, fair_steps)) == 48, "every request admitted"
    for tenant in ("a", "b"):
        own = [[rid for rid in step if rid.startswith(tenant)] for step in fair_steps]
        alone = [(t, seq_copy(s)) for t, s in arrivals if s.tenant == tenant]
        replay = drive(make(), alone, [len(step) for step in own])
        assert [r for step in replay for r in step] == [r for step in own for r in step], tenant
        assert replay == own[: len(replay)], tenant


def seq_copy(s: Sequence) -> Sequence:
    copy = seq(s.request_id, s.tenant, len(s.prompt_ids), s.params.max_tokens, s.adapter)
    return copy


# -- the real engine --------------------------------------------------------------------------

PAGE = 64 * 1024


@pytest.mark.parametrize("fair", [True, False])
def test_engine_serves_a_second_tenant_ahead_of_a_queued_flood(assets: DemoAssets, fair: bool):
    """12 requests of tenant a, then one of tenant b; two batch slots, both running a's. With
    fairness b's request starts at the next step: a holds more than its share (1 of 2) and
    gives back a1, which is recomputed after b0; without, b0 starts after a's whole flood.
    Every request's tokens are the offline engine's, unchanged by the order or by the
    preemption (greedy)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(assets.model),
            page_bytes=PAGE,
            pool_bytes=256 * PAGE,
            scheduler=SchedulerConfig(max_num_seqs=2, tenant_fairness=fair),
        )
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(12):
        engine.add_request(list(range(4 + i, 20 + i)), params, request_id=f"a{i}", tenant="a")
    engine.step()  # a0 and a1 run
    engine.add_request(list(range(40, 56)), params, request_id="b0", tenant="b")
    first_token: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    for step in itertools.count():
        if not engine.has_unfinished():
            break
        for out in engine.step():
            first_token.setdefault(out.request_id, step)
            if out.finished:
                tokens[out.request_id] = out.token_ids
    overtaken = sum(first_token[f"a{i}"] > first_token["b0"] for i in range(12))
    assert overtaken == (11 if fair else 0)
    if fair:
        assert first_token["b0"] == 0 and engine.scheduler.num_squashes == 1
    prompts = {f"a{i}": list(range(4 + i, 20 + i)) for i in range(12)} | {"b0": list(range(40, 56))}
    offline = LLMEngine(EngineConfig(model=str(assets.model), page_bytes=PAGE))
    want = offline.generate(list(prompts.values()), [params] * len(prompts), [None] * len(prompts))
    assert [tokens[rid] for rid in prompts] == [w.token_ids for w in want]
