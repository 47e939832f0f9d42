"""Autoscaling in the fleet simulator: Ray Serve's autoscaler in simulated time over the fleet
simulator's replicas (benchmarks/sim/fleet.py), calling a policy function as Serve does.

Serve's machinery as Ray 2.60 has it (ray/serve/_private/autoscaling_state.py,
ray/serve/autoscaling_policy.py, ray/serve/_private/constants.py):
    control loop  every CONTROL_LOOP_S the controller builds an AutoscalingContext (Ray's own
                  class, with Ray's AutoscalingConfig) and calls the policy as
                  `_apply_autoscaling_config` wraps it: the cold-start path, the policy, then
                  Ray's `_apply_scaling_factors` and `_apply_delay_logic` (given the simulated
                  clock, which the wrapper reads from time.time()), then min/max bounds
    metrics       each replica records its ongoing requests and its record_autoscaling_stats
                  report (replica/protocol.py `autoscaling_stats`, the deployment's function)
                  every look_back_period_s x 0.2 (RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL
                  _FACTOR) and pushes them every PUSH_INTERVAL_S; the router's queued requests
                  likewise. The controller's total_num_requests and aggregated_metrics are the
                  means, over look_back_period_s, of what has been pushed
    start-up      a replica Serve adds serves `startup_s` later (its model's weights read and
                  the engine started; `model_load_s` states it for a profile); it costs
                  replica time from the moment it is asked for
    removal       Serve stops starting replicas first, then running ones, the last started
                  first: a stopping replica is routed nothing new at once, its requests run
                  on; after graceful_shutdown_timeout_s (Serve's default 20 s) what is left is
                  resumed elsewhere as the ingress resumes a dead replica's streams
                  (router/serve_backend.py). Nothing is lost (FleetSim asserts it).

A static fleet is the same simulator with min_replicas = max_replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import (
    _apply_delay_logic,
    _apply_scaling_factors,
    _extract_internal_policy_state,
    _get_cold_start_scale_up_replicas,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from loraplex.benchmarks.sim.fleet import CONTROL_LOOP_S, FleetRun, FleetSetup, FleetSim
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest
from loraplex.replica.protocol import (
    autoscaling_stats,
    measured_token_s,
    tier_bytes,
    token_utilisation,
)

RECORD_FACTOR = 0.2  # RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR
PUSH_INTERVAL_S = 10.0  # RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S
GRACEFUL_SHUTDOWN_S = 20.0  # Serve's graceful_shutdown_timeout_s default
WEIGHTS_BYTES_PER_S = 2e9  # a replica reads its weights from a local NVMe copy or cache
ENGINE_START_S = 15.0  # a Ray actor, its CUDA context and the engine's buffers


def model_load_s(profile) -> float:
    """A replica's start-up: its fp16 weights at WEIGHTS_BYTES_PER_S plus ENGINE_START_S
    (a 7B model: 13.5 GB, 21.7 s)."""
    return profile.weight_bytes / WEIGHTS_BYTES_PER_S + ENGINE_START_S


@dataclass(frozen=True, slots=True)
class Scaling:
    """An autoscaled fleet: Serve's autoscaling_config (as a deployment's YAML gives it) and
    the replicas' start-up time."""

    autoscaling_config: dict[str, Any]
    startup_s: float

    def config(self) -> AutoscalingConfig:
        return AutoscalingConfig(**self.autoscaling_config)


@dataclass(slots=True)
class ScalingRecord:
    """What the autoscaler did over a run."""

    replica_seconds: float = 0.0  # starting, running and stopping replicas, integrated
    scale_events: int = 0  # changes of Serve's target count
    event_times: list[float] = field(default_factory=list)  # when each change was made
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, replicas held)
    stopped_with_requests: int = 0  # stopping replicas that reached the graceful timeout


class ScalingFleetSim(FleetSim):
    """FleetSim whose replica count Serve's autoscaler sets (`setup.num_replicas` is where
    it starts: Serve's initial_replicas)."""

    recurring = (*FleetSim.recurring, "tick", "sample", "push")

    def __init__(
        self,
        router: str,
        requests: list[SimRequest],
        catalog: dict[str, AdapterSpec],
        setup: FleetSetup,
        scaling: Scaling,
    ):
        self.config = scaling.config()
        # the replicas' demand memory, as cluster/config.py passes the lora policy's to them
        kwargs = getattr(self.config.policy, "policy_kwargs", None) or {}
        self.demand_window_s = kwargs.get("demand_window_s", self.demand_window_s)
        super().__init__(router, requests, catalog, setup)
        self.scaling = scaling
        self.scaler = _resolve_policy_callable(self.config.policy)
        self.deployment = DeploymentID(name="LoraplexReplica", app_name="loraplex")
        self.target = setup.num_replicas
        self.policy_state: dict[str, Any] = {}
        self.last_up: float | None = None
        self.last_down: float | None = None
        self.starting: list[float] = []  # when each replica still starting was asked for
        self.held_since: dict[str, float] = {}  # a started replica: when it was asked for
        self.stopping_at: dict[str, float] = {}
        self.record = ScalingRecord()
        self.samples: list[tuple[float, float, dict[str, dict[str, float]]]] = []
        self.total_requests = 0.0  # the controller's view, as of the last push
        self.metrics: dict[str, dict[str, float]] = {}
        # replica -> (when, re-reads, prompt tokens computed, output tokens) at the last sample
        self.marks: dict[str, tuple[float, int, int, int]] = {}
        self.finished: dict[str, tuple[int, int, int]] = {}  # replica -> (records, prompt, out)

    # -- the loop's own events

    def run(self) -> FleetRun:
        self._push(0.0, "tick", None)
        self._push(self.record_interval_s, "sample", None)
        self._push(PUSH_INTERVAL_S, "push", None)
        return super().run()

    def _start_replica(self) -> None:
        super()._start_replica()
        rid = next(reversed(self.replicas))
        self.held_since.setdefault(rid, self.now)
        self._note()

    @property
    def record_interval_s(self) -> float:
        return self.config.look_back_period_s * RECORD_FACTOR

    def _busy(self) -> bool:
        return bool(self._work or self.pending or self.draining or self.starting) or any(
            r.in_flight for r in self.replicas.values()
        )

    def _on_sample(self, _) -> None:
        per_replica = {}
        for rid, replica in self.replicas.items():
            # quick re-reads of adapters the tiers dropped, as the deployment counts them
            # (not first reads); the mean read time is the first reads'
            reads = replica.sim.cache.stats.quick_rereads
            engine = replica.engine_stats()
            prompt, output, finished = self._tokens_computed(rid, replica.sim)
            since, before, prompt_before, output_before = self.marks.get(
                rid, (self.now - self.record_interval_s, 0, 0, 0)
            )
            self.marks[rid] = (self.now, reads, prompt, output)
            queue = replica.adapter_queue()
            tier_bytes = self._tier_bytes(replica.sim)
            demand = replica.demand.report(tier_bytes, self.now) if tier_bytes else (None, None)
            per_replica[rid] = autoscaling_stats(
                requests=replica.in_flight,
                slots=replica.max_concurrency,
                reads=reads,
                reads_before=before,
                elapsed_s=self.now - since,
                read_s=replica.mean_read_s or 0.0,
                prefill_tokens=engine["queued_prefill_tokens"],
                token_s=measured_token_s(engine),
                utilisation=token_utilisation(
                    engine,
                    prompt_tokens=prompt - prompt_before,
                    output_tokens=output - output_before,
                    elapsed_s=self.now - since,
                    slots=replica.max_concurrency,
                    adapters=len(queue),
                ),
                adapter_queue=queue,
                set_bytes=sum(self.catalog[a].nbytes for a in finished | set(queue)),
                tier_bytes=tier_bytes,
                reads_at=demand[0],
                sketch=demand[1],
            )
        ongoing = sum(r.in_flight for r in self.replicas.values()) + len(self.pending)
        self.samples.append((self.now, float(ongoing), per_replica))
        if self._busy():
            self._push(self.now + self.record_interval_s, "sample", None)

    def _tokens_computed(self, rid: str, sim) -> tuple[int, int, set[str]]:
        """Prompt tokens computed and output tokens made so far by a replica's engine: its
        finished requests' and what its running ones have done (the engine's counters); and
        the adapters of the requests it finished since the last call."""
        count, prompt, output = self.finished.get(rid, (0, 0, 0))
        adapters = set()
        for record in sim.done[count:]:
            prompt += record.request.prompt
            output += record.request.output
            if record.request.adapter is not None:
                adapters.add(record.request.adapter)
        self.finished[rid] = (len(sim.done), prompt, output)
        for seq in sim.scheduler.running:
            prompt += min(seq.num_computed, len(seq.prompt_ids))
            output += len(seq.output_ids)
        return prompt, output, adapters

    def _tier_bytes(self, sim) -> int:
        """What a replica's tiers hold at most, as the deployment reports it
        (protocol.tier_bytes; 0: a host tier without a budget keeps every adapter)."""
        return tier_bytes(sim.cache.cfg.host_bytes, sim.cache.held_bytes())

    def _on_push(self, _) -> None:
        """The pushed samples of the look-back window, averaged once (they change only here)."""
        start = self.now - self.config.look_back_period_s
        self.samples = [s for s in self.samples if s[0] > start]
        self.total_requests = (
            sum(s[1] for s in self.samples) / len(self.samples) if self.samples else 0.0
        )
        values: dict[str, dict[str, list[float]]] = {}
        for _, _, per_replica in self.samples:
            for rid, report in per_replica.items():
                for name, value in report.items():
                    values.setdefault(name, {}).setdefault(rid, []).append(value)
        self.metrics = {
            name: {rid: float(np.mean(v)) for rid, v in by.items()} for name, by in values.items()
        }
        if self._busy():
            self._push(self.now + PUSH_INTERVAL_S, "push", None)

    def _on_tick(self, _) -> None:
        self._finish_stopping()
        decision, self.policy_state = self._decide(self._context())
        decision = max(self.config.min_replicas, min(self.config.max_replicas, decision))
        if decision != self.target:
            self.record.scale_events += 1
            self.record.event_times.append(self.now)
            if decision > self.target:
                self.last_up = self.now
                for _ in range(decision - self.target):
                    self.starting.append(self.now)
                    self._push(self.now + self.scaling.startup_s, "ready", self.now)
            else:
                self.last_down = self.now
                self._stop(self.target - decision)
            self.target = decision
            self._note()
        if self._busy():
            self._push(self.now + CONTROL_LOOP_S, "tick", None)

    def _on_ready(self, asked_at: float) -> None:
        if asked_at not in self.starting:  # stopped while starting
            return
        self.starting.remove(asked_at)
        self._start_replica()
        self.held_since[next(reversed(self.replicas))] = asked_at
        self._start_routing()

    def _on_stop(self, rid: str) -> None:
        replica = self.draining.pop(rid, None)
        if replica is None:
            return
        if replica.in_flight:
            self.record.stopped_with_requests += 1
            self._fail(replica)
        else:
            self.dead.append(replica)
        self._release(rid)
        self._start_routing()

    # -- Serve's controller

    def _context(self) -> AutoscalingContext:
        running = list(self.replicas)
        return AutoscalingContext(
            deployment_id=self.deployment,
            deployment_name=self.deployment.name,
            app_name=self.deployment.app_name,
            current_num_replicas=len(running),
            target_num_replicas=self.target,
            running_replicas=running,
            total_num_requests=self.total_requests,
            total_queued_requests=float(len(self.pending)),
            aggregated_metrics=self.metrics,
            raw_metrics=None,
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=dict(self.policy_state),
            last_scale_up_time=self.last_up,
            last_scale_down_time=self.last_down,
            current_time=self.now,
            config=self.config,
        )

    def _decide(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        """Ray's `_apply_autoscaling_config` wrapper, its delays on the simulated clock."""
        cold = _get_cold_start_scale_up_replicas(ctx)
        if cold is not None:
            return cold, ctx.policy_state
        internal = _extract_internal_policy_state(ctx.policy_state)
        desired, state = self.scaler(ctx)
        desired = _apply_scaling_factors(desired, ctx.current_num_replicas, ctx.config)
        if ctx.current_num_replicas == 0 and desired > 0:
            decision = desired
        else:
            decision, internal = _apply_delay_logic(
                max(0, desired), ctx.target_num_replicas, ctx.config, internal, _now=self.now
            )
        state = dict(state or {})
        state.update(internal)
        return math.ceil(decision), state

    # -- replicas leaving

    def _stop(self, n: int) -> None:
        while n and self.starting:
            asked_at = self.starting.pop()
            self.record.replica_seconds += self.now - asked_at
            n -= 1
        for rid in list(reversed(self.replicas))[:n]:
            replica = self.replicas.pop(rid)
            self.stats.pop(rid, None)
            self.model_ids.pop(rid, None)
            self.draining[rid] = replica
            self._push(self.now + GRACEFUL_SHUTDOWN_S, "stop", rid)

    def _finish_stopping(self) -> None:
        for rid, replica in list(self.draining.items()):
            if not replica.in_flight:
                del self.draining[rid]
                self.dead.append(replica)
                self._release(rid)

    def _release(self, rid: str) -> None:
        self.record.replica_seconds += self.now - self.held_since.pop(rid)
        self.marks.pop(rid, None)
        self.finished.pop(rid, None)
        self._note()

    def _note(self) -> None:
        held = len(self.replicas) + len(self.draining) + len(self.starting)
        if not self.record.timeline or self.record.timeline[-1][1] != held:
            self.record.timeline.append((self.now, held))

    def finish(self, run: FleetRun) -> ScalingRecord:
        """The record, the replicas still held charged up to the last request's end."""
        end = float(np.max(run.arrival + run.e2e)) if len(run.e2e) else self.now
        for since in self.held_since.values():
            self.record.replica_seconds += max(0.0, end - since)
        for asked_at in self.starting:
            self.record.replica_seconds += max(0.0, end - asked_at)
        self.held_since.clear()
        return self.record


def simulate_scaling(
    router: str,
    requests: list[SimRequest],
    catalog: dict[str, AdapterSpec],
    setup: FleetSetup,
    scaling: Scaling,
) -> tuple[FleetRun, ScalingRecord]:
    sim = ScalingFleetSim(router, requests, catalog, setup, scaling)
    run = sim.run()
    return run, sim.finish(run)
