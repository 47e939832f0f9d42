"""The artifact tier's read model: how long a replica's reads from the artifact store take.

A replica on one machine reads adapters from a local folder in milliseconds; behind a network
store (NFS, EFS, an object store) the same read costs a latency and the store's bandwidth,
50-500 ms for 7B-70B adapters. `ReadPacer` makes local reads take what the model says: a
read finishes no earlier than

    finish = max(read started + latency_s, previous read's finish) + bytes / bytes_per_s

so one replica's reads share its bandwidth one after another (one stream to the store),
each paying the latency beside the others. The actual read runs first; only the rest of
the modelled time is slept. Off (no pacer) unless configured: then nothing is added.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReadModel:
    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self):
        if not self.bytes_per_s > 0 or not self.latency_s >= 0:
            raise ValueError(
                f"a read model needs bytes_per_s > 0 and latency_s >= 0, got "
                f"{self.bytes_per_s} and {self.latency_s}"
            )


class ReadPacer:
    def __init__(
        self,
        model: ReadModel,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.model = model
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self.reads = 0
        self.paced_s = 0.0  # time slept beyond the actual reads

    def finish_at(self, nbytes: int, started: float) -> float:
        """Reserve the store for a read of `nbytes` begun at `started`: when it finishes."""
        with self._lock:
            begin = max(started + self.model.latency_s, self._busy_until)
            self._busy_until = begin + nbytes / self.model.bytes_per_s
            self.reads += 1
            return self._busy_until

    def pace(self, nbytes: int, started: float) -> None:
        """Called when a read of `nbytes` begun at `started` has its data: wait out the rest."""
        rest = self.finish_at(nbytes, started) - self.clock()
        if rest > 0:
            self.paced_s += rest
            self.sleep(rest)
