"""S-LoRA as its code does it, on the simulator's clock: the baseline of seed 004.

Modelled from S-LoRA/S-LoRA (github, commit c1ddf48), file by file:

- The step loop is `RouterManager._step` (slora/server/router/manager.py). With no running
  batch, `generate_new_batch` forms one, its adapters are loaded, `torch.cuda.synchronize()`
  waits for every copy in flight (prefetches too) and the batch is prefilled. With a
  running batch, it decodes `max_wait_tokens` = 10 steps without looking at the queue;
  then, every step until something is admitted, it asks for a mini-batch, loads its
  adapters and prefills it in a step of its own (the running batch does not decode in
  that step), then merges it. Prompts are prefilled whole (no chunking).
- Admission is `ReqQueue.generate_new_batch` / `_can_add_new_req`
  (slora/server/router/req_queue.py): FIFO, stop at the first request that does not fit.
  A request fits if, with every running and new request run to its `max_new_tokens`,
  the peak KV of the batch (requests sorted by tokens left: max over k of tokens left of
  the k-th · k + tokens held by the first k) stays below `max_total_token_num` less 4·rank
  slots per distinct adapter of the batch, the batch holds at most `running_max_req_size`
  requests, and the new mini-batch's prompts sum to at most `batch_max_tokens` (default
  max(max_total_token_num / 6, max_req_total_len), slora/server/api_server.py). Memory is
  reserved for the whole output, so nothing is ever preempted. S-LoRA's own benchmark
  client (benchmarks/run_exp.py) sends `max_new_tokens` = the trace's output length with
  `ignore_eos`, so the reservation is exact there.
- Memory is one pool of token slots (`MemoryAllocator`, slora/common/mem_allocator.py):
  a token's K and V take one slot of every layer; an adapter of rank r on q/k/v/o takes
  4r slots (A in the key buffer, B in the value buffer, `InferAdapter.load_lora_A/B`).
  Its size is `max_total_token_num + pool_size_lora`.
- Loading (`InferAdapter.load_adapters`, slora/server/router/model_infer/infer_adapter.py):
  the adapters of a batch that are not on the device are copied on the compute stream
  before its prefill: on the critical path. Each of load_lora_A and load_lora_B copies
  the layer's whole `w_combined` (A and B) from pinned host memory, so a load moves twice
  the adapter's bytes. With `--prefetch`, at the 5th and 7th of the 10 waiting decode
  steps the adapters of `ReqQueue.next_batch()` (the queue head up to batch_max_tokens of
  prompt) are copied on a second stream, as many as fit the free slots then, and tagged;
  the compute stream does not wait for them (no event between the streams).
- Adapters leave (`InferAdapter.offload_adapters`): whenever a decode step finishes a
  request, every adapter neither used by the remaining batch nor tagged by the latest
  prefetch is freed; when the batch empties, every adapter is freed, prefetched or not.
  (The scan is skipped when the batch holds as many adapters as are loaded; kept.)

Where S-LoRA's code would fail, the model keeps going and counts it: its allocator raises
when a KV or adapter allocation finds too few free slots (prefetched adapters are not
counted by admission). The model then frees loaded adapters the batch does not use and
counts an `alloc_failure`. The order of a batch's adapters is a Python set's in S-LoRA;
here it is the order of the batch's requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from loraplex.benchmarks.sim.profiles import StepLoad
from loraplex.benchmarks.sim.replica import Record, ReplicaCounters, SimClock, SimLink
from loraplex.benchmarks.sim.workload import AdapterSpec, SimRequest

COPIES_PER_LOAD = 2  # load_lora_A and load_lora_B each copy w_combined (A and B)


@dataclass(frozen=True, slots=True)
class SLoRAConfig:
    """The S-LoRA server flags the model follows (slora/server/api_server.py)."""

    max_total_token_num: int | None = None  # None: the pool's slots less pool_size_lora
    pool_size_lora: int = 0  # --pool-size-lora: slots beyond max_total_token_num
    batch_max_tokens: int | None = None  # None: max(max_total_token_num / 6, max_req_total_len)
    running_max_req_size: int = 1000
    max_req_total_len: int = 3072
    max_wait_tokens: int = 10  # RouterManager: decode steps between admissions
    prefetch: bool = True  # --prefetch

    def __post_init__(self):
        if self.pool_size_lora < 0 or self.running_max_req_size < 1 or self.max_wait_tokens < 1:
            raise ValueError("pool_size_lora >= 0, running_max_req_size >= 1, max_wait_tokens >= 1")


@dataclass(slots=True, eq=False)
class SReq:
    """`Req` (slora/server/io_struct.py): what admission and the loop know of a request."""

    record: Record
    adapter: str | None
    input_len: int
    max_output_len: int  # max_new_tokens: what admission reserves
    target: int  # tokens it will generate (eos after these)
    generated: int = 0

    @property
    def kv_slots(self) -> int:
        return self.input_len + max(self.generated - 1, 0)


class SLoRAQueue:
    """`ReqQueue` (req_queue.py): FIFO admission with S-LoRA's worst-case KV check."""

    def __init__(self, max_total_tokens: int, batch_max_tokens: int, running_max_req_size: int):
        self.max_total_tokens = max_total_tokens
        self.batch_max_tokens = batch_max_tokens
        self.running_max_req_size = running_max_req_size
        self.waiting: list[SReq] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def append(self, req: SReq) -> None:
        self.waiting.append(req)

    def remove(self, req: SReq) -> None:
        self.waiting.remove(req)

    def finished(self, req: SReq) -> None:
        pass

    def generate_new_batch(
        self, running: list[SReq] | None, adapter_slots: Callable[[str | None], int]
    ) -> list[SReq] | None:
        if running is not None and len(running) >= self.running_max_req_size:
            return None
        held, left, adapters = [], [], set()
        size = 0
        for r in running or []:
            held.append(r.input_len + r.generated)
            left.append(r.max_output_len - r.generated - 1)
            if r.adapter not in adapters:
                size += adapter_slots(r.adapter)
                adapters.add(r.adapter)
        batch: list[SReq] = []
        prompt_tokens = 0
        for req in self.waiting:
            held.append(req.input_len + 1)
            left.append(req.max_output_len - 1)
            if req.adapter not in adapters:
                size += adapter_slots(req.adapter)
                adapters.add(req.adapter)
            fits = _peak_kv(held, left) < self.max_total_tokens - size and (
                len(held) <= self.running_max_req_size
            )
            if not (fits and prompt_tokens + req.input_len <= self.batch_max_tokens):
                break
            batch.append(req)
            prompt_tokens += req.input_len
        if not batch:
            return None
        del self.waiting[: len(batch)]
        return batch

    def next_batch(self) -> list[SReq] | None:
        """The queue head up to batch_max_tokens of prompt: what prefetch loads for."""
        return queue_head(self.waiting, self.batch_max_tokens)


def queue_head(waiting: Iterable[SReq], max_tokens: int) -> list[SReq] | None:
    """The waiting requests from the head whose prompts fit `max_tokens` together (S-LoRA's
    `ReqQueue.next_batch`)."""
    batch, tokens = [], 0
    for req in waiting:
        if tokens + req.input_len > max_tokens:
            break
        batch.append(req)
        tokens += req.input_len
    return batch or None


def _peak_kv(held: list[int], left: list[int]) -> int:
    """_can_add_new_req's bound: sorted by tokens left (most first), the KV in use when the
    k-th request finishes is left[k]·(k+1) + the tokens the first k+1 hold; the peak is the
    largest of these."""
    order = np.argsort(-np.asarray(left), kind="stable")
    left_sorted = np.asarray(left)[order]
    cum_held = np.cumsum(np.asarray(held)[order])
    return int((left_sorted * np.arange(1, len(left) + 1) + cum_held).max())


class SLoRAAdapters:
    """`InferAdapter` (infer_adapter.py): which adapters hold slots, and the prefetch tags."""

    def __init__(self, slots_of: Callable[[str], int]):
        self.slots_of = slots_of
        self.loaded: dict[str, int] = {}  # name -> slots, in load order (adapter_dirs)
        self.prefetch_tag: dict[str, int] = {}
        self.cur_tag = 0

    @property
    def slots(self) -> int:
        return sum(self.loaded.values())

    def load(self, names: list[str], prefetch: bool, free_slots: int) -> list[str]:
        """The adapters this call loads (load_adapters). A prefetch tags every adapter it
        looks at and stops at the first missing one that does not fit the free slots."""
        new: list[str] = []
        total = 0
        if prefetch:
            self.cur_tag ^= 1
        for name in names:
            if prefetch:
                self.prefetch_tag[name] = self.cur_tag
            if name in self.loaded or name in new:
                continue
            if prefetch and total + self.slots_of(name) > free_slots:
                break
            new.append(name)
            total += self.slots_of(name)
        for name in new:
            self.loaded[name] = self.slots_of(name)
        return new

    def offload(self, reserve: set[str]) -> list[str]:
        """offload_adapters(reserve): the adapters freed."""
        if len(reserve) == len(self.loaded):
            return []
        if not reserve:
            gone = list(self.loaded)
            self.loaded.clear()
            return gone
        gone = [
            n
            for n in self.loaded
            if n not in reserve and self.prefetch_tag.get(n, -1) != self.cur_tag
        ]
        for name in gone:
            del self.loaded[name]
        return gone

    def drop_unused(self, keep: set[str]) -> list[str]:
        """Free every adapter not in `keep`, prefetched or not (not S-LoRA's: the model's
        way past an allocation S-LoRA would fail)."""
        gone = [n for n in self.loaded if n not in keep]
        for name in gone:
            del self.loaded[name]
        return gone


@dataclass(slots=True)
class SLoRAStats:
    hits: int = 0  # admitted requests whose adapter was already on the device
    misses: int = 0  # adapters loaded on the critical path
    loads: int = 0  # every load, prefetches included
    prefetches: int = 0
    evictions: int = 0  # adapters freed by offload_adapters
    bytes_loaded: int = 0  # adapter bytes made resident
    load_seconds: float = 0.0  # sum over loads of start -> collected (prefetches included)
    wait_seconds: float = 0.0  # time steps waited for copies: the critical path
    waited_loads: int = 0  # copies a step waited for (critical-path loads and prefetches)
    alloc_failures: int = 0  # where S-LoRA's allocator would have raised


@dataclass(slots=True, eq=False)
class _Copy:
    name: str
    started: float


class SLoRAReplica:
    """One S-LoRA server on the simulated clock; the same driver interface as SimReplica
    (add, advance_until, step, has_work, load, counters)."""

    def __init__(self, profile, cfg: SLoRAConfig, adapters: list[AdapterSpec], max_len: int = 4096):
        self.profile = profile
        self.clock = SimClock()
        self.link = SimLink(profile.link_bytes_per_s, profile.load_setup_s, self.clock)
        slot_bytes = profile.kv_bytes_per_token()
        self.tot_size = profile.pool_bytes // slot_bytes
        max_total = cfg.max_total_token_num or self.tot_size - cfg.pool_size_lora
        self.tot_size = max_total + cfg.pool_size_lora
        batch_max = cfg.batch_max_tokens or max(max_total // 6, cfg.max_req_total_len)
        self.cfg = cfg
        self.spec = {a.name: a for a in adapters}
        # 4r slots for q/k/v/o: exactly the adapter's bytes over a slot's (2 r·hidden·layers
        # per projection, a slot = hidden·layers for K and V)
        self.slots_of = {a.name: math.ceil(a.nbytes / slot_bytes) for a in adapters}
        self.queue = SLoRAQueue(max_total, batch_max, cfg.running_max_req_size)
        self.adapters = SLoRAAdapters(self.slots_of.__getitem__)
        self.running: list[SReq] | None = None
        self.has_wait_tokens = 0
        self.kv_used = 0
        self.in_flight: dict[_Copy, None] = {}
        self.stats = SLoRAStats()
        self.done: list[Record] = []
        self.rank = {a.name: a.rank for a in adapters}
        self.steps = 0
        self.peak_slots_in_use = 0
        self.max_len = max_len

    # -- the driver's interface

    @property
    def load(self) -> int:
        return len(self.running or []) + len(self.queue)

    def has_work(self) -> bool:
        return bool(self.running or len(self.queue))

    def holds(self, adapter: str) -> bool:
        return adapter in self.adapters.loaded

    def add(self, req: SimRequest) -> None:
        self.queue.append(
            SReq(
                Record(req),
                req.adapter,
                req.prompt,
                req.max_tokens,
                min(req.output, req.max_tokens),
            )
        )

    def advance_until(self, t: float) -> None:
        while self.clock.now < t:
            if not self.step(until=t):
                return

    def counters(self) -> ReplicaCounters:
        s = self.stats
        return ReplicaCounters(
            cache={
                "hits": s.hits,
                "misses": s.misses,
                "loads": s.loads,
                "evictions": s.evictions,
                "bytes_loaded": s.bytes_loaded,
                "load_seconds": s.load_seconds,
                "wait_seconds": s.wait_seconds,
                "waited_loads": s.waited_loads,
                "prefetches": s.prefetches,
                "alloc_failures": s.alloc_failures,
            },
            preemptions=0,
            steps=self.steps,
            link_busy_s=self.link.busy_s,
            peak_memory_fraction=self.peak_slots_in_use / self.tot_size,
            bypasses=0,
        )

    # -- RouterManager._step

    def step(self, until: float = math.inf) -> bool:
        self._collect_copies()
        if self.running is None:
            batch = self.queue.generate_new_batch(None, self._adapter_slots)
            if batch is None:
                if len(self.queue):
                    raise RuntimeError(
                        f"S-LoRA cannot admit its queue head alone ({self.queue.waiting[0]})"
                    )
                if until != math.inf:
                    self.clock.now = max(self.clock.now, until)
                return False
            self.running = batch
            self._admitted(batch)
            self._load_for(batch)
            self._wait_for(list(self.in_flight))  # torch.cuda.synchronize()
            self._prefill(batch)
            if not self.running:
                self._offload(set())
                self.running = None
            self.has_wait_tokens = 0
            return True
        wait = self.cfg.max_wait_tokens
        if self.has_wait_tokens < wait:
            if self.cfg.prefetch and self.has_wait_tokens in (wait // 2, wait - 3):
                upcoming = self.queue.next_batch()
                if upcoming is not None:
                    self._prefetch(upcoming)
            self._decode()
            self.has_wait_tokens += 1
            return True
        mini = self.queue.generate_new_batch(self.running, self._adapter_slots)
        if mini is None:
            self._decode()
            return True
        self._admitted(mini)
        self._load_for(mini)
        self._prefill(mini)
        self.running += [r for r in mini if r.generated < r.target]
        self.has_wait_tokens = 0
        return True

    def _admitted(self, batch: list[SReq]) -> None:
        for r in batch:
            r.record.admitted = self.clock.now

    def _adapter_slots(self, name: str | None) -> int:
        return 0 if name is None else self.slots_of[name]

    # -- memory

    @property
    def free_slots(self) -> int:
        return self.tot_size - self.kv_used - self.adapters.slots

    def _alloc_kv(self, n: int, batch: list[SReq]) -> None:
        if n > self.free_slots:
            self._make_room(n, batch)
        self.kv_used += n
        in_use = self.kv_used + sum(
            self.slots_of[a] for a in {r.adapter for r in self.running or []} if a is not None
        )
        self.peak_slots_in_use = max(self.peak_slots_in_use, in_use)

    def _make_room(self, n: int, batch: list[SReq]) -> None:
        """MemoryAllocator.alloc would raise here: free what the batch does not use."""
        self.stats.alloc_failures += 1
        keep = {r.adapter for r in (self.running or []) + batch if r.adapter is not None}
        self.stats.evictions += len(self.adapters.drop_unused(keep))

    def _offload(self, reserve: set[str]) -> None:
        self.stats.evictions += len(self.adapters.offload(reserve))

    # -- loading

    def _names(self, batch: list[SReq]) -> list[str]:
        return list(dict.fromkeys(r.adapter for r in batch if r.adapter is not None))

    def _start_copy(self, name: str) -> _Copy:
        copy = _Copy(name, self.clock.now)
        nbytes = self.spec[name].nbytes
        self.in_flight[copy] = None
        self.link.submit(copy, COPIES_PER_LOAD * nbytes, lambda: None)
        self.stats.loads += 1
        self.stats.bytes_loaded += nbytes
        return copy

    def _load_for(self, batch: list[SReq]) -> None:
        """load_adapters(batch.adapter_dirs) on the compute stream: the step waits."""
        names = self._names(batch)
        for r in batch:
            if r.adapter is not None and r.adapter in self.adapters.loaded:
                self.stats.hits += 1
        need = sum(self.slots_of[n] for n in names if n not in self.adapters.loaded)
        if need > self.free_slots:
            self._make_room(need, batch)
        new = self.adapters.load(names, prefetch=False, free_slots=self.free_slots)
        self.stats.misses += len(new)
        self._wait_for([self._start_copy(n) for n in new])

    def _prefetch(self, upcoming: list[SReq]) -> None:
        new = self.adapters.load(self._names(upcoming), prefetch=True, free_slots=self.free_slots)
        for name in new:
            self._start_copy(name)
        self.stats.prefetches += len(new)

    def _collect_copies(self) -> None:
        for copy in self.link.done():
            self.in_flight.pop(copy, None)
            self.stats.load_seconds += self.clock.now - copy.started

    def _wait_for(self, copies: list[_Copy]) -> None:
        start = self.clock.now
        pending = set(copies)
        self.stats.waited_loads += len(pending & self.in_flight.keys())
        while pending & self.in_flight.keys():
            self.clock.now = max(self.clock.now + 1e-9, self.link.next_done())
            self._collect_copies()
        self.stats.wait_seconds += self.clock.now - start

    # -- compute

    def _run(self, load: StepLoad) -> float:
        dt = self.profile.step_time(load)
        self.clock.now += dt
        self.steps += 1
        return dt

    def _step_load(self, batch: list[SReq], tokens: list[int], context: list[int]) -> StepLoad:
        adapters = {r.adapter for r in batch if r.adapter is not None}
        return StepLoad(
            tokens=sum(tokens),
            context=sum(context),
            token_rank=sum(
                n * self.rank[r.adapter] for r, n in zip(batch, tokens, strict=True) if r.adapter
            ),
            adapter_bytes=sum(self.spec[a].nbytes for a in adapters),
            adapters=len(adapters),
            rows=len(batch),
        )

    def _prefill(self, batch: list[SReq]) -> None:
        """_prefill_batch: the prompts in one step; each request's first token comes out.
        Requests done after one token leave (no offload: _handle_finish_req(minibatch)).
        (A request preempted by Chameleon's squash recomputes its prompt and what it had
        generated, and goes on from there.)"""
        prompts = [r.input_len + r.generated for r in batch]
        self._alloc_kv(sum(prompts), batch)
        self._run(self._step_load(batch, prompts, prompts))
        for r in batch:
            if r.generated == 0:
                r.record.first_token = self.clock.now
            r.generated += 1
        for r in [r for r in batch if r.generated >= r.target]:
            self._finish(r)
        if self.running is batch:
            self.running = [r for r in batch if r.generated < r.target]

    def _decode(self) -> None:
        """_decode_batch, then _handle_finish_req(minibatch=False) and _filter_runing_batch."""
        batch = self.running
        self._alloc_kv(len(batch), batch)
        self._run(
            self._step_load(batch, [1] * len(batch), [r.input_len + r.generated for r in batch])
        )
        finished = []
        for r in batch:
            r.generated += 1
            if r.generated >= r.target:
                finished.append(r)
        if not finished:
            return
        for r in finished:
            self._finish(r)
        self.running = [r for r in batch if r.generated < r.target]
        self._offload({r.adapter for r in self.running if r.adapter is not None})
        if not self.running:
            self._offload(set())
            self.running = None

    def _finish(self, r: SReq) -> None:
        self.kv_used -= r.kv_slots
        r.record.finish = self.clock.now
        self.done.append(r.record)
        self.queue.finished(r)
