"""Chameleon's multi-level-queue admission policy (seed 004 §4.3), a `QueuePolicy`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
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


@dataclass(slots=True)
class _Entry:
    wrs: float
    need: int  # tokens it holds while running: input + predicted output + its adapter
    adapter_need: int  # of which its adapter's
    predicted: int
    enqueued: float
    queue: int = 0
    started: float = 0.0  # admitted (last, if preempted): D is measured from here
    overtaken: int = 0
    bypassers: list[Sequence] = field(default_factory=list)  # younger ones that overtook it
    behind: Sequence | None = None  # squashed for this request: requeued right after it


class Chameleon:
    """Multi-level queues. `capacity()` is the tokens the pool can hold (the quotas split
    it); `adapter_bytes(name)` and `adapter_tokens(name)` size a request's adapter (None:
    no adapter); `max_adapter_bytes()` normalises WRS."""

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
        self.arrivals: deque[tuple[float, float, int]] = deque(maxlen=params.window)
        self.served: deque[tuple[float, float]] = deque(maxlen=params.window)  # (wrs, s)
        self.last_refresh: float | None = None
        self.wcss: list[float] = []
        self.num_bypasses = 0
        self.num_starving = 0  # admitted by the starvation guard
        self.num_squashes = 0
        self.bypassed: dict[Sequence, None] = {}  # waiting requests with running bypassers

    def __len__(self) -> int:
        return len(self.entries)

    def queue_of(self, wrs: float) -> int:
        return int(np.searchsorted(self.cutoffs, wrs, side="right"))

    def add(self, seq: Sequence, now: float) -> None:
        predicted = self.predictor.predict(seq.adapter, seq.params.max_tokens)
        size = self.adapter_bytes(seq.adapter)
        wrs = weighted_request_size(
            len(seq.prompt_ids),
            predicted,
            size,
            self.max_len,
            self.max_len,
            self.max_adapter_bytes(),
            self.p.a,
            self.p.b,
        )
        adapter_need = self.adapter_tokens(seq.adapter)
        need = len(seq.prompt_ids) + predicted + adapter_need
        entry = _Entry(wrs, need, adapter_need, predicted, now, self.queue_of(wrs))
        self.entries[seq] = entry
        self.arrivals.append((now, wrs, need))
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
        return [seq for q in self.queues for seq in q]

    def left(self, seq: Sequence, now: float, finished: bool) -> None:
        entry = self.running.pop(seq)
        self._uncharge(seq, entry)
        if finished:
            self.predictor.observe(seq.adapter, len(seq.output_ids))
            self.served.append((entry.wrs, now - entry.started))
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
        """Re-cluster the recent request sizes, re-file the waiting requests, re-split the
        token capacity."""
        self.last_refresh = now
        sizes = np.array([w for _, w, _ in self.arrivals])
        self.cutoffs, self.wcss = choose_cutoffs(sizes, self.p.k_max, self.p.elbow)
        k = len(self.cutoffs) + 1
        waiting = sorted(self.entries.items(), key=lambda kv: kv[1].enqueued)
        self.queues = [deque() for _ in range(k)]
        for seq, entry in waiting:
            entry.queue = self.queue_of(entry.wrs)
            self.queues[entry.queue].append(seq)
        self.used = [0] * k
        self.holders = {}
        for seq, entry in self.running.items():
            entry.queue = self.queue_of(entry.wrs)
            self._charge(seq, entry)
        self.quotas = token_quotas(self.queue_loads(now), self.capacity(), self.p.slo_s)

    def queue_loads(self, now: float) -> list[QueueLoad]:
        k = len(self.cutoffs) + 1
        span = max(now - self.arrivals[0][0], 1e-9) if self.arrivals else 1.0
        sizes: list[list[int]] = [[] for _ in range(k)]
        for _, wrs, need in self.arrivals:
            sizes[self.queue_of(wrs)].append(need)
        durations: list[list[float]] = [[] for _ in range(k)]
        for wrs, seconds in self.served:
            durations[self.queue_of(wrs)].append(seconds)
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
        """Phase 0 (the starvation guard): requests that waited starve_s, oldest first, over
        quota — quotas are in tokens, and a busy small queue can still take every batch
        slot. Phase 1: each queue, smallest first, within its quota; the unused quota of
        the queues left empty is spare. Phase 2: the spare, smallest queue first."""
        self._maybe_refresh(now)
        if self._admit_starving(now, try_admit):
            return
        spare = 0
        for q in range(len(self.queues)):
            room = self.quotas[q] - self.used[q]
            consumed, full = self._put(q, room, now, try_admit)
            if full:
                return
            if not self.queues[q]:
                spare += max(0, room - consumed)
        for q in range(len(self.queues)):
            if spare <= 0:
                return
            consumed, full = self._put(q, spare, now, try_admit)
            spare -= consumed
            if full:
                return

    def _admit_starving(self, now: float, try_admit: TryAdmit) -> bool:
        """True if the batch is full."""
        limit = self.p.starve_s if self.p.starve_s is not None else self.p.slo_s
        waited = [s for s, e in self.entries.items() if now - e.enqueued >= limit]
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

    def _put(self, q: int, tokens: int, now: float, try_admit: TryAdmit) -> tuple[int, bool]:
        """Admit from queue q, oldest first, within `tokens`. A request whose adapter has no
        room may be overtaken by a younger one only while the younger is predicted to
        finish before memory for the older frees up, and at most max_bypass times (the
        starvation guard). A queue with nothing running may start its head over quota,
        so that a quota smaller than one request cannot starve the queue."""
        consumed = 0
        admitted: list[Sequence] = []
        blocked: Sequence | None = None
        full = False
        for seq in self.queues[q]:
            entry = self.entries[seq]
            if self.cost(seq, entry, q) > tokens - consumed and self.used[q] > 0:
                break
            if blocked is not None and not self._may_overtake(self.entries[blocked], entry):
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
                full = True
                break
            elif result is Admit.NO_ROOM and blocked is None:
                blocked = seq
            # LOADING / ADAPTER_CAP: it waits for its adapter, the others go on
        for seq in admitted:
            self.queues[q].remove(seq)
            del self.entries[seq]
            self.bypassed.pop(seq, None)
        return consumed, full

    def to_squash(self, now: float, room: Room) -> list[Sequence]:
        """§4.3.3: a bypass bets that the younger request finishes before memory for the
        blocked one frees up. When the bet is lost — the blocked request would fit if
        (some of) its running bypassers left, and does not fit without them — those
        bypassers are squashed (preempted, to run again later, right behind it): the
        most recently admitted first, as few as make room."""
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

    def _may_overtake(self, blocked: _Entry, younger: _Entry) -> bool:
        if blocked.overtaken >= self.p.max_bypass:
            return False
        # decode steps until some running request (predicted) finishes and frees memory
        eta = min(
            (max(1, e.predicted - len(s.output_ids)) for s, e in self.running.items()), default=0
        )
        return younger.predicted + 1 <= eta
