"""Iteration-level continuous batching: every step, running requests advance (one token for
decode, a chunk for prefill) and waiting requests are admitted while the token budget, the
sequence cap, the distinct-adapter cap and the pool allow. When KV runs out, the latest
running request is preempted and later recomputed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loraplex.replica.adapter_cache import AdapterCache
from loraplex.replica.kv_cache import KVCache
from loraplex.replica.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_loras_per_batch: int = 32

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras_per_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Scheduler:
    """FIFO admission (the S-LoRA / vLLM baseline)."""

    def __init__(self, cfg: SchedulerConfig, kv: KVCache, adapters: AdapterCache):
        self.cfg = cfg
        self.kv = kv
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The step's sequences and how many new tokens each computes."""
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.kv.ensure(seq, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        self._admit(scheduled, budget)
        return scheduled

    def _admit(self, scheduled: list[tuple[Sequence, int]], budget: int) -> None:
        in_use = {s.adapter for s in self.running if s.adapter is not None}
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            new_adapter = seq.adapter is not None and seq.adapter not in in_use
            if new_adapter and len(in_use) >= self.cfg.max_loras_per_batch:
                return
            lora = self.adapters.acquire(seq.adapter) if seq.adapter is not None else None
            if seq.adapter is not None and lora is None:
                return
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.kv.ensure(seq, seq.num_computed + n):
                if lora is not None:
                    self.adapters.release(lora)
                return
            self.waiting.popleft()
            seq.lora, seq.status = lora, SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            if seq.adapter is not None:
                in_use.add(seq.adapter)

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if seq.lora is not None:
            self.adapters.release(seq.lora)
            seq.lora = None

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a running or waiting sequence and free its pages at once."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
