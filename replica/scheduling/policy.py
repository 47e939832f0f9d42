"""Admission policies: which waiting requests join the running batch, in what order.

Pure objects: they hold the waiting requests and call `try_admit(seq)`, which the
`Scheduler` implements over the real resources (step token budget, sequence cap,
distinct-adapter cap, KV blocks, adapter residency) and answers with an `Admit`. Time
comes in as `now` (the scheduler's injected clock), so the engine and the simulator drive
the same objects.

- `FIFO`: arrival order; the first request that cannot start blocks the rest (S-LoRA, vLLM),
  except one whose adapter is being loaded: it waits aside, keeping its place, while the
  others pass, so a read from the artifact store (100s of ms) holds up only its own
  requests, as a request waiting for its adapter outside the engine would.
- `SJFAging`: shortest predicted output first, aged by waiting time so nothing starves;
  a request whose adapter is being loaded waits aside as in FIFO.
- `Chameleon` (sched_chameleon.py): multi-level queues by weighted request size (seed 004
  §4.3): K-means cut-offs, per-queue token quotas, two-phase admission, opportunistic
  bypass.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Protocol

from loraplex.replica.scheduling.queue_math import (
    OutputPredictor,
)
from loraplex.replica.sequence import Sequence


class Admit(Enum):
    OK = "ok"
    FULL = "full"  # the step, the batch or the KV pool is full: admit nothing more
    ADAPTER_CAP = "adapter_cap"  # the batch already holds max_loras_per_batch adapters
    LOADING = "loading"  # its adapter is being copied to the device
    NO_ROOM = "no_room"  # its adapter does not fit even after evicting every idle one


TryAdmit = Callable[[Sequence], Admit]
# room(waiting, leaving): would `waiting` fit (its adapter, its first step's KV) if the
# running requests `leaving` were preempted?
Room = Callable[[Sequence, list[Sequence]], bool]


class QueuePolicy(Protocol):
    name: str

    def add(self, seq: Sequence, now: float) -> None: ...

    def requeue(self, seq: Sequence, now: float) -> None:
        """A preempted request comes back; it keeps its place (it arrived long ago)."""

    def remove(self, seq: Sequence) -> None: ...

    def waiting(self) -> list[Sequence]:
        """The waiting requests in the order the policy would admit them."""

    def admit(self, now: float, try_admit: TryAdmit) -> None: ...

    def left(self, seq: Sequence, now: float, finished: bool) -> None:
        """A running request finished (or was preempted: finished=False)."""

    def to_squash(self, now: float, room: Room) -> list[Sequence]:
        """Running requests to preempt before this step's admission (Chameleon's squash)."""

    def __len__(self) -> int: ...


class FIFO:
    name = "fifo"

    def __init__(self):
        self.queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, seq: Sequence, now: float) -> None:
        self.queue.append(seq)

    def requeue(self, seq: Sequence, now: float) -> None:
        self.queue.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self.queue.remove(seq)

    def waiting(self) -> list[Sequence]:
        return list(self.queue)

    def admit(self, now: float, try_admit: TryAdmit) -> None:
        aside: list[Sequence] = []  # waiting for their adapter's load, in order
        while self.queue:
            result = try_admit(self.queue[0])
            if result is Admit.OK:
                self.queue.popleft()
            elif result is Admit.LOADING:
                aside.append(self.queue.popleft())
            else:
                break
        self.queue.extendleft(reversed(aside))

    def left(self, seq: Sequence, now: float, finished: bool) -> None:
        pass

    def to_squash(self, now: float, room: Room) -> list[Sequence]:
        return []


class SJFAging:
    """Priority = predicted output tokens − aging · seconds waited; lowest first, strictly
    (the first that cannot start blocks the rest, and one whose adapter is loading waits
    aside, as in FIFO). Since every waiting request
    ages at the same rate, the order is that of predicted − aging · enqueue time: a heap."""

    name = "sjf"

    def __init__(self, predictor: OutputPredictor, aging_tokens_per_s: float = 10.0):
        self.predictor = predictor
        self.aging = aging_tokens_per_s
        self._heap: list[tuple[float, int, Sequence]] = []
        self._key: dict[Sequence, tuple[float, int]] = {}
        self._ticket = itertools.count()

    def __len__(self) -> int:
        return len(self._key)

    def add(self, seq: Sequence, now: float) -> None:
        predicted = self.predictor.predict(seq.adapter, seq.params.max_tokens)
        key = (predicted + self.aging * now, next(self._ticket))
        self._key[seq] = key
        heapq.heappush(self._heap, (*key, seq))

    def requeue(self, seq: Sequence, now: float) -> None:
        key = (-float("inf"), next(self._ticket))  # preempted: first again
        self._key[seq] = key
        heapq.heappush(self._heap, (*key, seq))

    def remove(self, seq: Sequence) -> None:
        del self._key[seq]  # its heap entry is dropped when it surfaces

    def _top(self) -> Sequence | None:
        while self._heap:
            prio, ticket, seq = self._heap[0]
            if self._key.get(seq) == (prio, ticket):
                return seq
            heapq.heappop(self._heap)
        return None

    def waiting(self) -> list[Sequence]:
        return [seq for p, t, seq in sorted(self._heap) if self._key.get(seq) == (p, t)]

    def admit(self, now: float, try_admit: TryAdmit) -> None:
        aside: list[tuple[float, int, Sequence]] = []  # waiting for their adapter's load
        while (seq := self._top()) is not None:
            result = try_admit(seq)
            if result is Admit.OK:
                heapq.heappop(self._heap)
                del self._key[seq]
            elif result is Admit.LOADING:
                aside.append(heapq.heappop(self._heap))
            else:
                break
        for item in aside:
            heapq.heappush(self._heap, item)

    def left(self, seq: Sequence, now: float, finished: bool) -> None:
        if finished:
            self.predictor.observe(seq.adapter, len(seq.output_ids))

    def to_squash(self, now: float, room: Room) -> list[Sequence]:
        return []
