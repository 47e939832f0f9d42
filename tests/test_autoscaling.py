"""The `lora` autoscaling policy (router/autoscaling.py) as Ray Serve's controller calls it.
The context is a stand-in carrying the fields of Ray 2.60's AutoscalingContext the policy
reads (a pure-policy test: Serve's own loop is not what is under test here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve.autoscaling_policy import _apply_delay_logic
from ray.serve.config import AutoscalingConfig

from loraplex.replica.protocol import (
    AUTOSCALE_ADAPTER,
    HOT_ADAPTERS_REPORTED,
    autoscaling_stats,
    token_utilisation,
)
from loraplex.replica.protocol import (
    AUTOSCALE_PREFILL_TOKENS as PREFILL_TOKENS,
)
from loraplex.replica.protocol import (
    AUTOSCALE_TOKEN_S as TOKEN_S,
)
from loraplex.router.autoscaling import (
    READ_S,
    READS_PER_S,
    REQUESTS,
    SET_BYTES,
    SLOTS,
    TIER_BYTES,
    UTILISATION,
    Homes,
    LoraAutoscalingPolicy,
    reports_of,
    serve_autoscaling_config,
    staffed,
)


@dataclass
class Context:
    running_replicas: list[str]
    aggregated_metrics: dict[str, dict[str, float]]
    current_time: float
    policy_state: dict[str, Any] = field(default_factory=dict)
    capacity_adjusted_min_replicas: int = 1
    capacity_adjusted_max_replicas: int = 8
    last_scale_up_time: float | None = None
    last_scale_down_time: float | None = None

    @property
    def current_num_replicas(self) -> int:
        return len(self.running_replicas)


def context(
    n: int, requests: float, reads_per_s: float = 0.0, read_s: float = 0.3, **kw
) -> Context:
    replicas = [f"r{i}" for i in range(n)]
    metrics = {
        REQUESTS: {r: requests / n for r in replicas},
        SLOTS: {r: 16.0 for r in replicas},
        READS_PER_S: {r: reads_per_s / n for r in replicas},
        READ_S: {r: read_s for r in replicas},
    }
    return Context(replicas, metrics, **kw)


POLICY = LoraAutoscalingPolicy(downscale_delay_s=60, cooldown_s=30)
MiB = 1 << 20


def test_load_sets_the_count_at_the_target_slot_use():
    # 2 replicas of 16 slots at 0.7: 40 requests want ceil(40 / 11.2) = 4
    target, state = POLICY(context(2, 40, current_time=0))
    assert target == 4 and "40 requests held" in state["why"]
    assert POLICY(context(2, 10, current_time=0))[0] == 2  # lower, but not at once


def test_prefill_held_counts_in_seconds_of_each_replicas_measured_steps():
    """Few requests with long prompts: 8 held on 2 replicas of 16 slots is one replica by
    the slot count, but 30,000 prompt tokens not yet computed at a measured 1e-4 s a token
    are 3 s of prefill, 6 replicas of target_prefill_s = 0.5 s. A replica that has not
    measured its token time yet (0) adds none."""
    ctx = context(2, requests=8, current_time=0)
    ctx.aggregated_metrics[PREFILL_TOKENS] = {"r0": 20_000.0, "r1": 10_000.0}
    ctx.aggregated_metrics[TOKEN_S] = {"r0": 1e-4, "r1": 1e-4}
    assert POLICY(ctx)[0] == 6
    ctx.aggregated_metrics[TOKEN_S]["r1"] = 0.0  # 2 s of prefill
    assert POLICY(ctx)[0] == 4
    ctx.aggregated_metrics[PREFILL_TOKENS] = {"r0": 0.0, "r1": 0.0}
    assert POLICY(ctx)[0] == 2  # wants 1 by its load, but no scale-down before its delay


def test_a_working_set_that_thrashes_adds_a_replica_before_queues_grow():
    """Few requests, but 3 store reads a second of 0.3 s on 2 replicas (45% busy each,
    over read_busy 0.3): one more replica, whose tiers hold more of the working set."""
    target, state = POLICY(context(2, 4, reads_per_s=3.0, current_time=0))
    assert target == 3 and "store reads keep replicas 45% busy" in state["why"]


def test_reads_alone_do_not_undo_a_scale_down_within_the_cooldown():
    """Right after 2 -> 1 the leaving replica's adapters are read once where they go: 3
    reads a second of 0.3 s on the one left is 90% busy, over read_busy, but the count stays
    at 1 until the cooldown has passed (a real 1 -> 2 -> 1 went straight back to 2 on one
    such read). A load that wants 2 still gets them at once."""
    reads = context(1, 4, reads_per_s=3.0, current_time=1010.0)
    reads.last_scale_down_time = 1000.0  # 10 s ago: within the 30 s cooldown
    target, state = POLICY(reads)
    assert target == 1 and "store reads keep replicas 90% busy" in state["why"]
    reads.current_time = 1031.0
    assert POLICY(reads)[0] == 2  # reads that go on past the cooldown: a working set
    load = context(1, 40, reads_per_s=3.0, current_time=1010.0)
    load.last_scale_down_time = 1000.0
    assert POLICY(load)[0] == 4  # 40 requests held on 16 slots at 0.7


def test_a_replica_is_removed_only_after_the_delay_and_the_cooldown():
    state: dict[str, Any] = {}
    n, seen, last_down = 3, [], None
    for t in range(0, 200, 10):  # 5 requests: 1 replica is enough, 31% of its slots
        ctx = context(n, 5, current_time=float(t), policy_state=state, last_scale_up_time=0.0)
        ctx.last_scale_down_time = last_down
        target, state = POLICY(ctx)
        if target < n:
            last_down = float(t)
        n = target
        seen.append(target)
    # 60 s of wanting fewer, then one replica at a time: 1 was wanted all along those
    # 60 s, so the second leaves once the 30 s cool-down of the first has passed
    assert seen == [3] * 6 + [2] * 3 + [1] * 11, seen


def test_no_scale_down_within_the_cooldown_of_a_scale_up():
    state: dict[str, Any] = {}
    for t in range(0, 100, 10):
        ctx = context(3, 10, current_time=1000.0 + t, policy_state=state)
        ctx.last_scale_up_time = 1080.0  # a scale-up 80 s in: 30 s of cooldown after it
        target, state = POLICY(ctx)
    assert target == 3  # wanted fewer for 90 s, but the last event was 10 s ago


def test_fewer_replicas_are_not_kept_if_they_would_read_past_read_busy():
    """2 reads/s of 0.3 s on 3 replicas is 20% each, under 0.3; on 1 replica it would be
    60%: the count stays at 2, where it is 30%, never at 1 (it would only thrash back)."""
    state: dict[str, Any] = {}
    n, seen = 3, []
    for t in range(0, 400, 10):
        target, state = POLICY(
            context(n, 2, reads_per_s=2.0, current_time=float(t), policy_state=state)
        )
        n = target
        seen.append(n)
    assert min(seen) == 2 and seen[-1] == 2, seen


def test_a_steady_load_does_not_flap():
    """A load that wobbles ±20% around 3 replicas' worth for an hour: at most 6 events."""
    state: dict[str, Any] = {}
    n, events, last = 3, 0, 0.0
    for step in range(360):
        t = step * 10.0
        requests = 3 * 11.2 * (0.85 + 0.3 * ((step * 7919) % 10) / 10)
        ctx = context(n, requests, current_time=t, policy_state=state, last_scale_up_time=last)
        target, state = POLICY(ctx)
        if target != n:
            events, n, last = events + 1, target, t
    assert events <= 6, events


def test_bounds_and_replicas_not_reporting_yet():
    ctx = context(2, 400, current_time=0, capacity_adjusted_max_replicas=5)
    assert POLICY(ctx)[0] == 5
    ctx = context(2, 40, current_time=0)
    ctx.running_replicas.append("new")  # started, nothing reported: counted as a replica
    target, _ = POLICY(ctx)
    assert target == 4


@pytest.mark.parametrize("bad", [{"read_busy": 1.5}, {"target_slot_use": 0}, {"nope": 1}])
def test_settings_are_checked(bad):
    with pytest.raises(ValueError):
        LoraAutoscalingPolicy(**bad)


def test_the_yaml_names_the_policy_and_serve_accepts_it():
    from ray.serve.config import AutoscalingConfig

    from loraplex.cluster.config import LoraplexConfig

    replicas = {"autoscaling": {"max_replicas": 4, "policy": "lora", "lora": {"read_busy": 0.4}}}
    options = LoraplexConfig(model="m", replicas=replicas).serve_options()
    serve = AutoscalingConfig(**options["autoscaling_config"])
    assert serve.policy.get_policy() is LoraAutoscalingPolicy
    assert serve.policy.policy_kwargs["read_busy"] == 0.4
    plain = LoraplexConfig(model="m", replicas={"autoscaling": {"max_replicas": 4}})
    assert "policy" not in plain.serve_options()["autoscaling_config"]  # Serve's default
    with pytest.raises(ValueError, match="read_busy"):
        LoraplexConfig(
            model="m", replicas={"autoscaling": {"policy": "lora", "lora": {"read_busy": 3}}}
        )


def test_a_hot_adapter_wanting_more_homes_adds_replicas_up_to_the_routers_bound():
    # one replica of 16 slots holds 8 requests, 7 of one adapter: by load 1 (half its slots:
    # 0.5 + 0.5 sqrt 0.5 = 0.85 replicas), but the router gives an adapter a home per
    # home_utilisation x slots = 3.2 requests: ceil(7 / 3.2) = 3 homes wanted, up to
    # max_homes_per_adapter
    ctx = context(1, 8, current_time=0)
    ctx.aggregated_metrics[AUTOSCALE_ADAPTER + "hot"] = {"r0": 7.0}
    ctx.aggregated_metrics[AUTOSCALE_ADAPTER + "cold"] = {"r0": 1.0}
    homes = {"home_utilisation": 0.2, "downscale_delay_s": 60, "cooldown_s": 30}
    target, state = LoraAutoscalingPolicy(max_homes_per_adapter=8, **homes)(ctx)
    assert target == 3 and "hot adapter wants 3 homes" in state["why"]
    assert LoraAutoscalingPolicy(max_homes_per_adapter=2, **homes)(ctx)[0] == 2
    assert POLICY(ctx)[0] == 1  # without the router's bound: the load count alone


def test_a_hot_adapter_held_across_replicas_counts_once_summed():
    # 2 replicas hold 5 requests each of the same adapter: 10 of it, ceil(10 / 4) = 3 homes
    ctx = context(2, 12, current_time=0)
    ctx.aggregated_metrics[AUTOSCALE_ADAPTER + "hot"] = {"r0": 5.0, "r1": 5.0}
    policy = LoraAutoscalingPolicy(home_utilisation=0.25, max_homes_per_adapter=4)
    assert policy(ctx)[0] == 3


def test_the_router_bound_on_homes_reaches_the_policy_through_serves_config():
    config = serve_autoscaling_config({"policy": "lora"}, Homes(0.5, 4))
    kwargs = config["policy"]["policy_kwargs"]
    assert kwargs["home_utilisation"] == 0.5 and kwargs["max_homes_per_adapter"] == 4
    LoraAutoscalingPolicy(**kwargs)  # Serve builds it with them


def test_a_replica_reports_its_hottest_adapters_by_name_and_the_policy_reads_them_back():
    queue = {"a": 1, "b": 7, "c": 3, "d": 0, "e": 5, "f": 2}
    report = autoscaling_stats(
        requests=18,
        slots=16,
        reads=10,
        reads_before=4,
        elapsed_s=2.0,
        read_s=0.3,
        prefill_tokens=900,
        token_s=2e-4,
        utilisation=0.4,
        adapter_queue=queue,
    )
    hottest = sorted(queue, key=queue.get, reverse=True)[:HOT_ADAPTERS_REPORTED]
    assert {k for k in report if k.startswith(AUTOSCALE_ADAPTER)} == {
        AUTOSCALE_ADAPTER + a for a in hottest
    }
    assert report[READS_PER_S] == 3.0 and report[READ_S] == 0.3
    ctx = Context(["r0"], {name: {"r0": v} for name, v in report.items()}, current_time=0)
    (replica,) = reports_of(ctx)
    assert replica.adapters == {a: float(queue[a]) for a in hottest}
    assert replica.prefill_s == pytest.approx(900 * 2e-4)
    assert replica.utilisation == 0.4


def test_once_its_delay_has_passed_the_policy_keeps_wanting_fewer_under_serves_own_delay():
    # Serve wraps every policy in its own delay logic (ray/serve/autoscaling_policy.py
    # `_apply_delay_logic`): a scale-down needs the lower count asked for on every control
    # loop for Serve's downscale_delay_s. Once the policy's own delay has passed it must keep
    # asking, not fall back to the current count (which resets Serve's timer, for ever).
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, downscale_delay_s=30)
    events = under_serve(  # 6 replicas, load for 1
        lambda n, now, state, _: context(n, 5, current_time=now, policy_state=state), 6, config
    )
    now, target = events[0]
    # the policy's 60 s then Serve's 30 s, one loop apart; one replica at a time
    assert target == 5 and now == pytest.approx(60 + 30, abs=2)


def under_serve(
    ctx_at: Callable[[int, float, dict[str, Any], float | None], Context],
    replicas: int,
    config: AutoscalingConfig,
    seconds: int = 400,
) -> list[tuple[float, int]]:
    """POLICY on Serve's control loop, once a second, wrapped in Serve's own delay logic
    (ray/serve/autoscaling_policy.py `_apply_delay_logic`), each change of the count
    applied at once: when the count changed, and to what. `ctx_at(replicas, now, state,
    last_scale_down_time)` is the loop's context."""
    state: dict[str, Any] = {}
    target, last_down, events = replicas, None, []
    for tick in range(seconds):
        now = float(tick)
        wanted, state = POLICY(ctx_at(replicas, now, state, last_down))
        target, internal = _apply_delay_logic(wanted, target, config, dict(state), _now=now)
        state.update(internal)
        if target != replicas:
            if target < replicas:
                last_down = now
            replicas = target
            events.append((now, target))
    return events


def test_scale_down_removes_one_replica_at_a_time():
    # 6 replicas holding load for 1: after the delay 5, and 4 only after the cooldown
    state: dict[str, Any] = {}
    for now in (0.0, 61.0):
        target, state = POLICY(context(6, 5, current_time=now, policy_state=state))
    assert target == 5
    after = context(5, 5, current_time=70.0, policy_state=state, last_scale_down_time=62.0)
    assert POLICY(after)[0] == 5  # within the cooldown, and a new delay for 5


COSTS = {
    "base_s": 0.02,
    "per_prompt_token_s": 1e-5,
    "per_decode_row_s": 3e-4,
    "per_adapter_s": 1e-3,
}


@pytest.mark.parametrize("rows", [16, 8, 2])
def test_token_utilisation_is_the_share_of_what_a_full_batch_makes(rows):
    """The oracle is the step-cost model itself: a replica stepping back to back for 10 s
    with `rows` decode rows of 4 adapters makes rows tokens a step, each step taking
    base + per_decode_row x rows + per_adapter x 4. With all 16 slots full it is saturated
    (1.0); with fewer rows the same steps are shorter, and what it made is that share of what
    full steps make in the same time. Prompt tokens cost per_prompt_token_s each."""
    step = COSTS["base_s"] + COSTS["per_decode_row_s"] * rows + COSTS["per_adapter_s"] * 4
    full = COSTS["base_s"] + COSTS["per_decode_row_s"] * 16 + COSTS["per_adapter_s"] * 4
    made = rows * 10.0 / step
    stats = {"step_costs": COSTS}
    used = token_utilisation(
        stats, prompt_tokens=0, output_tokens=round(made), elapsed_s=10.0, slots=16, adapters=4
    )
    assert used == pytest.approx((made / 10.0) / (16 / full), rel=1e-3)
    if rows == 16:
        assert used == pytest.approx(1.0, rel=1e-3)
    with_prompts = token_utilisation(
        stats, prompt_tokens=50_000, output_tokens=round(made), elapsed_s=10.0, slots=16, adapters=4
    )
    assert with_prompts - used == pytest.approx(50_000 * 1e-5 / 10.0)
    assert (
        token_utilisation(
            {"step_costs": None},
            prompt_tokens=1,
            output_tokens=1,
            elapsed_s=1,
            slots=16,
            adapters=1,
        )
        == 0.0
    )


def fleet_below_capacity(n: int, load: float) -> dict[str, dict[str, float]]:
    """n replicas of 16 slots sharing `load` replicas' worth of tokens (a pure model of a
    continuous-batching fleet). Below capacity (load < n) a request's time is its own
    tokens', so the requests held are the arrivals x that time (Little), whatever n, and
    no prompt waits; at or past capacity prompts queue: prefill held grows with the excess.
    Each replica's token utilisation is its share of the load."""
    replicas = [f"r{i}" for i in range(n)]
    over = max(0.0, load / n - 0.95)
    return {
        REQUESTS: {r: 6.0 / n + 40.0 * over for r in replicas},
        SLOTS: {r: 16.0 for r in replicas},
        PREFILL_TOKENS: {r: 200_000.0 * over for r in replicas},
        TOKEN_S: {r: 3e-5 for r in replicas},
        UTILISATION: {r: min(1.0, load / n) for r in replicas},
    }


def steady(
    n: int, replicas_worth: float, seconds: int, policy: LoraAutoscalingPolicy = POLICY
) -> tuple[list[int], dict[str, Any]]:
    """The policy every 10 s under a steady load of `replicas_worth` replicas' tokens,
    starting from n replicas, each decision applied at once: the counts, and its state."""
    state: dict[str, Any] = {}
    seen, last_up, last_down = [n], 0.0, None
    for t in range(0, seconds, 10):
        ctx = Context(
            [f"r{i}" for i in range(n)],
            fleet_below_capacity(n, replicas_worth),
            current_time=float(t),
            policy_state=state,
            last_scale_up_time=last_up,
            last_scale_down_time=last_down,
        )
        target, state = policy(ctx)
        if target > n:
            last_up = float(t)
        elif target < n:
            last_down = float(t)
        n = target
        seen.append(n)
    return seen, state


def test_a_steady_load_below_capacity_holds_its_count_without_a_sawtooth():
    """2.4 replicas' worth of tokens, steady for an hour, starting from 3 replicas. The
    queues (requests held against slots, prefill held) are empty below capacity, so counted
    alone they let the count fall to 2, where prompts queue and it climbs again (the
    sawtooth of the simulated day). Counted as utilisation the load wants
    ceil(2.4 + 0.5 sqrt 2.4) = 4 replicas, and none leaves while 3 would be over the band
    (2.4 + 0.7 sqrt 2.4 = 3.5 > 3)."""
    seen, state = steady(3, 2.4, 3600)
    events = sum(a != b for a, b in zip(seen[:-1], seen[1:], strict=True))
    assert seen[-1] == 4 and events == 1, (events, seen)
    assert "utilisation 2.40 replicas" in state["why"]


PROPORTIONAL = LoraAutoscalingPolicy(downscale_delay_s=60, cooldown_s=30, headroom="proportional")


def test_a_replica_leaves_only_while_the_others_stay_under_the_scale_down_utilisation():
    """4 replicas under 1.2 replicas' worth of tokens, scale_down_utilisation 0.588.
    Proportional headroom: one leaves, 3 being 0.4 utilised each; 2 would be 0.6 each (>
    0.588), so 3 stay, though the utilisation alone wants ceil(1.2 / 0.667) = 2.
    Square-root headroom: 2 may be 0.6 utilised (1.2 + (1/0.588 - 1) sqrt(1.2) = 1.97 <=
    2), so 2 remain; 1 would be 1.2."""
    seen, state = steady(4, 1.2, 1200, PROPORTIONAL)
    assert seen[-1] == 3 and min(seen) == 3 and "2 replicas would be 60% utilised" in state["why"]
    seen, state = steady(4, 1.2, 1200)
    assert seen[-1] == 2 and min(seen) == 2, seen


@pytest.mark.parametrize(
    ("used", "proportional", "sqrt"),
    [
        (0.5, 0.71, 0.80),
        (1.0, 1.43, 1.43),
        (2.4, 3.43, 3.06),
        (8.0, 11.43, 9.21),
        (30.0, 42.86, 32.35),
    ],
)
def test_square_root_headroom_gives_a_larger_load_relatively_less_spare(used, proportional, sqrt):
    """The replicas a use of `used` replicas' worth wants at target 0.7: used / 0.7
    proportional, used + (1/0.7 - 1) sqrt(used) square-root staffing. They agree at one
    replica's worth; past it the bursts of many independent requests grow as the square
    root of their rate, not with it, so 8 replicas' worth wants 9.2 replicas (0.87
    utilised), not 11.4 (0.7); below it a load is given a little more spare."""
    assert staffed(used, 0.7, "proportional") == pytest.approx(proportional, abs=0.01)
    assert staffed(used, 0.7, "sqrt") == pytest.approx(sqrt, abs=0.01)


def test_eight_replicas_at_six_replicas_worth_stay_eight_with_square_root_headroom():
    """8 replicas sharing 6 replicas' worth of tokens (0.75 each, no queue): proportional
    headroom wants ceil(6 / 0.667) = 9, square-root staffing ceil(6 + 0.5 sqrt 6) = 8."""
    for policy, want in ((PROPORTIONAL, 9), (POLICY, 8)):
        ctx = Context([f"r{i}" for i in range(8)], fleet_below_capacity(8, 6.0), 0.0)
        ctx.capacity_adjusted_max_replicas = 16
        target, state = policy(ctx)
        assert target == want and "utilisation 6.00 replicas" in state["why"], state


def asking_for(n: int, set_mib: float, tier_mib: float, **kw) -> Context:
    """n replicas, load for one and no store reads, each asked for `set_mib` of distinct
    adapters since its last report against tiers that hold `tier_mib` at most."""
    ctx = context(n, 2, **kw)
    ctx.aggregated_metrics[SET_BYTES] = {r: set_mib * MiB for r in ctx.running_replicas}
    ctx.aggregated_metrics[TIER_BYTES] = {r: tier_mib * MiB for r in ctx.running_replicas}
    return ctx


def walk_down(n: int, set_mib: float, tier_mib: float, minutes: int = 10) -> int:
    """The count after `minutes` of the policy every 10 s from n replicas, each step applied."""
    state: dict[str, Any] = {}
    last_down = None
    for t in range(0, 60 * minutes, 10):
        ctx = asking_for(
            n,
            set_mib / n,  # the adapters are spread over the replicas there are
            tier_mib,
            current_time=float(t),
            policy_state=state,
            last_scale_up_time=0.0,
            last_scale_down_time=last_down,
        )
        target, state = POLICY(ctx)
        if target < n:
            last_down = float(t)
        n = target
    return n


def test_a_count_the_reads_raised_is_kept_while_the_adapters_asked_for_fill_its_tiers():
    """The reads took 1 -> 2 replicas: 12 MiB of adapters asked for against 8 MiB of tiers
    a replica. On two the tiers hold them, the re-reads stop, and the load is one replica's:
    the count stays 2 while they are asked for (one replica's tiers would drop and read them
    again, and the reads would ask for 2 once more), and goes to 1 once 6 MiB are asked for.
    The bytes only hold a count: they never raise one."""
    assert walk_down(2, set_mib=12, tier_mib=8) == 2
    assert walk_down(2, set_mib=6, tier_mib=8) == 1
    target, state = POLICY(asking_for(1, 40, 8, current_time=0.0))
    assert target == 1
    # a host tier without a budget keeps every adapter (tier 0): no count for the set
    assert walk_down(2, set_mib=12, tier_mib=0) == 1


def test_a_replica_reports_the_adapters_asked_for_its_tiers_and_their_reads_and_the_policy_reads_them():
    report = autoscaling_stats(
        requests=1,
        slots=16,
        reads=0,
        reads_before=0,
        elapsed_s=2.0,
        read_s=0.3,
        prefill_tokens=0,
        token_s=0.0,
        utilisation=0.1,
        adapter_queue={"a": 1},
        set_bytes=12 * MiB,
        tier_bytes=8 * MiB,
        reads_at={0.5: 0.25, 1.0: 0.0},
        sketch=(3, ["00ab", "01cd"]),
    )
    ctx = Context(["r0"], {name: {"r0": v} for name, v in report.items()}, current_time=0)
    (replica,) = reports_of(ctx)
    assert replica.set_bytes == 12 * MiB and replica.tier_bytes == 8 * MiB
    # the reads fewer tiers would make (replica/demand.py), by fraction
    assert replica.reads_at == {"0.500": 0.25, "1.000": 0.0}
    # the adapters its demand remembers, and the smallest of their hashes
    assert replica.demand_adapters == 3 and replica.sketch == {"00ab", "01cd"}


def noisy_rise(loads: tuple[float, ...], seconds: int) -> tuple[int, float | None]:
    """One replica, Serve's control loop every second under its own delay logic
    (upscale_delay_s 30), each replica's report renewed every 10 s with the utilisation
    cycling through `loads` (replicas' worth): the count at the end, and when it rose."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, upscale_delay_s=30)
    events = under_serve(
        lambda n, now, state, _: Context(
            [f"r{i}" for i in range(n)],
            fleet_below_capacity(n, loads[(int(now) // 10) % len(loads)]),
            current_time=now,
            policy_state=state,
            last_scale_up_time=0.0,
        ),
        1,
        config,
        seconds,
    )
    if not events:
        return 1, None
    at, n = events[0]
    return n, at


def test_a_load_wavering_at_the_target_still_gets_its_replica_through_serves_delay():
    """A replica's utilisation wavers around the target (0.73, 0.66, 0.76, 0.69 in turn, a
    report every 10 s): more is wanted every other report. Serve raises the count only once
    the policy has asked for more on every loop for upscale_delay_s; a loop at the current
    count restarts that timer, so a policy asking by the latest report alone never got its
    replica (the simulated day's morning: wanted at 190 s, given at 460 s, its P99 TTFT
    4.2 s). Once asked for, the count stays asked for while the replicas stay above
    scale_down_utilisation (the same band that keeps a replica from leaving)."""
    n, at = noisy_rise((0.73, 0.66, 0.76, 0.69), 120)
    assert n == 2 and at is not None and at <= 31, (n, at)
    # under the band, what was asked for is let go: a load that fell stays on one replica
    assert noisy_rise((0.73, 0.40, 0.45, 0.40), 120) == (1, None)


def test_a_load_that_fell_far_lets_replicas_go_one_per_cooldown_not_one_per_delay():
    """6 replicas, load for 1, Serve's control loop every second under its own delay logic
    (downscale_delay_s 30). The first replica leaves after the policy's delay (60 s) and
    Serve's (30 s). The next ones: fewer than 5 (and 4, ...) have been wanted all along the
    delay already waited, so each waits only the cool-down (30 s) and Serve's delay, not
    the policy's whole delay again (which, on the simulated day's evening, kept a replica
    idle some 200 s at each step)."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, downscale_delay_s=30)
    events = under_serve(
        lambda n, now, state, down: context(
            n, 5, current_time=now, policy_state=state, last_scale_down_time=down
        ),
        6,
        config,
    )
    downs = [at for at, _ in events]
    current = events[-1][1]
    gaps = [b - a for a, b in zip(downs, downs[1:], strict=False)]
    assert downs[0] == pytest.approx(90, abs=2) and current == 1, downs
    assert all(g <= 62 for g in gaps), gaps


def test_a_load_that_fell_by_one_waits_the_whole_delay_at_the_next_step():
    """After a step down, a count wanted only since then (not throughout the delay already
    waited) starts its own delay."""
    policy = LoraAutoscalingPolicy(downscale_delay_s=60, cooldown_s=30, target_slot_use=0.5)
    state: dict[str, Any] = {}
    for now in (0.0, 61.0):  # 6 replicas holding 36 requests want ceil(36 / 8) = 5
        target, state = policy(context(6, 36, current_time=now, policy_state=state))
    assert target == 5
    for now in (100.0, 130.0):  # on 5, load for 1: fewer than 5 wanted only from 100 s
        target, state = policy(
            context(5, 5, current_time=now, policy_state=state, last_scale_down_time=62.0)
        )
    assert target == 5
    target, state = policy(
        context(5, 5, current_time=161.0, policy_state=state, last_scale_down_time=62.0)
    )
    assert target == 4


def test_an_ask_let_go_by_a_fall_is_not_taken_up_again():
    """A count asked for (3 on 2 replicas) and then let go, the load having fallen below
    what the 2 need, is not asked for again when the load comes back to the 2's level."""

    def at(load: float, now: float, state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ctx = Context(
            ["r0", "r1"],
            fleet_below_capacity(2, load),
            current_time=now,
            policy_state=state,
            last_scale_up_time=0.0,
        )
        return POLICY(ctx)

    target, state = at(1.6, 100.0, {})  # 0.8 a replica: ceil(1.6 / 0.7) = 3
    assert target == 3
    target, state = at(0.4, 110.0, state)  # fewer wanted: the ask is let go
    assert target == 2
    target, state = at(1.36, 120.0, state)  # 0.68 a replica: 2 are wanted, and kept
    assert target == 2, state
