"""Chameleon's multi-level-queue admission policy (seed 004 §4.3), a `QueuePolicy`."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import numpy as np

from loraplex.replica.config import ChameleonParams
from loraplex.replica.scheduling.policy import Admit, Room, TryAdmit
from loraplex.replica.scheduling.queue_math import (
    OutputPredictor,
    QueueLoad,
    choose_cutoffs,
    token_quotas,
    weighted_request_size,
)
from loraplex.replica.sequence import Sequence


@dataclass(frozen=True, slots=True)
class _Size:
    """What a request's WRS is made of (seed 004 §4.3.1)."""

    prompt: int
    output: int  # predicted
    adapter_bytes: int


@dataclass(slots=True)
class _Entry:
    size: _Size
    wrs: float  # under the normalisers of the latest refresh
    need: int  # tokens it holds while running: input + predicted output + its adapter
    adapter_need: int  # of which its adapter's
    enqueued: float
    queue: int = 0
    started: float = 0.0  # admitted (last, if preempted): D is measured from here
    overtaken: int = 0
    bypassers: list[Sequence] = field(default_factory=list)  # younger ones that overtook it
    behind: Sequence | None = None  # squashed for this request: requeued right after it


class _Heads:
    """The first request of each queue not yet `taken`, read in order without copying."""

    def __init__(self, queues: list[deque[Sequence]], taken: set[Sequence]):
        self.its = [iter(q) for q in queues]
        self.heads: list[Sequence | None] = [None] * len(queues)
        self.taken = taken

    def peek(self, q: int) -> Sequence | None:
        seq = self.heads[q]
        while seq is None or seq in self.taken:
            seq = next(self.its[q], None)
            if seq is None:
                break
        self.heads[q] = seq
        return seq

    def pop(self, q: int) -> Sequence | None:
        seq = self.peek(q)
        if seq is not None:
            self.taken.add(seq)
        return seq


class Chameleon:
    """Multi-level queues. `capacity()` is the tokens the pool can hold (the quotas split
    it); `adapter_bytes(name)` and `adapter_tokens(name)` size a request's adapter (None:
    no adapter); `max_adapter_bytes()` normalises WRS. The input and output terms of WRS
    are normalised by the workload's largest input and output (§4.3.1: MaxInputSize,
    MaxOutputSize): the largest prompt among the recent arrivals and the longest output
    among the recent finished requests, taken at each refresh (`max_len` until then)."""

    name = "chameleon"

    def __init__(
        self,
        params: ChameleonParams,
        predictor: OutputPredictor,
        max_len: int,
        capacity: Callable[[], int],
        adapter_bytes: Callable[[str | None], int],
        adapter_tokens: Callable[[str | None], int],
        max_adapter_bytes: Callable[[], int],
    ):
        self.p = params
        self.predictor = predictor
        self.max_len = max_len
        self.capacity = capacity
        self.adapter_bytes = adapter_bytes
        self.adapter_tokens = adapter_tokens
        self.max_adapter_bytes = max_adapter_bytes
        self.cutoffs: list[float] = []
        self.quotas: list[int] = [capacity()]
        self.queues: list[deque[Sequence]] = [deque()]
        self.used: list[int] = [0]
        self.holders: dict[tuple[int, str | None], int] = {}  # running requests per queue, adapter
        self.entries: dict[Sequence, _Entry] = {}
        self.running: dict[Sequence, _Entry] = {}
        self.arrivals: deque[tuple[float, _Size, int]] = deque(maxlen=params.window)
        self.served: deque[tuple[_Size, float]] = deque(maxlen=params.window)  # (size, s)
        self.outputs: deque[int] = deque(maxlen=params.window)  # finished requests' outputs
        self.max_in = max_len
        self.max_out = max_len
        self.now = 0.0  # the latest admission's: the starvation guard's order in waiting()
        self.last_refresh: float | None = None
        self.wcss: list[float] = []
        self.num_bypasses = 0
        self.num_starving = 0  # admitted by the starvation guard
        self.num_squashes = 0
        self.bypassed: dict[Sequence, None] = {}  # waiting requests with running bypassers
        # the host's memory check, as given to the latest to_squash (asked before each
        # admission): what a bypass predicts the blocked request's wait with
        self.room: Room | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def queue_of(self, wrs: float) -> int:
        return int(np.searchsorted(self.cutoffs, wrs, side="right"))

    def wrs(self, size: _Size) -> float:
        return weighted_request_size(
            size.prompt,
            size.output,
            size.adapter_bytes,
            self.max_in,
            self.max_out,
            self.max_adapter_bytes(),
            self.p.a,
            self.p.b,
        )

    def add(self, seq: Sequence, now: float) -> None:
        predicted = self.predictor.predict(seq.adapter, seq.params.max_tokens)
        size = _Size(len(seq.prompt_ids), predicted, self.adapter_bytes(seq.adapter))
        wrs = self.wrs(size)
        adapter_need = self.adapter_tokens(seq.adapter)
        # the predicted output even where the host reserves max_tokens (S-LoRA): charged
        # max_tokens there, the quotas hardly moved (the largest queue's stayed under one
        # request) and bench sched's P99 at the high load was worse in 4 of 5 seeds
        need = size.prompt + predicted + adapter_need
        entry = _Entry(size, wrs, need, adapter_need, now, self.queue_of(wrs))
        self.entries[seq] = entry
        self.arrivals.append((now, size, need))
        self.queues[entry.queue].append(seq)

    def requeue(self, seq: Sequence, now: float) -> None:
        """Back to the head of its queue; a squashed request goes right behind the request
        it was squashed for, which must be tried first."""
        entry = self.entries[seq]
        entry.queue = min(entry.queue, len(self.queues) - 1)
        queue = self.queues[entry.queue]
        blocked, entry.behind = entry.behind, None
        if blocked is not None and blocked in self.entries and blocked in queue:
            queue.insert(queue.index(blocked) + 1, seq)
        else:
            queue.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        entry = self.entries.pop(seq)
        self.queues[entry.queue].remove(seq)
        self.bypassed.pop(seq, None)

    def waiting(self) -> list[Sequence]:
        return list(self.upcoming())

    def upcoming(self) -> Iterator[Sequence]:
        """The waiting requests in the order admission takes them while memory allows: the
        starvation guard's (if on), phase 1 (each queue, smallest first, within the room
        its quota has left), phase 2 (the spare, smallest queue first), then the rest a
        request per queue in turn, smallest queue first — the queues whose running requests
        return quota next. Prefetching loads adapters in this order, so it loads what
        admission takes next. Lazy: a prefetch reads only the head. The queues must not
        change while it is read."""
        taken: set[Sequence] = set()
        if self.p.starve_s is not None:
            limit = self.now - self.p.starve_s
            waited = [s for s, e in self.entries.items() if e.enqueued <= limit]
            for seq in sorted(waited, key=lambda s: self.entries[s].enqueued):
                taken.add(seq)
                yield seq
        heads = _Heads(self.queues, taken)
        spare = 0
        for q in range(len(self.queues)):
            room = self.quotas[q] - self.used[q]
            consumed = yield from self._take(q, heads, room)
            if heads.peek(q) is None:
                spare += max(0, room - consumed)
        for q in range(len(self.queues)):
            if spare <= 0:
                break
            spare -= yield from self._take(q, heads, spare)
        while True:
            turn = [seq for q in range(len(self.queues)) if (seq := heads.pop(q)) is not None]
            if not turn:
                return
            yield from turn

    def _take(self, q: int, heads: _Heads, tokens: int) -> Generator[Sequence, None, int]:
        """`_put`'s choice with every request admissible: queue q's head while it fits
        `tokens` (a queue with nothing running may start its head over quota)."""
        consumed = 0
        while (seq := heads.peek(q)) is not None:
            cost = self.cost(seq, self.entries[seq], q)
            if cost > tokens - consumed and self.used[q] + consumed > 0:
                break
            consumed += cost
            yield heads.pop(q)
        return consumed

    def left(self, seq: Sequence, now: float, finished: bool) -> None:
        entry = self.running.pop(seq)
        self._uncharge(seq, entry)
        if finished:
            self.predictor.observe(seq.adapter, len(seq.output_ids))
            self.served.append((entry.size, now - entry.started))
            self.outputs.append(len(seq.output_ids))
        else:
            self.entries[seq] = entry

    # -- queues and quotas

    def _maybe_refresh(self, now: float) -> None:
        if self.last_refresh is None:
            if len(self.arrivals) >= self.p.min_samples:
                self.refresh(now)
        elif now - self.last_refresh >= self.p.refresh_s:
            self.refresh(now)

    def refresh(self, now: float) -> None:
        """Re-normalise and re-cluster the recent request sizes, re-file the waiting
        requests, re-split the token capacity."""
        self.last_refresh = now
        if self.arrivals:
            self.max_in = max(size.prompt for _, size, _ in self.arrivals)
            predicted = max(size.output for _, size, _ in self.arrivals)
            self.max_out = max(self.outputs, default=predicted)
        sizes = np.array([self.wrs(size) for _, size, _ in self.arrivals])
        self.cutoffs, self.wcss = choose_cutoffs(sizes, self.p.k_max)
        k = len(self.cutoffs) + 1
        waiting = sorted(self.entries.items(), key=lambda kv: kv[1].enqueued)
        self.queues = [deque() for _ in range(k)]
        for seq, entry in waiting:
            entry.wrs = self.wrs(entry.size)
            entry.queue = self.queue_of(entry.wrs)
            self.queues[entry.queue].append(seq)
        self.used = [0] * k
        self.holders = {}
        for seq, entry in self.running.items():
            entry.wrs = self.wrs(entry.size)
            entry.queue = self.queue_of(entry.wrs)
            self._charge(seq, entry)
        self.quotas = token_quotas(
            self.queue_loads(now),
            self.capacity(),
            self.p.slo_s,
            self.p.quota_percentile,
            self.p.quota_floor_requests,
        )

    def queue_loads(self, now: float) -> list[QueueLoad]:
        k = len(self.cutoffs) + 1
        span = max(now - self.arrivals[0][0], 1e-9) if self.arrivals else 1.0
        sizes: list[list[int]] = [[] for _ in range(k)]
        for _, size, need in self.arrivals:
            sizes[self.queue_of(self.wrs(size))].append(need)
        durations: list[list[float]] = [[] for _ in range(k)]
        for size, seconds in self.served:
            durations[self.queue_of(self.wrs(size))].append(seconds)
        overall = float(np.mean([s for _, s in self.served])) if self.served else 0.0
        loads = []
        for q in range(k):
            rate = len(sizes[q]) / span
            mean_need = float(np.mean(sizes[q])) if sizes[q] else 0.0
            loads.append(
                QueueLoad(
                    max_size=float(max(sizes[q], default=0)),
                    duration_s=float(np.mean(durations[q])) if durations[q] else overall,
                    rate=rate,
                    weight=rate * mean_need,
                )
            )
        return loads

    # -- quota accounting

    def cost(self, seq: Sequence, entry: _Entry, q: int) -> int:
        """What admitting `seq` to queue q takes from its quota."""
        shared = self.p.share_adapter_tokens and self.holders.get((q, seq.adapter), 0) > 0
        return entry.need - entry.adapter_need if shared else entry.need

    def _charge(self, seq: Sequence, entry: _Entry) -> int:
        cost = self.cost(seq, entry, entry.queue)
        self.used[entry.queue] += cost
        key = (entry.queue, seq.adapter)
        self.holders[key] = self.holders.get(key, 0) + 1
        return cost

    def _uncharge(self, seq: Sequence, entry: _Entry) -> None:
        if entry.queue >= len(self.used):
            return
        key = (entry.queue, seq.adapter)
        self.holders[key] = self.holders.get(key, 1) - 1
        if self.holders[key] <= 0:
            del self.holders[key]
        self.used[entry.queue] -= self.cost(seq, entry, entry.queue)

    # -- admission

    def admit(self, now: float, try_admit: TryAdmit) -> None:
        """Phase 0, only with `starve_s` set (not in the paper, off by default): requests
        that waited starve_s, oldest first, over quota. Phase 1: each queue, smallest first,
        within its quota; the unused quota of the queues left empty is spare. Phase 2: the
        spare, smallest queue first. A request that does not fit (FULL) ends its own
        queue's turn, not the others' (§4.1: every iteration tries every queue)."""
        self.now = now
        self._maybe_refresh(now)
        if self.p.starve_s is not None and self._admit_starving(now, try_admit):
            return
        spare = 0
        for q in range(len(self.queues)):
            room = self.quotas[q] - self.used[q]
            consumed = self._put(q, room, now, try_admit)
            if not self.queues[q]:
                spare += max(0, room - consumed)
        for q in range(len(self.queues)):
            if spare <= 0:
                return
            spare -= self._put(q, spare, now, try_admit)

    def _admit_starving(self, now: float, try_admit: TryAdmit) -> bool:
        """True if the batch is full."""
        waited = [s for s, e in self.entries.items() if now - e.enqueued >= self.p.starve_s]
        # stable: ties keep arrival order (the run is the same every time)
        for seq in sorted(waited, key=lambda s: self.entries[s].enqueued):
            entry = self.entries[seq]
            result = try_admit(seq)
            if result is Admit.FULL:
                return True
            if result is Admit.OK:
                self.queues[entry.queue].remove(seq)
                del self.entries[seq]
                self.bypassed.pop(seq, None)
                entry.started = now
                self._charge(seq, entry)
                self.running[seq] = entry
                self.num_starving += 1
        return False

    def _put(self, q: int, tokens: int, now: float, try_admit: TryAdmit) -> int:
        """Admit from queue q, oldest first, within `tokens`. A request whose adapter has no
        room may be overtaken by a younger one only while the younger is predicted to
        finish before memory for the older frees up, and at most max_bypass times (the
        starvation guard). A queue with nothing running may start its head over quota,
        so that a quota smaller than one request cannot starve the queue."""
        consumed = 0
        admitted: list[Sequence] = []
        blocked: Sequence | None = None
        wait = 0.0  # decode steps until memory for `blocked` frees up
        for seq in self.queues[q]:
            entry = self.entries[seq]
            if self.cost(seq, entry, q) > tokens - consumed and self.used[q] > 0:
                break
            if blocked is not None and not self._may_overtake(self.entries[blocked], wait, entry):
                break
            result = try_admit(seq)
            if result is Admit.OK:
                admitted.append(seq)
                entry.started = now
                consumed += self._charge(seq, entry)
                self.running[seq] = entry
                if blocked is not None:
                    self.entries[blocked].overtaken += 1
                    self.entries[blocked].bypassers.append(seq)
                    self.bypassed[blocked] = None
                    self.num_bypasses += 1
            elif result is Admit.FULL:
                break
            elif result is Admit.NO_ROOM and blocked is None:
                blocked, wait = seq, self._memory_wait(seq)
            # LOADING / ADAPTER_CAP: it waits for its adapter, the others go on
        for seq in admitted:
            self.queues[q].remove(seq)
            del self.entries[seq]
            self.bypassed.pop(seq, None)
        return consumed

    def to_squash(self, now: float, room: Room) -> list[Sequence]:
        """§4.3.3: a bypass bets that the younger request finishes before memory for the
        blocked one frees up. When the bet is lost — the blocked request would fit if
        (some of) its running bypassers left, and does not fit without them — those
        bypassers are squashed (preempted, to run again later, right behind it): the
        most recently admitted first, as few as make room."""
        self.room = room
        if not self.p.squash:
            return []
        victims: list[Sequence] = []
        for blocked in list(self.bypassed):
            entry = self.entries[blocked]
            entry.bypassers = [s for s in entry.bypassers if s in self.running]
            if not entry.bypassers:
                del self.bypassed[blocked]
                continue
            if room(blocked, []):
                continue  # memory is there already: admission takes it
            chosen: list[Sequence] = []
            for seq in reversed(entry.bypassers):  # appended as admitted
                chosen.append(seq)
                if room(blocked, victims + chosen):
                    break
            else:
                continue  # even all of them would not make room: let them run
            for seq in chosen:
                entry.bypassers.remove(seq)
                self.running[seq].behind = blocked
            victims += chosen
            self.num_squashes += len(chosen)
        return victims

    def _may_overtake(self, blocked: _Entry, wait: float, younger: _Entry) -> bool:
        """§4.3.3: "Chameleon allows R2 to bypass R1 only if the former [the time until the
        memory needed by R1 becomes available] is longer than the latter [R2's execution]";
        `max_bypass` caps it (not in the paper)."""
        if blocked.overtaken >= self.p.max_bypass:
            return False
        return younger.size.output + 1 <= wait

    def _memory_wait(self, blocked: Sequence) -> float:
        """Decode steps until memory for `blocked` frees up: the running requests leave in
        the order they are predicted to finish, and the wait is that of the first whose
        leaving (with those before it) makes room for it; inf if none would. Before any
        `room` is known, the first to finish."""
        order = sorted(
            ((max(1, e.size.output - len(s.output_ids)), s) for s, e in self.running.items()),
            key=lambda pair: pair[0],
        )
        if not order:
            return 0
        if self.room is None:
            return order[0][0]
        leaving: list[Sequence] = []
        for steps, seq in order:
            leaving.append(seq)
            if self.room(blocked, leaving):
                return steps
        return math.inf
