"""S-LoRA's scheduling, run by loraplex's real engine: for the engine section of
`loraplex bench sched`. It replaces the engine's `Scheduler` (same interface: add,
schedule, finish, has_work) and follows the rules benchmarks/peers/slora.py models from
S-LoRA's code (slora/server/router/manager.py `RouterManager._step`, req_queue.py
`ReqQueue`, model_infer/infer_adapter.py `InferAdapter`), over the engine's own KV cache
and adapter cache:

- a step is either the prefill of a new mini-batch (whole prompts, nothing else) or one
  decode token for every running request; with a running batch, the queue is looked at
  only after 10 decode steps, then every step until a mini-batch is admitted;
- admission is `SLoRAQueue` (FIFO, memory reserved for each request's max_tokens, the
  pool in tokens less the batch's adapters, one block per request kept for rounding
  tokens up to blocks);
- a mini-batch's adapters are loaded before its prefill, the step waiting for the copies
  (`critical_copy_bytes` says how many bytes it waited for, each load moving twice the
  adapter as S-LoRA's load_lora_A/B do); at the 5th and 7th waiting decode step the
  adapters of the queue head are prefetched (the cache's `want` + `prefetch`, copies
  beside the compute);
- the cache runs with keep_idle off: an adapter leaves when no running request uses it,
  unless a prefetch asked for it (`want`: S-LoRA's prefetch tag); when the batch empties
  every idle adapter leaves.

With Chameleon's parameters it is Chameleon as seed 004 built it on S-LoRA, what
benchmarks/peers/slora_chameleon.py models: admission by Chameleon's queues
(`ChameleonQueue`, bypass included), each pick still passing S-LoRA's memory check, tried
every iteration (§4.1) instead of after 10 decode steps; the squash of a bypasser once the
request it overtook would fit without it (the squashed request is preempted and later
recomputes its prompt and output); every iteration with a running batch, the adapters of
what admission takes next are prefetched, evicting idle cached adapters that batch does
not use (the cache with keep_idle on).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from loraplex.benchmarks.peers.slora import COPIES_PER_LOAD, SLoRAConfig, SLoRAQueue, SReq
from loraplex.benchmarks.peers.slora_chameleon import ChameleonQueue
from loraplex.replica.memory.adapter_cache import AdapterCache
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.scheduling.chameleon import ChameleonParams
from loraplex.replica.sequence import SeqStatus, Sequence


class _Waiting:
    """What the engine's stats read of a policy."""

    name = "slora"

    def __init__(self, queue: SLoRAQueue | ChameleonQueue):
        self.queue = queue

    def __len__(self) -> int:
        return len(self.queue.waiting)


class SLoRAScheduler:
    def __init__(
        self,
        cfg: SLoRAConfig,
        kv: KVCache,
        adapters: AdapterCache,
        max_len: int,
        chameleon: ChameleonParams | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        # S-LoRA frees an adapter with its last request; Chameleon's cache keeps it
        assert adapters.cfg.keep_idle == (chameleon is not None)
        self.cfg = cfg
        self.kv = kv
        self.adapters = adapters
        self.clock = clock
        bs = kv.block_size
        max_total = (kv.pool.num_pages - cfg.running_max_req_size) * bs - cfg.pool_size_lora
        batch_max = cfg.batch_max_tokens or max(max_total // 6, min(cfg.max_req_total_len, max_len))
        self.queue: SLoRAQueue | ChameleonQueue = SLoRAQueue(
            max_total, batch_max, cfg.running_max_req_size
        )
        if chameleon is not None:
            sizes = {n: e.nbytes for n, e in adapters.entries.items()}
            self.queue = ChameleonQueue(
                chameleon,
                max_total,
                batch_max,
                cfg.running_max_req_size,
                self._slots,
                adapters.nbytes_of,
                max(sizes.values(), default=1),
                max_len,
                clock,
            )
        self.chameleon = chameleon is not None
        self.policy = _Waiting(self.queue)
        self.running: list[Sequence] = []
        self.req: dict[Sequence, SReq] = {}
        self.seq: dict[SReq, Sequence] = {}
        self.has_wait_tokens = 0
        self.num_preemptions = 0  # S-LoRA never preempts
        self.critical_copy_bytes = 0  # bytes the last schedule() waited for
        self.failed: list[Sequence] = []  # ended by a failed adapter load, for the engine

    @property
    def waiting(self) -> list[Sequence]:
        return [self.seq[r] for r in self.queue.waiting]

    def add(self, seq: Sequence) -> None:
        n = seq.params.max_tokens
        req = SReq(None, seq.adapter, len(seq.prompt_ids), n, n)
        self.req[seq], self.seq[req] = req, seq
        self.queue.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.queue.waiting)

    def _slots(self, name: str | None) -> int:
        return 0 if name is None else self.adapters.pages_of(name) * self.kv.block_size

    def take_failed(self) -> list[Sequence]:
        failed, self.failed = self.failed, []
        return failed

    def schedule(self) -> list[tuple[Sequence, int]]:
        self.critical_copy_bytes = 0
        self.adapters.poll()
        failures = self.adapters.take_failures()
        for seq in [s for s in self.waiting if s.adapter in failures]:
            self.finish(seq, "error", failures[seq.adapter])
            self.failed.append(seq)
        for seq in self.running:
            self.req[seq].generated = len(seq.output_ids)
        if self.running and self.chameleon:
            self._squash()
            if self.running and self.cfg.prefetch:
                self._prefetch_upcoming()
        if not self.running:
            batch = self.queue.generate_new_batch(None, self._slots)
            if batch is None:
                return []
            self.has_wait_tokens = 0
            return self._start(batch)
        wait = 1 if self.chameleon else self.cfg.max_wait_tokens
        if self.has_wait_tokens < wait:
            prefetch_at = () if self.chameleon else (wait // 2, wait - 3)  # S-LoRA's
            if self.cfg.prefetch and self.has_wait_tokens in prefetch_at:
                self._prefetch_upcoming()
            self.has_wait_tokens += 1
            return self._decode()
        mini = self.queue.generate_new_batch([self.req[s] for s in self.running], self._slots)
        if mini is None:
            return self._decode()
        self.has_wait_tokens = 0
        return self._start(mini)

    def _squash(self) -> None:
        """Chameleon's squash (seed 004 §4.3.3) over S-LoRA's memory check: the bypassers
        whose leaving lets the request they overtook run are preempted, to recompute."""
        assert isinstance(self.queue, ChameleonQueue)
        for req in self.queue.to_squash([self.req[s] for s in self.running], self._slots):
            seq = self.seq[req]
            self.running.remove(seq)
            self.kv.free(seq)
            if seq.lora is not None:
                self.adapters.release(seq.lora)
                seq.lora = None
            seq.num_computed = seq.num_committed = 0
            seq.status = SeqStatus.WAITING
            seq.num_preemptions += 1
            self.num_preemptions += 1
            self.queue.preempt(req)

    def _prefetch_upcoming(self) -> None:
        """The adapters of what admission takes next (up to the prompt budget); for
        Chameleon's cache, evicting idle cached adapters that batch does not use (a
        prefetch evicts only adapters not `want`ed)."""
        upcoming = self.queue.next_batch() or []
        self.adapters.want(r.adapter for r in upcoming if r.adapter is not None)
        self.adapters.prefetch()

    def _start(self, batch: list[SReq]) -> list[tuple[Sequence, int]]:
        """Load the batch's adapters (the step waits), then prefill its prompts (a squashed
        request's prompt and output: it recomputes both)."""
        seqs = [self.seq[r] for r in batch]
        for seq in seqs:
            if seq.adapter is None:
                continue
            lora = self.adapters.acquire(seq.adapter)
            if lora is None:
                if seq.adapter not in self.adapters.loading:
                    raise RuntimeError(f"S-LoRA admitted {seq.adapter} but its pages are taken")
                self.critical_copy_bytes += COPIES_PER_LOAD * self.adapters.nbytes_of(seq.adapter)
                self.adapters.poll()  # the copy thread's done() joins the copy: the step waits
                lora = self.adapters.acquire(seq.adapter)
            seq.lora = lora
        scheduled = []
        for seq in seqs:
            ok = self.kv.ensure(seq, seq.num_tokens)
            assert ok, "S-LoRA's admission reserved this request's KV"
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, seq.num_tokens))
        return scheduled

    def _decode(self) -> list[tuple[Sequence, int]]:
        for seq in self.running:
            ok = self.kv.ensure(seq, seq.num_computed + 1)
            assert ok, "S-LoRA's admission reserved this request's KV"
        return [(seq, 1) for seq in self.running]

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq)
            if seq.lora is not None:
                self.adapters.release(seq.lora)
                seq.lora = None
            self.req[seq].generated = len(seq.output_ids)
            self.queue.finished(self.req[seq])
            if not self.running and not self.adapters.cfg.keep_idle:
                # the batch is clear: every adapter leaves, prefetched ones too
                self.adapters.want([])
                idle = [r for r in self.adapters.resident.values() if r.pins == 0]
                if idle:
                    self.adapters.reclaim(sum(len(r.pages) for r in idle))
        elif seq.status is SeqStatus.WAITING:
            self.queue.remove(self.req[seq])
        req = self.req.pop(seq)
        del self.seq[req]
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
