"""Chameleon as seed 004 built it: on S-LoRA (§5.1, "We implement Chameleon on top of ...
S-LoRA"). S-LoRA's step loop, token-slot pool, loading and prefetch
(benchmarks/peers/slora.py) stay; two parts are Chameleon's, run by the code loraplex runs:

- Admission: S-LoRA's FIFO `ReqQueue` is replaced by Chameleon's multi-level queues
  (replica/scheduling/chameleon.py: WRS, K-means cut-offs, M/M/1 quotas, two-phase
  admission, the starvation guard). Each request it picks must still pass S-LoRA's
  memory check (the batch's worst-case KV below the pool less its adapters) and the
  mini-batch's prompt budget; the first that does not stops the mini-batch. S-LoRA never
  preempts, so there is nothing to bypass or squash.
- The adapter cache: an adapter no longer leaves when its last request does. Idle adapters
  stay in free slots and leave, lowest F·frequency + R·recency + S·size first
  (replica/memory/eviction.py), adapters of queued requests last, those of the batch never,
  when KV or another adapter needs the slots (§4.2).
"""

from __future__ import annotations

from collections.abc import Callable

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
from loraplex.replica.scheduling.policy import Admit
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

    @property
    def waiting(self) -> list[SReq]:
        return [self.req_of[s] for s in self.policy.waiting()]

    def append(self, req: SReq) -> None:
        params = SamplingParams(max_tokens=req.max_output_len)
        seq = Sequence(str(id(req)), [0] * req.input_len, params, req.adapter, 0.0, None)
        self.seq_of[req], self.req_of[seq] = seq, req
        self.policy.add(seq, self.clock())

    def remove(self, req: SReq) -> None:
        seq = self.seq_of.pop(req)
        del self.req_of[seq]
        self.policy.remove(seq)

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
            if prompt_tokens + req.input_len > self.batch_max_tokens:
                return Admit.FULL
            extra = adapter_slots(req.adapter) if req.adapter not in adapters else 0
            peak = _peak_kv([*held, req.input_len + 1], [*left, req.max_output_len - 1])
            if peak >= self.max_total_tokens - size - extra:
                return Admit.FULL
            held.append(req.input_len + 1)
            left.append(req.max_output_len - 1)
            adapters.add(req.adapter)
            size += extra
            prompt_tokens += req.input_len
            batch.append(req)
            return Admit.OK

        self.policy.admit(self.clock(), try_admit)
        return batch or None

    def next_batch(self) -> list[SReq] | None:
        return queue_head(self.waiting, self.batch_max_tokens)


class ChameleonOnSLoRA(SLoRAReplica):
    def __init__(
        self,
        profile,
        cfg: SLoRAConfig,
        params: ChameleonParams,
        adapters: list[AdapterSpec],
        max_len: int,
        half_life_s: float,  # the frequency's half-life: the adapter cache's setting
    ):
        super().__init__(profile, cfg, adapters, max_len)
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

    def _offload(self, reserve: set[str]) -> None:
        """The cache keeps idle adapters; they leave only in _make_room."""

    def _make_room(self, n: int, batch: list[SReq]) -> None:
        """Evict idle adapters until n slots are free: not wanted by a queued request first,
        each group lowest score first. Those of the batch, or still being copied, stay."""
        busy = {r.adapter for r in (self.running or []) + batch}
        busy |= {c.name for c in self.in_flight}
        wanted = {r.adapter for r in self.queue.waiting}
        idle = [self.usage[a] for a in self.adapters.loaded if a not in busy]
        now = self.clock.now
        order = self.score.order([u for u in idle if u.name not in wanted], now)
        order += self.score.order([u for u in idle if u.name in wanted], now)
        for usage in order:
            if self.free_slots >= n:
                return
            del self.adapters.loaded[usage.name]
            self.stats.evictions += 1
        if self.free_slots < n:
            self.stats.alloc_failures += 1

    def _load_for(self, batch: list[SReq]) -> None:
        super()._load_for(batch)
        now = self.clock.now
        for r in batch:
            if r.adapter is not None:
                self.usage[r.adapter].touch(now, self.half_life_s)
