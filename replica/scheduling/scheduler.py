"""Iteration-level continuous batching: every step, running requests advance (one token for
decode, a chunk for prefill) and waiting requests are admitted while the token budget, the
sequence cap, the distinct-adapter cap and the pool allow. The admission order is the
policy's (policy.py: FIFO, SJF with aging; chameleon.py: Chameleon's multi-level queues),
one per tenant, tenants taking turns by the tokens each was served (fairness.py). With a
prefix cache, an admitted request starts after its prompt's cached blocks. When KV runs
out, the latest running request is preempted and later recomputed (from the blocks of it
still cached)."""

from __future__ import annotations

import time
from collections.abc import Callable

from loraplex.replica.config import SchedulerConfig
from loraplex.replica.memory.adapter_cache import AdapterCache
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.scheduling.chameleon import Chameleon
from loraplex.replica.scheduling.fairness import TenantFair
from loraplex.replica.scheduling.policy import FIFO, Admit, QueuePolicy, SJFAging
from loraplex.replica.scheduling.queue_math import OutputPredictor
from loraplex.replica.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVCache,
        adapters: AdapterCache,
        max_len: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.kv = kv
        self.adapters = adapters
        self.clock = clock
        self.running: list[Sequence] = []
        self.failed: list[Sequence] = []  # finished with "error" by a schedule, not yet reported
        self.num_preemptions = 0
        self.num_squashes = 0
        # the waiting requests the last step held back because the pool had no pages for
        # them (a running one preempted for pages, or admission stopped at the pool); 0 when
        # it stopped at the token budget or max_num_seqs, or admitted every one
        self.waiting_for_pages = 0
        self.policy = make_policy(cfg, kv, adapters, max_len)

    @property
    def waiting(self) -> list[Sequence]:
        return self.policy.waiting()

    def add(self, seq: Sequence) -> None:
        self.policy.add(seq, self.clock())

    def has_work(self) -> bool:
        return bool(len(self.policy) or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The step's sequences and how many new tokens each computes."""
        self.adapters.poll()
        self._fail_adapter_loads()
        for victim in self.policy.to_squash(self.clock(), self._room_for):
            self.preempt(victim)
            self.num_squashes += 1
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        short_of_pages = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.kv.ensure(seq, seq.num_computed + n):
                short_of_pages = True
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        short_of_pages |= self._admit(scheduled, budget)
        self.waiting_for_pages = len(self.policy) if short_of_pages else 0
        waiting = self.policy.waiting()
        self.adapters.want(s.adapter for s in waiting if s.adapter is not None)
        self.adapters.prefetch()
        return scheduled

    def _fail_adapter_loads(self) -> None:
        """Queued requests whose adapter failed to load end with "error" (a later request
        for it starts a new load); the others are not held up."""
        failed = self.adapters.take_failures()
        if not failed:
            return
        for seq in [s for s in self.policy.waiting() if s.adapter in failed]:
            self.finish(seq, "error", failed[seq.adapter])
            self.failed.append(seq)

    def take_failed(self) -> list[Sequence]:
        failed, self.failed = self.failed, []
        return failed

    def _admit(self, scheduled: list[tuple[Sequence, int]], budget: int) -> bool:
        """Admit waiting requests while the step has room; whether one was held back
        because the pool had no pages for it (its adapter's or its first step's KV)."""
        in_use = {s.adapter for s in self.running if s.adapter is not None}
        short_of_pages = False

        def try_admit(seq: Sequence) -> Admit:
            nonlocal budget, short_of_pages
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                return Admit.FULL
            new_adapter = seq.adapter is not None and seq.adapter not in in_use
            if new_adapter and len(in_use) >= self.cfg.max_loras_per_batch:
                return Admit.ADAPTER_CAP
            version = self._match_prefix(seq)  # first: what it hits is then not evicted
            lora = None
            if seq.adapter is not None:
                lora = self.adapters.acquire(seq.adapter)
                if lora is None:
                    self._drop_blocks(seq)
                    if seq.adapter in self.adapters.loading:
                        return Admit.LOADING
                    short_of_pages = True
                    return Admit.NO_ROOM
                assert self.kv.prefix is None or lora.version == version
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.kv.ensure(seq, seq.num_computed + n):
                if lora is not None:
                    self.adapters.release(lora)
                self._drop_blocks(seq)
                short_of_pages = True
                return Admit.FULL
            if self.kv.prefix is not None:
                self.kv.admitted(seq)
            seq.lora, seq.status = lora, SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            if seq.adapter is not None:
                in_use.add(seq.adapter)
            return Admit.OK

        self.policy.admit(self.clock(), try_admit)
        return short_of_pages

    def _room_for(self, seq: Sequence, leaving: list[Sequence]) -> bool:
        """Would `seq` start (its adapter on the device, KV for its first step) if the
        running requests `leaving` were preempted? Counts free pages, the KV of those
        leaving, and idle adapters — with those whose every pin is held by `leaving`."""
        pool = self.kv.pool
        have = pool.num_free + sum(len(s.block_table) for s in leaving)
        released: dict[str, int] = {}
        for s in leaving:
            if s.adapter is not None:
                released[s.adapter] = released.get(s.adapter, 0) + 1
        for name, resident in self.adapters.resident.items():
            if name != seq.adapter and resident.pins == released.get(name, 0):
                have += len(resident.pages)
        need = 0
        if seq.adapter is not None and self.adapters.tier(seq.adapter) not in ("device", "loading"):
            need += self.adapters.pages_of(seq.adapter)
        n = min(seq.num_tokens - seq.num_computed, self.cfg.max_num_batched_tokens)
        need += self.kv.blocks_for(seq.num_computed + n) - len(seq.block_table)
        return have >= need

    def _match_prefix(self, seq: Sequence) -> str | None:
        """Start `seq` from its cached prefix blocks, if any; the adapter version they
        were looked up under."""
        prefix = self.kv.prefix
        if prefix is None:
            return None
        version = None if seq.adapter is None else self.adapters.version_of(seq.adapter)
        self.kv.match(seq, prefix.root(version, seq.tenant, seq.cache_salt))
        return version

    def _drop_blocks(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed = seq.num_committed = 0

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if seq.lora is not None:
            self.adapters.release(seq.lora)
            seq.lora = None

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = seq.num_committed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        now = self.clock()
        self.policy.left(seq, now, finished=False)
        self.policy.requeue(seq, now)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Finish a running or waiting sequence and free its pages at once; `error` says
        why when `reason` is "error"."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
            self.policy.left(seq, self.clock(), finished=reason not in ("abort", "error"))
        elif seq.status is SeqStatus.WAITING:
            self.policy.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error


def make_policy(
    cfg: SchedulerConfig, kv: KVCache, adapters: AdapterCache, max_len: int
) -> QueuePolicy:
    predictor = OutputPredictor(cfg.predictor_quantile)  # one, shared by every tenant's policy
    if cfg.tenant_fairness:
        return TenantFair(
            lambda: _policy(cfg, kv, adapters, max_len, predictor), slots=cfg.max_num_seqs
        )
    return _policy(cfg, kv, adapters, max_len, predictor)


def _policy(
    cfg: SchedulerConfig,
    kv: KVCache,
    adapters: AdapterCache,
    max_len: int,
    predictor: OutputPredictor,
) -> QueuePolicy:
    if cfg.policy == "fifo":
        return FIFO()
    if cfg.policy == "sjf":
        return SJFAging(predictor, cfg.sjf_aging_tokens_per_s)

    # Sizes in KV tokens: an adapter holds pages that would otherwise hold KV blocks.
    def adapter_bytes(name: str | None) -> int:
        if name is None:  # the base model: sized as the smallest adapter (WRS > 0)
            sizes = [e.nbytes for e in adapters.entries.values()]
            return min(sizes, default=1)
        return adapters.nbytes_of(name)

    def adapter_tokens(name: str | None) -> int:
        return 0 if name is None else adapters.pages_of(name) * kv.block_size

    return Chameleon(
        cfg.chameleon,
        predictor,
        max_len,
        capacity=lambda: kv.pool.num_pages * kv.block_size,
        adapter_bytes=adapter_bytes,
        adapter_tokens=adapter_tokens,
        max_adapter_bytes=lambda: max((e.nbytes for e in adapters.entries.values()), default=1),
    )
