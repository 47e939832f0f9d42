"""Chameleon as seed 004 built it: on S-LoRA (§5.1, "We implement Chameleon on top of ...
S-LoRA"). S-LoRA's token-slot pool, prefill steps and loading (benchmarks/peers/slora.py)
stay; the rest is Chameleon's, run by the code loraplex runs:

- Admission: S-LoRA's FIFO `ReqQueue` is replaced by Chameleon's multi-level queues
  (replica/scheduling/chameleon.py: WRS, K-means cut-offs, M/M/1 quotas, two-phase
  admission), tried every iteration (§4.1: "on every decode iteration, it can remove and
  add requests"), where S-LoRA looks at its queue after 10 decode steps. Each request it
  picks must still pass S-LoRA's memory check (the batch's worst-case KV below the pool
  less its adapters) and the mini-batch's prompt budget. A request that fails the check
  only by its adapter's slots is blocked for its adapter (§4.3.3): a younger request may
  bypass it, and is squashed (preempted, to recompute later) once its leaving would let
  the blocked one run.
- The adapter cache: an adapter no longer leaves when its last request does. Idle adapters
  stay in free slots and leave, lowest F·frequency + R·recency + S·size first
  (replica/memory/eviction.py), adapters of queued requests last, those of the batch never,
  when KV or another adapter needs the slots (§4.2).
- Prefetch, every iteration: the adapters of what admission takes next (`Chameleon.waiting`
  order, up to S-LoRA's prompt budget), evicting idle cached adapters that this upcoming
  batch does not use to make room.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from loraplex.benchmarks.peers.slora import (
    SLoRAConfig,
    SLoRAReplica,
    SReq,
    _peak_kv,
    queue_head,
)
from loraplex.benchmarks.sim.workload import AdapterSpec
from loraplex.replica.memory.eviction import AdapterUsage, WeightedScore
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.chameleon import Chameleon, ChameleonParams
from loraplex.replica.scheduling.policy import Admit, Room
from loraplex.replica.scheduling.queue_math import OutputPredictor
from loraplex.replica.sequence import Sequence


class ChameleonQueue:
    """The `ReqQueue` interface over a `Chameleon` policy."""

    def __init__(
        self,
        params: ChameleonParams,
        max_total_tokens: int,
        batch_max_tokens: int,
        running_max_req_size: int,
        slots_of: Callable[[str], int],
        nbytes_of: Callable[[str], int],
        biggest: int,
        max_len: int,
        clock: Callable[[], float],
    ):
        self.policy = Chameleon(
            params,
            OutputPredictor(),
            max_len,
            capacity=lambda: max_total_tokens,
            adapter_bytes=lambda n: biggest if n is None else nbytes_of(n),
            adapter_tokens=lambda n: 0 if n is None else slots_of(n),
            max_adapter_bytes=lambda: biggest,
        )
        self.max_total_tokens = max_total_tokens
        self.batch_max_tokens = batch_max_tokens
        self.running_max_req_size = running_max_req_size
        self.clock = clock
        self.seq_of: dict[SReq, Sequence] = {}
        self.req_of: dict[Sequence, SReq] = {}
        self.queued: Counter[str | None] = Counter()  # waiting requests per adapter

    def __len__(self) -> int:
        return len(self.policy)

    @property
    def waiting(self) -> list[SReq]:
        return [self.req_of[s] for s in self.policy.waiting()]

    def wanted(self) -> set[str | None]:
        """The adapters of the waiting requests."""
        return set(self.queued)

    def append(self, req: SReq) -> None:
        params = SamplingParams(max_tokens=req.max_output_len)
        seq = Sequence(str(id(req)), [0] * req.input_len, params, req.adapter, 0.0, None)
        self.seq_of[req], self.req_of[seq] = seq, req
        self.policy.add(seq, self.clock())
        self.queued[req.adapter] += 1

    def _dequeued(self, req: SReq) -> None:
        self.queued[req.adapter] -= 1
        if not self.queued[req.adapter]:
            del self.queued[req.adapter]

    def remove(self, req: SReq) -> None:
        seq = self.seq_of.pop(req)
        del self.req_of[seq]
        self.policy.remove(seq)
        self._dequeued(req)

    def finished(self, req: SReq) -> None:
        seq = self.seq_of.pop(req)
        del self.req_of[seq]
        seq.output_ids = [0] * req.generated
        self.policy.left(seq, self.clock(), finished=True)

    def generate_new_batch(
        self, running: list[SReq] | None, adapter_slots: Callable[[str | None], int]
    ) -> list[SReq] | None:
        running = running or []
        if len(running) >= self.running_max_req_size:
            return None
        for r in running:  # what bypass reads: how far each running request has got
            out = self.seq_of[r].output_ids
            out.extend([0] * (r.generated - len(out)))
        held = [r.input_len + r.generated for r in running]
        left = [r.max_output_len - r.generated - 1 for r in running]
        adapters = {r.adapter for r in running}
        size = sum(adapter_slots(a) for a in adapters)
        batch: list[SReq] = []
        prompt_tokens = 0

        def try_admit(seq: Sequence) -> Admit:
            nonlocal size, prompt_tokens
            req = self.req_of[seq]
            if len(held) + 1 > self.running_max_req_size:
                return Admit.FULL
            prompt = req.input_len + req.generated  # a squashed request recomputes
            if prompt_tokens + prompt > self.batch_max_tokens:
                return Admit.FULL
            extra = adapter_slots(req.adapter) if req.adapter not in adapters else 0
            peak = _peak_kv([*held, prompt + 1], [*left, req.max_output_len - req.generated - 1])
            if peak >= self.max_total_tokens - size - extra:
                # short only by its adapter's slots: blocked for its adapter (bypass)
                short_of_adapter = extra > 0 and peak < self.max_total_tokens - size
                return Admit.NO_ROOM if short_of_adapter else Admit.FULL
            held.append(prompt + 1)
            left.append(req.max_output_len - req.generated - 1)
            adapters.add(req.adapter)
            size += extra
            prompt_tokens += prompt
            batch.append(req)
            return Admit.OK

        self.policy.room = self._room(running, adapter_slots)  # what a bypass predicts with
        self.policy.admit(self.clock(), try_admit)
        for req in batch:
            self._dequeued(req)
        return batch or None

    def next_batch(self) -> list[SReq] | None:
        """What admission takes next, up to the prompt budget (S-LoRA's `next_batch` over
        Chameleon's order)."""
        return queue_head((self.req_of[s] for s in self.policy.upcoming()), self.batch_max_tokens)

    def to_squash(
        self, running: list[SReq], adapter_slots: Callable[[str | None], int]
    ) -> list[SReq]:
        """Chameleon's squash over S-LoRA's memory check: running requests to preempt so
        that a request they bypassed passes it."""
        victims = self.policy.to_squash(self.clock(), self._room(running, adapter_slots))
        return [self.req_of[s] for s in victims]

    def _room(self, running: list[SReq], adapter_slots: Callable[[str | None], int]) -> Room:
        """S-LoRA's memory check for a waiting request with some of `running` gone."""

        def room(seq: Sequence, leaving: list[Sequence]) -> bool:
            req, gone = self.req_of[seq], {self.req_of[s] for s in leaving}
            rest = [r for r in running if r not in gone]
            held = [r.input_len + r.generated for r in rest]
            left = [r.max_output_len - r.generated - 1 for r in rest]
            held.append(req.input_len + req.generated + 1)
            left.append(req.max_output_len - req.generated - 1)
            size = sum(adapter_slots(a) for a in {r.adapter for r in rest} | {req.adapter})
            return _peak_kv(held, left) < self.max_total_tokens - size

        return room

    def preempt(self, req: SReq) -> None:
        """Back to its queue, right behind the request it was squashed for."""
        seq = self.seq_of[req]
        self.policy.left(seq, self.clock(), finished=False)
        self.policy.requeue(seq, self.clock())
        self.queued[req.adapter] += 1


class ChameleonOnSLoRA(SLoRAReplica):
    def __init__(
        self,
        profile,
        cfg: SLoRAConfig,
        params: ChameleonParams,
        adapters: list[AdapterSpec],
        max_len: int,
        half_life_s: float,  # the frequency's half-life: the adapter cache's setting
        cache: bool,  # False: no adapter cache, adapters leave as S-LoRA's do
    ):
        # admission every iteration; prefetch is Chameleon's (step), not S-LoRA's
        super().__init__(
            profile, replace(cfg, max_wait_tokens=1, prefetch=False), adapters, max_len
        )
        self.prefetching = cfg.prefetch
        self.cache = cache
        self.squashes = 0
        fifo = self.queue
        nbytes = {a.name: a.nbytes for a in adapters}
        self.queue = ChameleonQueue(
            params,
            fifo.max_total_tokens,
            fifo.batch_max_tokens,
            fifo.running_max_req_size,
            self.slots_of.__getitem__,
            nbytes.__getitem__,
            max(nbytes.values()),
            max_len,
            self.clock,
        )
        self.score = WeightedScore(half_life_s=half_life_s)
        self.half_life_s = half_life_s
        self.usage = {a.name: AdapterUsage(a.name, a.nbytes) for a in adapters}

    def step(self, until: float = math.inf) -> bool:
        if self.running:
            self._collect_copies()
            for r in self.queue.to_squash(self.running, self._adapter_slots):
                self.running.remove(r)
                self.kv_used -= r.kv_slots
                self.queue.preempt(r)
                self.squashes += 1
            if not self.running:
                self.running = None
            if self.prefetching and (upcoming := self.queue.next_batch()) is not None:
                self._prefetch(upcoming)
        return super().step(until)

    def _prefetch(self, upcoming: list[SReq]) -> None:
        """Load the adapters of what admission takes next, evicting idle cached adapters
        the upcoming batch does not use (lowest score first) to make room."""
        names = self._names(upcoming)
        need = sum(self.slots_of[n] for n in names if n not in self.adapters.loaded)
        if need > self.free_slots:
            self._make_room(need, upcoming, ahead=True)
        new = self.adapters.load(names, prefetch=True, free_slots=self.free_slots)
        for name in new:
            self._start_copy(name)
        self.stats.prefetches += len(new)

    def counters(self):
        policy = self.queue.policy
        return replace(super().counters(), bypasses=policy.num_bypasses, squashes=self.squashes)

    def _offload(self, reserve: set[str]) -> None:
        """The cache keeps idle adapters; they leave only in _make_room."""
        if not self.cache:
            super()._offload(reserve)

    def _make_room(self, n: int, batch: list[SReq], ahead: bool = False) -> None:
        """Evict idle adapters until n slots are free: not wanted by a queued request first,
        each group lowest score first. Those of the batch, or still being copied, stay.
        A prefetch that cannot free n slots evicts nothing and is not a failure."""
        busy = {r.adapter for r in (self.running or []) + batch}
        busy |= {c.name for c in self.in_flight}
        wanted = self.queue.wanted()
        idle = [self.usage[a] for a in self.adapters.loaded if a not in busy]
        now = self.clock.now
        order = self.score.order([u for u in idle if u.name not in wanted], now)
        order += self.score.order([u for u in idle if u.name in wanted], now)
        if ahead and self.free_slots + sum(self.adapters.loaded[u.name] for u in order) < n:
            return
        for usage in order:
            if self.free_slots >= n:
                return
            del self.adapters.loaded[usage.name]
            self.stats.evictions += 1
        if self.free_slots < n and not ahead:
            self.stats.alloc_failures += 1

    def _load_for(self, batch: list[SReq]) -> None:
        """S-LoRA's load, then a wait for the batch's adapters still being prefetched: the
        cache hands out an adapter once it is on the device (S-LoRA's compute stream does
        not wait for its prefetch stream, a race the model keeps for `slora` only)."""
        super()._load_for(batch)
        names = set(self._names(batch))
        self._wait_for([c for c in self.in_flight if c.name in names])
        now = self.clock.now
        for r in batch:
            if r.adapter is not None:
                self.usage[r.adapter].touch(now, self.half_life_s)
