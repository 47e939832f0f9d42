"""LoRA-aware autoscaling on Ray Serve's own autoscaler (`replicas.autoscaling.policy: lora`).

Ray Serve calls `LoraAutoscalingPolicy` (an `AutoscalingPolicy.policy_function`, its
settings as `policy_kwargs`) on the controller every control loop with an
`AutoscalingContext`; each replica reports what it is doing through
`record_autoscaling_stats` (replica/deployment.py: `AUTOSCALING_METRICS` below), averaged by
Serve over `look_back_period_s`. The policy wants the largest of three counts:

    load          the largest of: the replicas' utilisation summed, u, with headroom (a
                  replica's: the larger of its slots held and its token utilisation, its
                  prompt and output tokens priced by its measured step costs as a share of
                  what it makes with its batch full: replica/protocol.py
                  `token_utilisation`): u + β√u replicas, β = 1/target_utilisation − 1,
                  square-root staffing (`headroom: sqrt`, below), or u ÷
                  target_utilisation (`headroom: proportional`); requests held (running +
                  waiting) ÷ (target_slot_use × a replica's slots); and the prompt tokens
                  the replicas have yet to prefill in seconds of their own steps ÷
                  target_prefill_s. The last two measure queues, which are empty below
                  capacity: they add replicas on a ramp, before the utilisation's
                  look-back has seen it, but alone they let the count fall until prompts
                  queue again (a sawtooth: 19 scale events an hour in the simulated day).
                  The utilisation counts the tokens asked for, below capacity too
    working set   while the replicas spend more than read_busy of their time reading
                  again adapters their tiers had dropped (re-reads per second × the
                  measured read time, per replica; a re-read within demand_window_s of
                  the adapter's previous load there), the adapters wanted do not fit the
                  replicas' device and host tiers: one replica more, before the reads make
                  queues grow. First reads are not counted: a new replica reads every
                  adapter routed to it once, and counted they asked for more replicas,
                  which read more (18 scale events an hour in the simulated day); nor are
                  reads of an adapter long after it was last there: demand that came
                  back, as a step down's adapters do to homes that last had them long
                  before (counted, they undid steps down on the full simulated day,
                  56-256 s after them). Its memory: each
                  replica reports the bytes of the distinct adapters asked for since its
                  last report and what its tiers hold at most; the count is not lowered
                  below the replicas whose tiers hold them all (it never raises it), since
                  re-reads stop once the tiers hold the set and would start again after
                  a step down; nor below current while the reads each replica's demand
                  would make from tiers (current - 1) ÷ current of its own (Che's
                  approximation, replica/demand.py) would keep current - 1 replicas past
                  read_busy (`step_down_busy`): the re-reads measured now are near 0
                  where the tiers hold the set, and so is any multiple of them. The
                  tiers are taken that much larger again as the replicas share adapters
                  (`demand_overlap`: the adapters they remember, summed, ÷ the distinct
                  ones, merged from their sketches), since a shared adapter is read once
                  after a step down, not once per replica that remembers it
    hot adapter   the most homes one adapter wants: its requests held, summed over the
                  replicas (each reports its HOT_ADAPTERS_REPORTED largest by name), ÷
                  (the router's home_utilisation × slots), up to its max_homes_per_adapter;
                  the load count alone packs a hot adapter on fewer replicas than the router
                  would spread it over

Scaling up is at once (Serve's `upscale_delay_s` applies on top, and a count once asked for
is asked for while the replicas stay above scale_down_utilisation: one loop lower restarts
Serve's timer); scaling down waits until
the count wanted has stayed below the current one for `downscale_delay_s`, never undoes a
scale event younger than `cooldown_s` (nor does the read count undo a scale-down that
young: the leaving replica's adapters are read once where they go), so a steady load does
not flap, and removes one replica at a time (its adapters are read again where they go:
several at once were a cold-start storm in the simulated day, P99 TTFT 31.8 s after
6 -> 2; the next leaves after the cool-down alone if fewer than the count left were wanted
all through the delay already waited). A count is
never lowered while the fewer replicas would be more than scale_down_utilisation utilised
(below target_utilisation: the band between them is the hysteresis), would read past
read_busy or would not hold the adapters asked for in their tiers (the working set would
thrash again). Bounds are Serve's min_replicas and
max_replicas.

Which replica leaves is Serve's choice: it stops sending it requests, lets its requests
finish (graceful shutdown) and the affinity router gives its adapters new homes on the
replicas that remain, where the first request of each reads it (not yet prefetched).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.replica.protocol import (
    AUTOSCALE_ADAPTER,
    AUTOSCALE_DEMAND_ADAPTERS,
    AUTOSCALE_PREFILL_TOKENS,
    AUTOSCALE_READ_S,
    AUTOSCALE_READS_AT,
    AUTOSCALE_READS_PER_S,
    AUTOSCALE_REQUESTS,
    AUTOSCALE_SET_BYTES,
    AUTOSCALE_SKETCH,
    AUTOSCALE_SLOTS,
    AUTOSCALE_TIER_BYTES,
    AUTOSCALE_TOKEN_S,
    AUTOSCALE_UTILISATION,
    DEMAND_TAU_S,
    distinct_adapters,
    fraction_for,
    fraction_key,
)

# what a replica's record_autoscaling_stats reports (replica/deployment.py)
REQUESTS, SLOTS = AUTOSCALE_REQUESTS, AUTOSCALE_SLOTS
READS_PER_S, READ_S = AUTOSCALE_READS_PER_S, AUTOSCALE_READ_S
PREFILL_TOKENS, TOKEN_S = AUTOSCALE_PREFILL_TOKENS, AUTOSCALE_TOKEN_S
UTILISATION, SET_BYTES, TIER_BYTES = (
    AUTOSCALE_UTILISATION,
    AUTOSCALE_SET_BYTES,
    AUTOSCALE_TIER_BYTES,
)
DEMAND_ADAPTERS = AUTOSCALE_DEMAND_ADAPTERS
AUTOSCALING_METRICS = (
    REQUESTS,
    SLOTS,
    READS_PER_S,
    READ_S,
    PREFILL_TOKENS,
    TOKEN_S,
    UTILISATION,
    SET_BYTES,
    TIER_BYTES,
    DEMAND_ADAPTERS,
)
POLICY_FUNCTION = "loraplex.router.autoscaling:LoraAutoscalingPolicy"

# a child of Serve's logger: the policy runs in Serve's controller, whose log file it reaches
log = logging.getLogger("ray.serve").getChild(__name__)


Headroom = Literal["sqrt", "proportional"]


class LoraAutoscaling(BaseModel):
    """The `lora` policy's settings (`replicas.autoscaling.lora` in the YAML)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_utilisation: float = Field(
        0.667,
        gt=0,
        le=1,
        description="Share of its token capacity (tokens made ÷ what a full batch makes, "
        "priced by the replica's measured step costs) a replica aims at when the load is "
        "one replica's; with headroom sqrt a larger load is given relatively less spare "
        "(see headroom), with proportional every load is (the replicas' utilisation "
        "summed ÷ this replicas are wanted).",
    )
    scale_down_utilisation: float = Field(
        0.588,
        gt=0,
        le=1,
        description="A replica is removed only while the others would stay under this "
        "share of their token capacity once it has left (with headroom sqrt: at one "
        "replica's load, relatively less spare at a larger one, as for "
        "target_utilisation), and a count asked for above the current one stays asked "
        "for while the replicas are over it (below target_utilisation: the band between "
        "them keeps a steady load from flapping: by default β 0.7 against 0.5 with "
        "headroom sqrt, 12% below target_utilisation).",
    )
    headroom: Headroom = Field(
        "sqrt",
        description="The spare capacity the utilisation count leaves. sqrt: square-root "
        "staffing (Halfin and Whitt), a load of u replicas wants u + β√u, β = "
        "1/target_utilisation − 1 (and 1/scale_down_utilisation − 1 for the band): the "
        "same share of spare for one replica as proportional, less as the fleet grows, "
        "since the bursts of many independent requests grow as the square root of their "
        "rate (by default β 0.5: 0.67 utilised at one replica's load, 0.78 at three, 0.85 "
        "at eight). proportional: u ÷ target_utilisation at every size.",
    )
    target_slot_use: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Share of a replica's batch slots (max_num_seqs) the load count aims at: "
        "requests held ÷ (this × slots) replicas are wanted.",
    )
    target_prefill_s: float = Field(
        0.5,
        gt=0,
        le=600,
        description="Seconds of prefill (prompt tokens not yet computed × each replica's "
        "measured time per token) a replica may hold ahead of a new request: the held tokens' "
        "seconds ÷ this replicas are wanted.",
    )
    read_busy: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="Share of its time a replica may spend reading adapters from the store "
        "(reads per second × measured read time) before a replica is added for the working "
        "set, and which fewer replicas must stay under before one is removed.",
    )
    downscale_delay_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description="How long fewer replicas must be wanted before one is removed.",
    )
    cooldown_s: float = Field(
        30.0, ge=0, le=86400, description="No scale-down within this long of any scale event."
    )
    demand_window_s: float = Field(
        DEMAND_TAU_S,
        ge=1,
        le=86400,
        description="How long a replica remembers each adapter's requests (the time "
        "constant of a decaying count) to project the store reads fewer replicas' tiers "
        "would make; an adapter not asked for in g seconds counts at most 3 ÷ g requests a "
        "second, so a working set that has left is forgotten faster.",
    )


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's report, as Serve aggregated it."""

    requests: float  # running + waiting
    slots: float  # max_num_seqs
    reads_per_s: float  # store reads per second
    read_s: float  # mean store read time, seconds (0 until one was measured)
    prefill_tokens: float = 0.0  # prompt tokens not yet computed, queued and running
    token_s: float = 0.0  # measured time a token adds to a step (0 until measured)
    utilisation: float = 0.0  # share of its token capacity used (0 until measured)
    adapters: dict[str, float] = field(default_factory=dict)  # its hottest: requests held
    set_bytes: float = 0.0  # weights of the distinct adapters asked for since its last report
    tier_bytes: float = 0.0  # what its device + host tiers hold at most (0: every adapter)
    # its demand's store reads per second from a tier of a fraction of its own (by fraction_key)
    reads_at: dict[str, float] = field(default_factory=dict)
    demand_adapters: float = 0.0  # the adapters its demand remembers
    sketch: frozenset[str] = frozenset()  # the smallest of their hashes (replica/demand.py)

    @property
    def read_busy(self) -> float:
        return self.reads_per_s * self.read_s

    @property
    def use(self) -> float:
        """The share of its capacity in use: the larger of its token utilisation and its
        slots held (a replica whose slots fill, with requests waiting for adapter reads,
        is full however few tokens it makes)."""
        return max(self.utilisation, self.requests / max(self.slots, 1.0))

    @property
    def prefill_s(self) -> float:
        """The prefill it holds, in seconds of its own steps."""
        return self.prefill_tokens * self.token_s


@dataclass(frozen=True)
class Homes:
    """The router's bound on homes (router.home_utilisation, router.max_homes_per_adapter):
    an adapter holding more than home_utilisation x slots requests wants another home."""

    home_utilisation: float
    max_homes_per_adapter: int


@dataclass(frozen=True)
class Decision:
    replicas: int
    why: str
    by_reads: bool = False  # the store reads alone ask for more replicas than there are
    use: float = 0.0  # the replicas' use summed (ReplicaReport.use)


def wanted(
    reports: list[ReplicaReport], current: int, s: LoraAutoscaling, homes: Homes | None = None
) -> Decision:
    """The replica count the reports call for, before bounds and delays."""
    if not reports or current < 1:
        return Decision(max(current, 1), "no reports yet")
    slots = sum(r.slots for r in reports) / len(reports)
    held = sum(r.requests for r in reports)
    by_load = max(1, _ceil(held / (s.target_slot_use * max(slots, 1.0))))
    why_load = f"{held:.0f} requests held, {slots:.0f} slots a replica"
    prefill_s = sum(r.prefill_s for r in reports)
    by_tokens = _ceil(prefill_s / s.target_prefill_s)
    if by_tokens > by_load:
        by_load = by_tokens
        why_load = f"{prefill_s:.1f} s of prefill held"
    used = sum(r.use for r in reports)
    by_use = _ceil(staffed(used, s.target_utilisation, s.headroom))
    if by_use > by_load:
        by_load = by_use
        why_load = f"utilisation {used:.2f} replicas"
    hot = hot_homes(reports, slots, homes)
    if hot > by_load:
        by_load = hot
        why_load = f"a hot adapter wants {hot} homes"
    busy = sum(r.read_busy for r in reports) / current  # per replica now
    if busy > s.read_busy:
        return Decision(
            max(by_load, current + 1),
            f"store reads keep replicas {busy:.0%} busy",
            by_reads=by_load <= current,
            use=used,
        )
    # fewer replicas read as much in all: as many as keep that under read_busy
    by_reads = max(1, _ceil(busy * current / s.read_busy))
    if by_load < by_reads:
        by_load, why_load = (
            by_reads,
            f"store reads would keep {by_reads - 1} replicas over read_busy",
        )
    less = step_down_busy(reports, current)
    if by_load < current and less > s.read_busy:
        by_load, why_load = (
            current,
            f"{current - 1} replicas' tiers would keep them {less:.0%} busy reading their "
            "adapters' demand",
        )
    by_set = min(current, set_replicas(reports))
    if by_load < by_set:
        set_mib = sum(r.set_bytes for r in reports) / (1 << 20)
        by_load, why_load = (
            by_set,
            f"the adapters asked for ({set_mib:.0f} MiB) fill {by_set} replicas' tiers",
        )
    if by_load < current and current > 1 and over_band(used, current - 1, s):
        left = used / (current - 1)
        return Decision(current, f"{current - 1} replicas would be {left:.0%} utilised", use=used)
    return Decision(by_load, why_load, use=used)


def staffed(used: float, target: float, headroom: Headroom) -> float:
    """The replicas a use of `used` replicas' capacity wants at `target` (the utilisation
    aimed at for one replica's load): `used` + β√`used`, β = 1/target − 1 (sqrt), or
    `used` ÷ target (proportional). The two agree at one replica's load."""
    if headroom == "proportional" or used <= 0:
        return used / target
    return used + (1.0 / target - 1.0) * math.sqrt(used)


def over_band(used: float, replicas: int, s: LoraAutoscaling) -> bool:
    """Whether `replicas` would be over the scale-down band with `used` replicas' worth in
    use: they would want more than themselves at scale_down_utilisation."""
    return _ceil(staffed(used, s.scale_down_utilisation, s.headroom)) > replicas


def hot_homes(reports: list[ReplicaReport], slots: float, homes: Homes | None) -> int:
    """The most homes one adapter wants (its requests held on every replica ÷
    (home_utilisation × slots)), up to the router's max_homes_per_adapter: the replicas
    a hot adapter needs to be spread as the router would spread it."""
    if homes is None:
        return 1
    per_adapter: Counter[str] = Counter()
    for r in reports:
        per_adapter.update(r.adapters)
    most = max(per_adapter.values(), default=0.0)
    need = _ceil(most / (homes.home_utilisation * max(slots, 1.0)))
    return max(1, min(need, homes.max_homes_per_adapter))


def step_down_busy(reports: list[ReplicaReport], current: int) -> float:
    """The share of its time each of current - 1 replicas would spend reading adapters from
    the store: the reads the replicas' demand would make from tiers (current - 1) ÷ current
    × `demand_overlap` of their own (replica/demand.py), at the mean read time. The re-reads
    measured now cannot say it: where the current tiers hold the working set they are near
    0, and so is any multiple of them."""
    fraction = fraction_for(current, demand_overlap(reports))
    read_s = [r.read_s for r in reports if r.read_s > 0]
    if fraction is None or not read_s:
        return 0.0
    key = fraction_key(fraction)
    reads = sum(r.reads_at.get(key, 0.0) for r in reports)
    return reads * (sum(read_s) / len(read_s)) / (current - 1)


def demand_overlap(reports: list[ReplicaReport]) -> float:
    """The adapters the replicas' demand remembers, summed, ÷ the distinct ones among them
    (merged from their sketches): how many replicas the router has sent each adapter to,
    on average; 1 before any replica reports a sketch."""
    sketches = [(r.demand_adapters, r.sketch) for r in reports if r.sketch]
    distinct = distinct_adapters(sketches) if sketches else 0.0
    if distinct <= 0:
        return 1.0
    return max(1.0, sum(count for count, _ in sketches) / distinct)


def set_replicas(reports: list[ReplicaReport]) -> int:
    """The replicas whose tiers hold the adapters asked for (each replica's set, summed:
    an adapter with two homes fills two tiers), at the mean tier of the replicas that bound
    theirs; 1 where none does. The working set's memory: once the replicas hold it, its
    re-reads stop and the read count would let the count fall until they thrash again."""
    tiers = [r.tier_bytes for r in reports if r.tier_bytes > 0]
    if not tiers:
        return 1
    return max(1, _ceil(sum(r.set_bytes for r in reports) * len(tiers) / sum(tiers)))


def _ceil(x: float) -> int:
    """ceil, forgiving float error (0.2 x 3 / 0.3 is 2.0000000000000004, not 3 replicas)."""
    return math.ceil(x - 1e-9)


class LoraAutoscalingPolicy:
    """Serve's policy_function (a class: Serve builds it with `policy_kwargs`, the
    `LoraAutoscaling` fields, and calls it with an AutoscalingContext)."""

    def __init__(
        self,
        home_utilisation: float | None = None,
        max_homes_per_adapter: int = 1,
        **settings: Any,
    ) -> None:
        """`settings`: LoraAutoscaling's; the homes bound is the router's own settings,
        passed along by serve_autoscaling_config (without it, no hot-adapter count)."""
        self.settings = LoraAutoscaling(**settings)
        self.homes = (
            None if home_utilisation is None else Homes(home_utilisation, max_homes_per_adapter)
        )

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        s = self.settings
        state = dict(ctx.policy_state or {})
        current = ctx.current_num_replicas
        now = ctx.current_time if ctx.current_time is not None else 0.0
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        decision = wanted(reports_of(ctx), current, s, self.homes)
        target = min(max(decision.replicas, low), high)
        last_event = max(ctx.last_scale_up_time or 0.0, ctx.last_scale_down_time or 0.0)
        if target < current and current > 0:
            state.pop("up_to", None)  # a count asked for above: let go, the load has fallen
            # since when fewer than `current` have been wanted; kept once the delay has
            # passed: Serve's own delay logic needs the lower count on every loop until it
            # acts, and one loop at `current` would restart its timer. After a step down it
            # stands for the new count too if fewer than that were wanted all along (the most
            # wanted since then, `lower_most`): a load that fell far waits the delay once
            if state.get("lower_from") != current:
                stepped = state.get("lower_from") == current + 1
                if not (stepped and state.get("lower_most", current) < current):
                    state["lower_since"] = now
                    state["lower_most"] = target
                state["lower_from"] = current
            state["lower_most"] = max(state["lower_most"], target)
            if now - state["lower_since"] < s.downscale_delay_s or now - last_event < s.cooldown_s:
                target = current
            else:  # one at a time: the leaving replica's adapters move before the next leaves
                target = current - 1
        else:
            for key in ("lower_from", "lower_since", "lower_most"):
                state.pop(key, None)
            down = ctx.last_scale_down_time
            if target > current and decision.by_reads and down and now - down < s.cooldown_s:
                # the leaving replica's adapters are read once where they go: reads, not
                # a thrashing working set (undone at once, that was a flap in a real 2 -> 1)
                target = current
            target = self._hold_up(state, target, current, decision, high)
        if target != current and state.get("asked") != (current, target):
            log.info(
                "lora autoscaling wants %d replicas (%d now): %s", target, current, decision.why
            )
        state["asked"] = (current, target)
        state["why"] = decision.why
        return target, state

    def _hold_up(
        self, state: dict[str, Any], target: int, current: int, decision: Decision, high: int
    ) -> int:
        """A count once asked for above `current` stays asked for while the replicas stay
        above scale_down_utilisation. Serve raises the count only after it was asked for on
        every loop for upscale_delay_s, and one loop at `current` restarts that timer: a
        load wavering around the target (more wanted every other report) never got its
        replica (the simulated day's morning: wanted at 190 s, given at 460 s). The band
        that keeps a replica from leaving keeps an ask from being let go."""
        if target > current:
            state["up_to"] = target
            return target
        held = min(state.get("up_to", 0), high)
        if held > current > 0 and over_band(decision.use, current, self.settings):
            return held
        state.pop("up_to", None)
        return target


def reports_of(ctx: Any) -> list[ReplicaReport]:
    """The running replicas' reports from Serve's aggregated custom metrics."""
    metrics = ctx.aggregated_metrics or {}
    reports = []
    for replica in ctx.running_replicas:
        values = {name: (metrics.get(name) or {}).get(replica) for name in AUTOSCALING_METRICS}
        slots = values[SLOTS]
        if slots is None:  # not reported yet
            continue
        adapters = {a: n for a, n in _family(metrics, AUTOSCALE_ADAPTER, replica).items() if n}
        reports.append(
            ReplicaReport(
                requests=values[REQUESTS] or 0.0,
                slots=float(slots),
                reads_per_s=values[READS_PER_S] or 0.0,
                read_s=values[READ_S] or 0.0,
                prefill_tokens=values[PREFILL_TOKENS] or 0.0,
                token_s=values[TOKEN_S] or 0.0,
                utilisation=values[UTILISATION] or 0.0,
                adapters=adapters,
                set_bytes=values[SET_BYTES] or 0.0,
                tier_bytes=values[TIER_BYTES] or 0.0,
                reads_at=_family(metrics, AUTOSCALE_READS_AT, replica),
                demand_adapters=values[DEMAND_ADAPTERS] or 0.0,
                sketch=frozenset(_family(metrics, AUTOSCALE_SKETCH, replica)),
            )
        )
    return reports


def _family(metrics: dict[str, Any], prefix: str, replica: Any) -> dict[str, float]:
    """One replica's values of the metrics named `prefix` + a key, by key."""
    return {
        name.removeprefix(prefix): per_replica[replica]
        for name, per_replica in metrics.items()
        if name.startswith(prefix) and per_replica.get(replica) is not None
    }


def serve_autoscaling_config(
    autoscaling: dict[str, Any], homes: Homes | None = None
) -> dict[str, Any]:
    """`replicas.autoscaling` as Ray Serve's autoscaling_config: `policy: lora` (with its
    settings under `lora:`, and the router's bound on homes) becomes Serve's policy naming
    LoraAutoscalingPolicy;
    `policy: requests` (or none) is Serve's default, on ongoing requests. Anything else is
    Serve's own and passed through."""
    config = dict(autoscaling)
    policy = config.pop("policy", "requests")
    settings = LoraAutoscaling(**config.pop("lora", {}))
    if policy == "lora":
        config["policy"] = {
            "policy_function": POLICY_FUNCTION,
            "policy_kwargs": settings.model_dump() | (asdict(homes) if homes else {}),
        }
    elif policy != "requests":
        config["policy"] = policy  # Serve's own form
    return config
