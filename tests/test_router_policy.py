"""The adapter-affinity replica-selection policy, driven with fake replicas and a fake clock."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from loraplex.replica.protocol import extend_block_keys, prefix_root
from loraplex.router.policy import (
    Affinity,
    AffinityConfig,
    AffinityPolicy,
    Placement,
    ReplicaStats,
    batch_slots,
)
from loraplex.router.walk import walk_order


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def replica(
    replica_id: str,
    device=(),
    host=(),
    loading=(),
    queue: int = 0,
    slots: int = 32,
    pages: int = 0,
    age_s: float = 0.0,
) -> ReplicaStats:
    return ReplicaStats(
        replica_id,
        frozenset(device),
        frozenset(host),
        frozenset(loading),
        queue_len=queue,
        max_concurrency=slots,
        free_pages=pages,
        stats_age_s=age_s,
    )


def idle(n: int, slots: int = 32) -> list[ReplicaStats]:
    return [replica(f"r{i}", slots=slots) for i in range(n)]


def policy(clock: FakeClock | None = None, **config) -> AffinityPolicy:
    return AffinityPolicy(AffinityConfig(**config), clock=clock or FakeClock())


def test_device_then_host_or_loading_then_cold():
    replicas = [
        replica("cold"),
        replica("host", host={"a"}),
        replica("loading", loading={"a"}),
        replica("device", device={"a"}),
    ]
    ranked = policy().choose("a", replicas)
    assert ranked[0] == "device"
    assert set(ranked[1:3]) == {"host", "loading"}
    assert ranked[3] == "cold"


def test_affinity_wins_while_slots_are_free():
    replicas = [
        replica("device", device={"a"}, queue=30),
        replica("host", host={"a"}),
        replica("x"),
    ]
    assert policy().choose("a", replicas) == ["device", "host", "x"]


def test_cold_adapter_has_one_home():
    replicas = idle(5)
    homes = {policy().choose(f"a{i}", replicas)[0] for i in range(50)}
    for i in range(50):
        first = policy(seed=7).choose(f"a{i}", replicas)[0]
        assert first == policy().choose(f"a{i}", list(reversed(replicas)))[0]
        assert first == walk_order(f"a{i}", [r.replica_id for r in replicas])[0]
    assert len(homes) == 5


@pytest.mark.parametrize("n", [4, 8])
def test_membership_change_moves_about_one_nth(n):
    adapters = [f"tenant{i % 37}/adapter{i}" for i in range(1000)]

    def homes(replicas):
        p = policy()
        return {a: p.choose(a, replicas)[0] for a in adapters}

    before = homes(idle(n))
    counts = [list(before.values()).count(f"r{i}") for i in range(n)]
    assert min(counts) > 0.6 * 1000 / n and max(counts) < 1.4 * 1000 / n

    removed = homes(idle(n)[1:])
    moved = [a for a in adapters if removed[a] != before[a]]
    assert all(before[a] == "r0" for a in moved)  # only the removed replica's adapters move
    assert len(moved) / len(adapters) < 2 / n

    added = homes([*idle(n), replica("new")])
    moved = [a for a in adapters if added[a] != before[a]]
    assert all(added[a] == "new" for a in moved)
    assert abs(len(moved) / len(adapters) - 1 / (n + 1)) < 0.5 / (n + 1)


def test_overloaded_home_sends_a_cold_request_down_the_walk():
    replicas = idle(5, slots=8)
    walk = policy().choose("a", replicas)
    loaded = {walk[0]: 20, walk[1]: 20}  # capacity = ceil(1.25 * 41 / 5) = 11; batches full
    replicas = [replica(r.replica_id, queue=loaded.get(r.replica_id, 0), slots=8) for r in replicas]
    assert policy().choose("a", replicas)[:3] == [walk[2], walk[3], walk[4]]


def test_a_home_with_a_free_batch_slot_keeps_its_cold_adapter():
    # Above the mean-based capacity, but a slot is free: continuous batching admits the
    # request at the next step, so it goes home rather than loading the adapter elsewhere.
    replicas = idle(5, slots=32)
    walk = policy().choose("a", replicas)
    loaded = {walk[0]: 20}  # capacity = ceil(1.25 * 21 / 5) = 6 < 20 < 32 slots
    replicas = [replica(r.replica_id, queue=loaded.get(r.replica_id, 0)) for r in replicas]
    assert policy().choose("a", replicas)[0] == walk[0]
    full = [replica(r.replica_id, queue=40 if r.replica_id == walk[0] else 0) for r in replicas]
    assert policy().choose("a", full)[0] != walk[0]  # no free slot: the bound applies


def test_bounded_load_holds_under_a_stream_of_cold_requests():
    # Zipf-popular adapters that stay cold, on replicas with one batch slot each (so the
    # bound, not a free slot, decides): without the bound, every request of the most
    # popular one would pile onto its home.
    c = 1.25
    p = policy(bounded_load_c=c)
    rng = random.Random(0)
    names = [f"adapter{i}" for i in range(20)]
    weights = [1 / (rank + 1) ** 1.2 for rank in range(len(names))]
    queues = {f"r{i}": 0 for i in range(6)}
    for adapter in rng.choices(names, weights, k=3000):
        replicas = [replica(rid, queue=q, slots=1) for rid, q in queues.items()]
        queues[p.choose(adapter, replicas)[0]] += 1
        mean = sum(queues.values()) / len(queues)
        assert max(queues.values()) <= c * (mean + 1)
        assert max(queues.values()) <= math.ceil(c * mean - 1e-9)  # Mirrokni et al.'s bound


@pytest.mark.parametrize("host", [(), ("a",)], ids=["cold", "host-tier-everywhere"])
def test_crowded_home_sends_a_new_adapter_to_the_next_uncrowded_replica(host):
    # Replicas syncing the registry hold every adapter in their host tier: that makes a
    # load cheaper, not the replica warm, so the bounds place the adapter all the same.
    walk = policy().choose("a", idle(3))
    held = {walk[0]: 10, walk[1]: 6, walk[2]: 2}  # share = ceil(1.1 * 19 / 3) = 7
    replicas = [
        replica(rid, device={f"{rid}-{i}" for i in range(count)}, host=host)
        for rid, count in held.items()
    ]
    assert policy().choose("a", replicas) == [walk[1], walk[2], walk[0]]
    # TTFT first: when the uncrowded replicas have no free slot, the crowded home takes it.
    busy = [replace(r, max_concurrency=4) for r in replicas]
    busy = [b if b.replica_id == walk[0] else replace(b, queue_len=8) for b in busy]
    assert policy().choose("a", busy)[0] == walk[0]


def test_a_replica_whose_adapters_draw_most_traffic_takes_no_new_one():
    clock = FakeClock()
    p = policy(clock)
    walk = walk_order("new", ["r0", "r1", "r2"])
    popular = {walk[0]: {"top"}, walk[1]: {"x"}, walk[2]: {"y"}}  # one adapter each
    for _ in range(60):
        p.observe("top")  # rate 6/s against 1/s: over 1.25 x the mean of 8/3
    for other in ("x", "y"):
        for _ in range(10):
            p.observe(other)
    replicas = [replica(rid, device=held) for rid, held in popular.items()]
    assert p.choose("new", replicas)[0] == walk[1]
    clock.advance(120.0)  # rates decay together: ties again, the walk decides
    for adapter in ("top", "x", "y"):
        p.observe(adapter)
    assert p.choose("new", replicas)[0] == walk[0]


def test_cold_adapters_spread_by_count_even_before_stats_show_them():
    # Stats a period old show no adapter anywhere: the router's own placements since then
    # count, so a burst of new adapters is shared out instead of following the hash alone.
    clock = FakeClock()
    clock.advance(100.0)
    p = policy(clock)
    counts = {f"r{i}": 0 for i in range(3)}
    for i in range(30):
        clock.advance(0.01)
        stale = [replica(rid, age_s=clock.now - 100.0) for rid in counts]  # recorded at 100 s
        chosen = p.choose(f"a{i}", stale)[0]
        p.observe(f"a{i}", chosen)
        counts[chosen] += 1
    share = math.ceil(1.1 * 31 / 3)
    assert max(counts.values()) <= share
    hash_only = {rid: 0 for rid in counts}
    for i in range(30):
        hash_only[walk_order(f"a{i}", list(counts))[0]] += 1
    assert max(hash_only.values()) > share  # the hash alone would crowd one replica

    # A request of an adapter just sent elsewhere follows it there (it is loading there).
    home = next(rid for rid in counts if rid != walk_order("a0", list(counts))[0])
    clock.advance(0.01)
    p.observe("new", home)
    stale = [replica(rid, age_s=clock.now - 100.0) for rid in counts]
    assert p.choose("new", stale)[0] == home
    # Stats recorded after the placement replace it: fresh stats without it, no pull.
    fresh = [replica(rid) for rid in counts]
    assert p.choose("new", fresh)[0] == walk_order("new", list(counts))[0]


@pytest.mark.parametrize(
    ("queue", "chosen"), [(4, "warm"), (11, "warm"), (12, "idle"), (40, "idle")]
)
def test_busy_warm_replica_loses_to_idle_one_beyond_load_cost(queue, chosen):
    # wait = (queue + 1 - 4) / 4 * 1 s: 0.25 s at 4, 2.0 s = load cost at 11 (a tie goes to
    # affinity), 2.25 s at 12
    replicas = [replica("warm", device={"a"}, queue=queue, slots=4), replica("idle", slots=4)]
    p = policy(load_cost_s=2.0, request_time_s=1.0)
    assert p.choose("a", replicas)[0] == chosen


@pytest.mark.parametrize(
    ("queue", "running", "for_pages", "chosen"),
    [(12, 8, 0, "warm"), (12, 8, 4, "warm"), (20, 8, 12, "idle"), (20, None, 0, "warm")],
)
def test_a_batch_whose_kv_pages_fill_first_is_full_at_the_rows_it_runs(
    queue, running, for_pages, chosen
):
    # 16 slots drained at 16 / 4 s = 4 a second; a read costs 2 s. A home running 8 rows
    # while 12 wait for pages has 13 requests ahead of a new one: 3.25 s, so the idle
    # replica serves sooner. Priced by its slots it would have 5 ahead (1.25 s) and keep the
    # adapter. 4 waiting (5 ahead, 1.25 s), or nothing waiting (a free row), or a replica
    # that publishes no batch rows keeps it.
    warm = replace(
        replica("warm", device={"a"}, queue=queue, slots=16),
        running=running,
        waiting_for_pages=for_pages,
    )
    p = policy(load_cost_s=2.0, request_time_s=4.0)
    assert p.choose("a", [warm, replica("idle", slots=16)])[0] == chosen


@pytest.mark.parametrize(
    ("queued_tokens", "budget", "chosen"),
    [(0, 4096, "warm"), (4096, 4096, "warm"), (6000, 0, "warm"), (6000, 4096, "idle")],
)
def test_requests_waiting_within_one_step_s_budget_leave_a_home_its_slots(
    queued_tokens, budget, chosen
):
    # The same home as above, running 8 rows with 12 more held, but held by the step's token
    # budget (a burst of prompts admitted a chunk at a time) or between two steps, its pool
    # with room. Within one step's budget they start in a step or two, so the home is priced
    # by its 16 slots (5 ahead, 1.25 s < the 2 s read) and keeps its adapter: counting every
    # held request as a full batch moved warm requests off such homes (zipf's reference reads
    # 41 -> 57.5). More than one step's budget queued (a replica that publishes its budget)
    # is a backlog a new request waits behind: full at its 8 rows, 13 ahead, 3.25 s.
    warm = replace(
        replica("warm", device={"a"}, queue=20, slots=16),
        running=8,
        waiting_for_pages=0,
        queued_prefill_tokens=queued_tokens,
        step_token_budget=budget,
    )
    p = policy(load_cost_s=2.0, request_time_s=4.0)
    assert p.choose("a", [warm, replica("idle", slots=16)])[0] == chosen


@pytest.mark.parametrize(
    ("in_batch", "cap", "chosen"),
    [
        ({"x", "y"}, 0, "warm"),
        ({"x", "y"}, 3, "warm"),
        ({"x", "y", "z"}, 3, "idle"),
        ({"a", "y", "z"}, 3, "warm"),
    ],
)
def test_a_batch_at_its_adapter_cap_is_full_for_another_adapter(in_batch, cap, chosen):
    # The autoscaled day, seed 27: two replicas ran 32 adapters (max_loras_per_batch) in
    # 39-40 of 64 rows, and the requests of other adapters waited there 0.41-0.65 s median
    # where the free rows priced them at 22 ms. Here the home holds `a` on the device and
    # runs 8 rows of 16 with 12 requests held: by its free rows it keeps `a` (5 ahead,
    # 1.25 s < the 2 s read); with its batch at the cap of adapters that are not `a`, a
    # request of `a` waits for a row of theirs to leave: 13 ahead, 3.25 s, so the idle
    # replica serves sooner. A batch under its cap, no cap published, or `a` already in the
    # batch: the free rows stand.
    warm = replace(
        replica("warm", device={"a"}, queue=20, slots=16),
        running=8,
        batch_adapters=frozenset(in_batch),
        max_loras_per_batch=cap,
    )
    p = policy(load_cost_s=2.0, request_time_s=4.0)
    assert p.choose("a", [warm, replica("idle", slots=16)])[0] == chosen
    # the base model's requests take no adapter slot: the cap never holds them
    assert batch_slots(warm) == 16


def test_a_cold_adapter_skips_a_home_whose_kv_pages_are_full():
    # 20 held in 32 slots, above the bound (capacity ceil(1.25 * 21 / 5) = 6) but with free
    # slots, so the home keeps a cold adapter; the same home running 12 rows with 8 held back
    # for pages has no free row: the bound applies and the adapter goes down its walk. With
    # the 8 held back by the step's budget instead, it keeps its free slots and the adapter.
    replicas = idle(5, slots=32)
    walk = policy().choose("a", replicas)
    free = [replica(r.replica_id, queue=20 if r.replica_id == walk[0] else 0) for r in replicas]
    assert policy().choose("a", free)[0] == walk[0]
    budget = [replace(r, running=12) if r.replica_id == walk[0] else r for r in free]
    assert policy().choose("a", budget)[0] == walk[0]
    full = [replace(r, waiting_for_pages=8) if r.replica_id == walk[0] else r for r in budget]
    assert policy().choose("a", full)[0] == walk[1]


@pytest.mark.parametrize(("queue", "chosen"), [(0, "warm"), (5, "warm"), (6, "idle")])
def test_busy_cost_moves_a_request_before_the_batch_is_full(queue, chosen):
    # 32 free slots, but each request there adds 10 ms: warm costs queue * 10 ms, the idle
    # replica a 50 ms load; 5 requests tie (affinity keeps it), 6 lose.
    replicas = [replica("warm", device={"a"}, queue=queue), replica("idle")]
    p = policy(load_cost_s=0.05, host_load_cost_s=0.0, busy_cost_s=0.01)
    assert p.choose("a", replicas)[0] == chosen
    assert policy(load_cost_s=0.05).choose("a", replicas)[0] == "warm"  # batching is free


@pytest.mark.parametrize(("tokens", "chosen"), [(0, "warm"), (4_000, "warm"), (6_000, "idle")])
def test_prompt_tokens_a_replica_has_yet_to_prefill_are_part_of_its_wait(tokens, chosen):
    # Free slots on both, batching free: only the warm replica's queued prompts differ,
    # 0.1 ms a token: 0.4 s of prefills lose to nothing against the idle one's 0.5 s load,
    # 0.6 s win it the request
    warm = replace(replica("warm", device={"a"}), queued_prefill_tokens=tokens)
    p = policy(load_cost_s=0.5, host_load_cost_s=0.0, prefill_token_cost_s=1e-4)
    assert p.choose("a", [warm, replica("idle")])[0] == chosen
    # a base-model request waits behind them too: the emptier replica by its prefills
    short = replace(replica("short", queue=1), queued_prefill_tokens=tokens)
    expected = "short" if tokens == 0 else "long"
    assert p.choose(None, [short, replica("long", queue=2)])[0] == expected


@pytest.mark.parametrize("adapter", ["a", None])
def test_a_burst_between_two_stats_pushes_is_shared_by_the_prompts_sent_since(adapter):
    # Both replicas hold "a" with free slots, batching free: only their prompt backlogs
    # differ, and the stats showing them are a period old. The caller's queue lengths follow
    # its own sends (Serve's cache), the published prefill backlog does not: each replica's
    # wait must count the prompts this router sent it since, or the whole burst goes to r0.
    clock = FakeClock()
    clock.advance(10.0)
    p = policy(clock, load_cost_s=0.5, host_load_cost_s=0.0, prefill_token_cost_s=1e-4)
    published = {"r0": 0, "r1": 2_000}
    queue = {"r0": 0, "r1": 0}
    sent = {"r0": 0, "r1": 0}
    for _ in range(12):
        clock.advance(0.01)
        views = [
            replace(
                replica(rid, device={"a"}, queue=queue[rid], age_s=clock.now - 10.0),
                queued_prefill_tokens=published[rid],
            )
            for rid in published
        ]
        chosen = p.choose(adapter, views)[0]
        p.observe(adapter, chosen, prompt_tokens=1_000)
        queue[chosen] += 1
        sent[chosen] += 1
    # 12,000 tokens sent over 2,000 published: 7,000 each when balanced, within one prompt
    backlog = {rid: published[rid] + 1_000 * sent[rid] for rid in published}
    assert abs(backlog["r0"] - backlog["r1"]) <= 1_000, sent

    # Stats recorded after the burst include it: the sends no longer count, so a replica
    # that has prefilled its share meanwhile is the emptier one again.
    clock.advance(0.01)
    fresh = [
        replace(replica("r0", device={"a"}, queue=queue["r0"]), queued_prefill_tokens=0),
        replace(replica("r1", device={"a"}, queue=queue["r1"]), queued_prefill_tokens=3_000),
    ]
    assert p.choose(adapter, fresh)[0] == "r0"


@pytest.mark.parametrize(("age_s", "chosen"), [(0.0, "idle"), (0.05, "idle"), (0.2, "warm")])
def test_a_published_prefill_backlog_drains_at_the_prefill_rate_as_the_stats_age(age_s, chosen):
    # 6,000 tokens at 0.1 ms: 0.6 s of prefill when recorded, against the idle replica's 0.5 s
    # load. The replica has prefilled since: 0.55 s are left after 50 ms (still dearer), 0.4 s
    # after 200 ms, and the adapter stays where it is warm.
    warm = replace(replica("warm", device={"a"}, age_s=age_s), queued_prefill_tokens=6_000)
    p = policy(load_cost_s=0.5, host_load_cost_s=0.0, prefill_token_cost_s=1e-4)
    assert p.choose("a", [warm, replica("idle")])[0] == chosen


def test_measured_costs_replace_the_configured_ones_pooled_over_replicas():
    # Configured: batching is free and a host load costs 50 ms, so the warm replica keeps
    # every request. Measured: 10 ms per running request, so 6 running (60 ms) lose to an
    # idle replica's 50 ms host load; a measured 70 ms host load tips it back.
    p = policy(load_cost_s=0.5, host_load_cost_s=0.05)
    warm = replica("warm", device={"a"}, queue=6)
    idle = replica("idle", host={"a"})
    assert p.choose("a", [warm, idle])[0] == "warm"
    measured = replace(warm, busy_cost_s=0.01)
    assert p.choose("a", [measured, idle])[0] == "idle"
    assert p.choose("a", [measured, replace(idle, host_load_cost_s=0.07)])[0] == "warm"
    ignoring = policy(load_cost_s=0.5, host_load_cost_s=0.05, use_measured_costs=False)
    assert ignoring.choose("a", [measured, idle])[0] == "warm"
    # Replicas are judged by the mean of what they measured: a new replica that has not
    # measured yet, or one whose measurement is a little lower, does not take a cold
    # adapter from its walk home.
    walk = walk_order("cold", ["r0", "r1", "r2"])
    noisy = [
        replace(replica(rid), host_load_cost_s=0.004 if rid != walk[0] else 0.006)
        for rid in walk[:2]
    ] + [replica(walk[2])]
    assert p.choose("cold", noisy)[0] == walk[0]
    # from routing stats, and refused when negative
    stats = ReplicaStats.from_routing_stats("r", {"busy_cost_s": 0.002, "host_load_cost_s": 0.1})
    assert (stats.busy_cost_s, stats.host_load_cost_s) == (0.002, 0.1)
    with pytest.raises(ValueError, match="busy_cost_s"):
        ReplicaStats.from_routing_stats("r", {"busy_cost_s": -1})


def test_host_tier_pays_only_the_host_load_cost():
    replicas = [replica("host", host={"a"}, queue=5, slots=4), replica("idle", slots=4)]
    # host: wait 0.5 s + 0.1 s < idle: 0 + 1.0 s
    p = policy(load_cost_s=1.0, host_load_cost_s=0.1, request_time_s=1.0)
    assert p.choose("a", replicas)[0] == "host"


class Fleet:
    """Requests of one adapter at a steady rate through the policy: each holds a batch
    slot of the replica it went to for `request_s`, and leaves the adapter on that
    replica's device (nothing is evicted). Stats are fresh at every request."""

    def __init__(self, p: AffinityPolicy, clock: FakeClock, n: int = 8, slots: int = 4):
        self.p, self.clock, self.slots = p, clock, slots
        self.device: dict[str, set[str]] = {f"r{i}": set() for i in range(n)}
        self.running: list[tuple[float, str]] = []

    def serve(self, rate: float, seconds: float, request_s: float = 1.0, adapter: str = "hot"):
        """Where each request went, in order."""
        chosen = []
        for _ in range(round(rate * seconds)):
            self.clock.advance(1.0 / rate)
            self.running = [(end, r) for end, r in self.running if end > self.clock.now]
            queue = {rid: sum(r == rid for _, r in self.running) for rid in self.device}
            stats = [
                replica(rid, device=held, queue=queue[rid], slots=self.slots)
                for rid, held in self.device.items()
            ]
            top = self.p.choose(adapter, stats)[0]
            self.p.observe(adapter, top)
            self.device[top].add(adapter)
            self.running.append((self.clock.now + request_s, top))
            chosen.append(top)
        return chosen


def replication(clock: FakeClock, **config) -> AffinityPolicy:
    # need = rate * 1 s / (0.5 * 4 slots) = rate / 2; rate estimated over 4 s
    defaults = {"request_time_s": 1.0, "home_utilisation": 0.5, "rate_window_s": 4.0}
    return policy(clock, **(defaults | config))


@pytest.mark.parametrize(
    ("rate", "bound", "homes"), [(1.0, 4, 0), (5.0, 4, 3), (5.0, 2, 2), (40.0, 4, 4)]
)
def test_homes_grow_with_the_rate_and_never_exceed_the_bound(rate, bound, homes):
    clock = FakeClock()
    p = replication(clock, max_homes_per_adapter=bound, load_cost_s=5.0)
    fleet = Fleet(p, clock)
    chosen = fleet.serve(rate, seconds=30.0)
    assert len(p.homes("hot")) == homes  # 0: a cold adapter, one home, none recorded
    late = Counter(chosen[len(chosen) // 2 :])
    assert len(late) == max(1, homes)  # the traffic is on its homes, and only there
    if homes:
        assert set(late) == set(p.homes("hot"))
        assert min(late.values()) > 0.5 * len(chosen) / 2 / homes  # spread over them
    if rate == 40.0:  # every home is busy (10 in flight each > 4 slots): nothing more
        assert p.homes_needed("hot", slots=4) > 4 * bound


def test_homes_shrink_with_hysteresis_and_withdrawn_ones_go_quiet():
    clock = FakeClock()
    p = replication(clock)
    fleet = Fleet(p, clock)
    fleet.serve(3.0, seconds=20.0)  # need ~1.5: two homes
    assert len(p.homes("hot")) == 2
    two = set(p.homes("hot"))
    fleet.serve(1.7, seconds=20.0)  # need ~0.9: above (2 - 1) * 0.75, so it keeps both
    assert set(p.homes("hot")) == two
    chosen = fleet.serve(1.0, seconds=20.0)  # need ~0.5: one home
    assert len(p.homes("hot")) == 1 and p.homes("hot")[0] in two
    assert set(chosen[len(chosen) // 2 :]) == set(p.homes("hot"))  # the spare goes quiet
    fleet.serve(1.7, seconds=20.0)  # need ~0.9 <= 1: not enough to grow again
    assert len(p.homes("hot")) == 1
    fleet.serve(2.6, seconds=20.0)  # need ~1.3 > 1: a second home again
    assert len(p.homes("hot")) == 2


def test_without_hysteresis_a_rate_near_the_threshold_flaps():
    # The same rates as above with home_hysteresis 0: 1.7/s is below one home's need.
    clock = FakeClock()
    p = replication(clock, home_hysteresis=0.0)
    fleet = Fleet(p, clock)
    fleet.serve(3.0, seconds=20.0)
    fleet.serve(1.7, seconds=20.0)
    assert len(p.homes("hot")) == 1


def test_cold_adapters_keep_one_home():
    clock = FakeClock()
    p = replication(clock)
    fleet = Fleet(p, clock)
    for i in range(40):  # 40 adapters at 0.5/s each: 20/s in all, 0.25 of a home each
        fleet.serve(20.0, seconds=0.05, adapter=f"cold{i}")
    for _ in range(3):
        for i in range(40):
            fleet.serve(20.0, seconds=0.05, adapter=f"cold{i}")
    assert all(p.homes(f"cold{i}") == () for i in range(40))
    for i in range(40):
        holders = [rid for rid, held in fleet.device.items() if f"cold{i}" in held]
        assert len(holders) == 1
    fleet.serve(5.0, seconds=30.0)  # a hot one beside them spreads
    assert len(p.homes("hot")) == 3
    clock.advance(200.0)  # it goes cold: one home again, and its record is dropped
    fleet.serve(0.2, seconds=10.0)
    assert len(p.homes("hot")) <= 1


def test_snapshot_reports_the_top_adapters_and_aggregates_the_rest():
    clock = FakeClock()
    p = replication(clock)
    fleet = Fleet(p, clock)
    fleet.serve(5.0, seconds=20.0)
    for i in range(10):
        fleet.serve(10.0, seconds=0.1, adapter=f"tail{i}")
    top, other = p.snapshot(top_n=3)
    assert [t.adapter for t in top][0] == "hot" and len(top) == 3
    assert set(top[0].homes) == set(p.homes("hot")) and len(top[0].homes) == 3
    assert top[0].rate_per_s == pytest.approx(p.rate("hot"))
    assert all(len(t.homes) == 1 for t in top[1:])
    assert other.adapter == "other"
    total = sum(p.rate(a) for a in ["hot", *(f"tail{i}" for i in range(10))])
    assert other.rate_per_s + sum(t.rate_per_s for t in top) == pytest.approx(total)
    assert set(other.homes) <= set(fleet.device)


def test_metrics_show_the_top_adapters_homes_and_rates_and_sum_the_rest():
    from prometheus_client.parser import text_string_to_metric_families

    from loraplex.router.metrics import IngressMetrics

    clock = FakeClock()
    p = replication(clock)
    fleet = Fleet(p, clock)
    fleet.serve(5.0, seconds=20.0)
    for i in range(50):
        fleet.serve(10.0, seconds=0.1, adapter=f"tail{i}")
    text = IngressMetrics(routing=lambda: p.snapshot(top_n=2)).render().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    rates = {
        s.labels["adapter"]: s.value for s in samples if s.name == "loraplex_adapter_request_rate"
    }
    homes = {s.labels["adapter"]: s.value for s in samples if s.name == "loraplex_adapter_homes"}
    per_home = [s.labels for s in samples if s.name == "loraplex_adapter_home"]
    assert len(rates) == 3 and "hot" in rates and "other" in rates  # bounded: top 2 + other
    assert rates["hot"] == pytest.approx(p.rate("hot"))
    assert homes["hot"] == 3
    assert {h["replica"] for h in per_home if h["adapter"] == "hot"} == set(p.homes("hot"))
    assert {h["adapter"] for h in per_home} <= set(rates) - {"other"}
    assert IngressMetrics(routing=lambda: None).render()  # no router yet: no samples


def test_rate_decays_exponentially():
    clock = FakeClock()
    p = policy(clock, rate_window_s=4.0)
    for _ in range(40):
        p.observe("a")
    p.observe(None)
    assert p.rate("a") == pytest.approx(10.0)
    clock.advance(4.0 * math.log(2))
    assert p.rate("a") == pytest.approx(5.0)
    assert p.rate("never-seen") == 0.0


def test_base_model_goes_to_least_loaded():
    replicas = [replica("a", queue=9), replica("b", queue=3), replica("c", queue=5)]
    assert policy().choose(None, replicas) == ["b", "c", "a"]
    mixed = [replica("big", queue=10, slots=64), replica("small", queue=8, slots=16)]
    assert policy().choose(None, mixed)[0] == "big"  # utilisation 0.16 vs 0.5


def test_base_model_ties_are_seeded():
    replicas = idle(4)
    firsts = [policy(seed=3).choose(None, replicas) for _ in range(2)]
    assert firsts[0] == firsts[1]
    p, q = policy(seed=3), policy(seed=3)
    stream = [p.choose(None, replicas)[0] for _ in range(40)]
    assert stream == [q.choose(None, replicas)[0] for _ in range(40)]
    assert len(set(stream)) == 4  # equally loaded replicas share base traffic


def test_no_replicas_and_one_replica():
    p = policy()
    assert p.choose("a", []) == []
    assert p.choose(None, []) == []
    assert p.choose("a", [replica("only", queue=100)]) == ["only"]
    assert p.choose(None, [replica("only", queue=100)]) == ["only"]


def test_all_replicas_at_max_queue():
    replicas = [replica(f"r{i}", queue=8, slots=8) for i in range(3)]
    replicas.append(replica("warm", device={"a"}, queue=8, slots=8))
    p = policy()
    ranked = p.choose("a", replicas)
    assert ranked[0] == "warm" and sorted(ranked) == sorted(r.replica_id for r in replicas)
    assert len(p.choose(None, replicas)) == 4


def test_stale_replica_ranks_last():
    replicas = [replica("stale", device={"a"}, age_s=60.0), replica("fresh", queue=31)]
    assert policy(stale_after_s=30.0).choose("a", replicas) == ["fresh", "stale"]


def test_routing_stats_contract():
    stats = {
        "device_adapters": ["a", "b"],
        "host_adapters": ["c"],
        "loading_adapters": ["d"],
        "queue_len": 3,
        "queued_prefill_tokens": 700,
        "running": 2,
        "waiting_for_pages": 1,
        "batch_adapters": ["a", "d"],
        "max_loras_per_batch": 8,
        "max_concurrency": 32,
        "free_pages": 100,
        "requests_total": 10,
    }
    expected = replica(
        "r", device={"a", "b"}, host={"c"}, loading={"d"}, queue=3, slots=32, pages=100, age_s=1.5
    )
    assert ReplicaStats.from_routing_stats("r", stats, age_s=1.5) == replace(
        expected,
        queued_prefill_tokens=700,
        running=2,
        waiting_for_pages=1,
        batch_adapters=frozenset({"a", "d"}),
        max_loras_per_batch=8,
        requests_finished=7,
        held=3,
    )
    assert ReplicaStats.from_routing_stats("r", {}) == ReplicaStats("r")
    assert ReplicaStats("r").max_concurrency == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"bounded_load_c": 1.0},
        {"bounded_adapters_c": 0.9},
        {"busy_cost_s": -0.1},
        {"host_load_cost_s": 2.0, "load_cost_s": 1.0},
        {"request_time_s": 0.0},
        {"rate_window_s": float("nan")},
        {"home_utilisation": 0.0},
        {"home_hysteresis": 1.0},
        {"max_homes_per_adapter": 0},
    ],
)
def test_config_is_validated(bad):
    with pytest.raises(ValueError):
        AffinityConfig(**bad)


def test_replica_stats_are_validated():
    with pytest.raises(ValueError, match="queue_len"):
        ReplicaStats("r", queue_len=-1)
    with pytest.raises(ValueError, match="queued_prefill_tokens"):
        ReplicaStats("r", queued_prefill_tokens=-1)


# ---------------------------------------------------------------- prefix affinity

BLOCK = 16


def with_prefix_cache(r: ReplicaStats) -> ReplicaStats:
    return replace(r, prefix_block_size=BLOCK)


def prompt_keys(tokens: list[int], version: str | None = None, tenant: str = "t") -> list[bytes]:
    """The keys a replica's prefix cache gives the prompt's full blocks."""
    root = prefix_root(version, tenant, None)
    return extend_block_keys([], root, tokens, BLOCK, len(tokens) // BLOCK)


def prefix_policy(clock: FakeClock | None = None, **config) -> AffinityPolicy:
    # busy: 10 ms per queued request; prefill: 1 ms per token, so 8 cached blocks save 128 ms
    fields = dict(busy_cost_s=0.01, prefill_token_cost_s=1e-3, use_measured_costs=False)
    return policy(clock, **(fields | config))


@pytest.mark.parametrize(("queue", "chosen"), [(10, "r1"), (20, "r0")])
def test_a_shared_prefix_goes_where_it_was_served_while_that_saves_time(queue, chosen):
    """saved(r1) = 8 blocks x 16 tokens x 1 ms = 0.128 s against wait(r1) = queue x 10 ms."""
    p = prefix_policy()
    system = list(range(1000, 1000 + 8 * BLOCK))
    p.observe(None, "r1", prompt_keys(system + [1, 2, 3]))
    replicas = [with_prefix_cache(replica("r0")), with_prefix_cache(replica("r1", queue=queue))]
    assert p.choose(None, replicas, prompt_keys(system + [7, 8, 9, 10]))[0] == chosen


@pytest.mark.parametrize(("queue", "chosen"), [(5, "r1"), (10, "r0")])
def test_a_partly_shared_prefix_saves_only_its_shared_blocks(queue, chosen):
    """The first 4 of 8 blocks alike: saved(r1) = 64 ms."""
    p = prefix_policy()
    first = list(range(2000, 2000 + 8 * BLOCK))
    p.observe(None, "r1", prompt_keys(first))
    second = first[: 4 * BLOCK] + list(range(9000, 9000 + 4 * BLOCK))
    assert p.prefixes.matched(prompt_keys(second), ["r0", "r1"], 0.0) == {"r1": 4}
    replicas = [with_prefix_cache(replica("r0")), with_prefix_cache(replica("r1", queue=queue))]
    assert p.choose(None, replicas, prompt_keys(second))[0] == chosen


@pytest.mark.parametrize(("r1_holds", "chosen"), [((), "r0"), ({"host": {"t/a@v1"}}, "r1")])
def test_prefix_and_adapter_affinity_are_one_cost(r1_holds, chosen):
    """The adapter is on r0's device; the prompt's 8 blocks were served on r1. A cold read
    on r1 (load_cost_s 0.5 s) costs more than the prefill it saves (0.128 s): r0. From r1's
    host tier (0.02 s) it costs less: r1."""
    p = prefix_policy()
    keys = prompt_keys(list(range(3000, 3000 + 8 * BLOCK)), version="v1")
    p.observe("t/a@v1", "r1", keys)
    replicas = [
        with_prefix_cache(replica("r0", device={"t/a@v1"})),
        with_prefix_cache(replica("r1", **{k: v for k, v in dict(r1_holds).items()})),
    ]
    assert p.choose("t/a@v1", replicas, keys)[0] == chosen


def test_another_version_or_tenant_shares_no_prefix():
    """Keys start from the adapter version and the tenant: the same tokens under another
    version or tenant match nothing."""
    p = prefix_policy()
    tokens = list(range(4000, 4000 + 4 * BLOCK))
    p.observe("t/a@v1", "r1", prompt_keys(tokens, version="v1"))
    for keys in (prompt_keys(tokens, version="v2"), prompt_keys(tokens, "v1", tenant="u")):
        assert p.prefixes.matched(keys, ["r0", "r1"], 0.0) == {}
    assert p.prefixes.matched(prompt_keys(tokens, version="v1"), ["r0", "r1"], 0.0) == {"r1": 4}


def test_the_prefix_index_forgets_by_age_size_and_membership():
    clock = FakeClock()
    p = prefix_policy(clock, prefix_ttl_s=60.0, prefix_index_keys=8)
    a = prompt_keys(list(range(5000, 5000 + 4 * BLOCK)))
    p.observe(None, "r1", a)
    clock.advance(59.0)
    assert p.prefixes.matched(a, ["r1"], clock()) == {"r1": 4}
    clock.advance(2.0)
    assert p.prefixes.matched(a, ["r1"], clock()) == {}  # not routed for over ttl_s
    p.observe(None, "r1", a)
    b = prompt_keys(list(range(6000, 6000 + 6 * BLOCK)))
    p.observe(None, "r2", b)  # 10 keys > 8: the least recently used go, a's deepest two
    assert len(p.prefixes) == 8
    assert p.prefixes.matched(a, ["r1"], clock()) == {"r1": 2}
    assert p.prefixes.matched(b, ["r2"], clock()) == {"r2": 6}
    # r2 leaves the deployment: a choice among the others drops what it held
    p.choose(None, [with_prefix_cache(replica("r1"))], b)
    assert len(p.prefixes) == 2 and p.prefixes.replicas == {"r1"}
    assert p.prefixes.matched(a, ["r1"], clock()) == {"r1": 2}


def test_without_a_prefix_cache_on_the_replicas_prefixes_weigh_nothing():
    p = prefix_policy()
    keys = prompt_keys(list(range(7000, 7000 + 8 * BLOCK)))
    p.observe(None, "r1", keys)
    assert p.choose(None, [replica("r0"), replica("r1", queue=1)], keys)[0] == "r0"


def test_a_cold_adapter_avoids_a_replica_whose_store_reads_are_queued():
    """A replica reads adapters one after another (replica/memory/store_reads.py): a read
    sent to a replica with three reads queued waits for them. The cold adapter's first
    replica on its walk is reading three others, the second none: the second wins, though
    both are idle (the adapter-count bound is lifted, so only the reads differ); with
    nothing queued the walk decides again."""
    walk = walk_order("cold", ["r0", "r1"])
    roomy = {"bounded_adapters_c": 100}
    busy = replica(walk[0], loading={"x", "y", "z"})
    assert policy(**roomy).choose("cold", [busy, replica(walk[1])])[0] == walk[1]
    assert policy(**roomy).choose("cold", [replica(walk[0]), replica(walk[1])])[0] == walk[0]
    # loads into the device from its host tier are no store reads
    warm = replica(walk[0], host={"x", "y", "z"}, loading={"x", "y", "z"})
    assert policy(**roomy).choose("cold", [warm, replica(walk[1])])[0] == walk[0]


def test_a_cold_adapter_goes_home_unless_its_wait_exceeds_the_least_by_a_store_read():
    """Stage 2 (cold_walk_reads = 1): with busy_cost_s > 0 every queue length makes a
    different TTFT, but a cold adapter goes to its walk home while the home's wait is
    within one store read (200 ms) of the least loaded replica's, and spills down its walk
    past that. Off (the default), it goes to the shortest queue: its home one time in
    eight, by chance."""
    p = policy(
        load_cost_s=0.2,
        host_load_cost_s=0.0,
        busy_cost_s=0.01,
        bounded_adapters_c=100,
        cold_walk_reads=1.0,
    )
    ids = [f"r{i}" for i in range(8)]
    for i in range(50):
        adapter = f"a{i}"
        walk = walk_order(adapter, ids)
        queues = {rid: 4 + (i + j) % 4 for j, rid in enumerate(ids)}  # 40-70 ms, below the bound
        assert p.choose(adapter, [replica(rid, queue=queues[rid]) for rid in ids])[0] == walk[0]
        queues = {rid: 25 if rid == walk[0] else 0 for rid in ids}  # 250 ms > one read
        assert p.choose(adapter, [replica(rid, queue=queues[rid]) for rid in ids])[0] == walk[1]
    # Off, the least TTFT takes it.
    off = policy(
        load_cost_s=0.2,
        host_load_cost_s=0.0,
        busy_cost_s=0.01,
        bounded_adapters_c=100,
        cold_walk_reads=0.0,
    )
    queues = {rid: 0 if rid == walk[3] else 1 for rid in ids}
    assert off.choose(adapter, [replica(rid, queue=queues[rid]) for rid in ids])[0] == walk[3]
    # Within the load bound (6 < ceil(1.25 * 42 / 8) = 7), 250 ms more wait at home: past
    # one configured read (200 ms) it spills; the replicas' measured reads (300 ms) keep it.
    slow = policy(
        load_cost_s=0.2,
        host_load_cost_s=0.0,
        busy_cost_s=0.25,
        bounded_adapters_c=100,
        cold_walk_reads=1.0,
    )
    queues = {rid: 6 if rid == walk[0] else 5 for rid in ids}
    assert slow.choose(adapter, [replica(rid, queue=queues[rid]) for rid in ids])[0] == walk[1]
    measured = [replace(replica(rid, queue=queues[rid]), store_read_s=0.3) for rid in ids]
    assert slow.choose(adapter, measured)[0] == walk[0]


def test_requests_queued_on_its_holders_give_an_adapter_more_homes():
    """An adapter whose rate estimate needs one home (request_time_s far below what its
    requests take) but whose home holds 40 of its requests for 32 slots: 40 / (0.5 * 32)
    = 2.5, three homes; once they drain, back to one."""
    clock = FakeClock()
    p = policy(clock, request_time_s=0.1, home_utilisation=0.5, home_hysteresis=0.25)
    ids = [f"r{i}" for i in range(4)]
    walk = walk_order("a", ids)
    p.observe("a", walk[0])
    queued = [
        replace(
            replica(rid, device={"a"} if rid == walk[0] else (), queue=40 if rid == walk[0] else 0),
            adapter_queue={"a": 40} if rid == walk[0] else {},
        )
        for rid in ids
    ]
    p.choose("a", queued)
    assert len(p.homes("a")) == 3 and p.homes("a")[0] == walk[0]
    clock.advance(60.0)  # the rate decays; nothing queued any more
    p.choose("a", [replica(rid) for rid in ids])
    assert p.homes("a") == ()


@pytest.mark.parametrize("drain_measured", [True, False])
def test_an_adapter_gets_homes_by_what_a_saturated_replica_finishes(drain_measured):
    """The router bench on a CPU: request_time_s (measured on an idle engine) 0.05 s, 16
    slots, and a saturated replica finishes 20 requests a second, so a request holds a slot
    0.8 s. An adapter asking 25 a second needs 25 * 0.8 / (0.5 * 16) = 2.5 homes whatever
    is queued at the moment; by request_time_s it needed 0.16, and only a queue on its home
    gave it more. Until a drain is measured, request_time_s is all there is."""
    clock = FakeClock()
    p = policy(clock, request_time_s=0.05, rate_window_s=4.0, load_cost_s=1.0)
    ids = [f"r{i}" for i in range(4)]
    full = [replace(replica(rid, queue=16, slots=16), held=16) for rid in ids]
    if drain_measured:
        p.choose("other", full)
        clock.advance(1.0)
        p.choose("other", [replace(r, requests_finished=20) for r in full])
    quiet = [replace(replica(rid, slots=16), requests_finished=20) for rid in ids]
    for _ in range(250):  # 10 s at 25 a second, nothing queued when each is routed
        clock.advance(0.04)
        p.observe("a", p.choose("a", quiet)[0])
    assert len(p.homes("a")) == (3 if drain_measured else 0)
    assert p.homes_needed("a", slots=16) == pytest.approx(2.5 if drain_measured else 0.16, rel=0.2)


def drained(replica_stats: ReplicaStats, finished: int) -> ReplicaStats:
    """The stats as published: `finished` requests done, the queue it held then."""
    return replace(replica_stats, requests_finished=finished, held=replica_stats.queue_len)


@pytest.mark.parametrize(
    ("home_queue", "finished_per_s", "chosen"),
    [(31, 20, "idle"), (31, 1000, "home"), (10, 20, "home"), (17, 20, "home")],
)
def test_a_saturated_home_spills_once_its_measured_drain_makes_the_wait_exceed_a_read(
    home_queue, finished_per_s, chosen
):
    # The bench's costs: a read 0.12 s, request_time_s 34 ms (measured on an idle engine).
    # Priced by request_time_s, a home holding 31 requests in 16 slots waits (31 - 16 + 1) /
    # 16 * 34 ms = 34 ms, under a read, so it kept the adapter however slowly it drained. Its
    # stats say it finishes 20 requests a second while saturated: 16 queued ahead wait 0.8 s,
    # and a cold replica with a free slot serves sooner. A home draining 1000/s (16 ms), or
    # with a free slot, or 2 ahead (0.1 s), keeps it.
    clock = FakeClock()
    p = policy(clock, load_cost_s=0.12, host_load_cost_s=0.005, request_time_s=0.034)
    home = replica("home", device={"a"}, queue=31, slots=16)
    idle_one = replica("idle", slots=16)
    p.choose("a", [drained(home, 100), drained(idle_one, 50)])
    clock.advance(1.0)
    home = drained(home, 100 + finished_per_s)
    assert p.choose("a", [replace(home, queue_len=home_queue), drained(idle_one, 50)])[0] == chosen


def test_each_replicas_placement_names_its_affinity_and_the_tier_it_holds_the_adapter_in():
    """What an operator (and the router bench) reads to tell why requests went where their
    adapter had to be read from the store: the affinity the policy judged and the tier."""
    replicas = [
        replica("cold"),
        replica("host", host={"a"}),
        replica("loading", loading={"a"}),
        replica("device", device={"a"}),
    ]
    clock = FakeClock()
    p = policy(clock)
    placements: dict[str, Placement] = {}
    p.choose("a", replicas, placements=placements)
    assert placements == {
        "cold": Placement(Affinity.COLD, "store"),
        "host": Placement(Affinity.COLD, "host"),
        "loading": Placement(Affinity.LOADING, "loading"),
        "device": Placement(Affinity.DEVICE, "device"),
    }
    p.observe("a", "cold", placement=placements["cold"])
    p.observe("a", "device", placement=placements["device"])
    p.observe("a", "device")  # a caller that does not say is not counted
    again: dict[str, Placement] = {}
    clock.advance(0.5)  # stats recorded before the send, a second old
    p.choose("a", [replace(r, stats_age_s=1.0) for r in replicas], placements=again)
    assert again["cold"] == Placement(Affinity.LOADING, "loading")  # its read is under way
    assert p.placement_counts() == {
        Placement(Affinity.COLD, "store"): 1,
        Placement(Affinity.DEVICE, "device"): 1,
    }
    base: dict[str, Placement] = {}
    p.choose(None, replicas, placements=base)
    assert base == {}  # a base-model request has no adapter to place


def test_metrics_count_the_routers_requests_by_placement():
    from prometheus_client.parser import text_string_to_metric_families

    from loraplex.router.metrics import IngressMetrics

    counts = {Placement(Affinity.COLD, "store"): 3, Placement(Affinity.DEVICE, "device"): 40}
    text = IngressMetrics(placements=lambda: counts).render().decode()
    samples = {
        (s.labels["affinity"], s.labels["tier"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "loraplex_router_placements_total"
    }
    assert samples == {("cold", "store"): 3, ("device", "device"): 40}
