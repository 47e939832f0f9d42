"""How adapter loads reach the device: the copy runs beside the compute.

A `Transfer` takes copy jobs and reports which have finished. The adapter cache submits a
job when it starts a load and collects finished ones at the start of each schedule.

- `Immediate`: the copy runs at submit (no overlap; tests and small tools).
- `CopyThread`: one background thread (a CUDA copy stream on GPU). `done()` joins the
  copies submitted so far, so a load started while scheduling step k overlaps step k's
  forward and is ready for step k+1 — the same schedule on every run.
- The simulator's link model (benchmarks/sim) finishes a load after bytes / bandwidth,
  sharing the link among concurrent loads.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch


class Transfer(Protocol):
    def submit(self, token: object, nbytes: int, job: Callable[[], None]) -> None: ...

    def done(self) -> list[object]:
        """Tokens of the jobs finished since the last call."""


class Immediate:
    def __init__(self):
        self._done: list[object] = []

    def submit(self, token: object, nbytes: int, job: Callable[[], None]) -> None:
        job()
        self._done.append(token)

    def done(self) -> list[object]:
        done, self._done = self._done, []
        return done


class CopyThread:
    def __init__(self, device: torch.device):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-copy")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: list[tuple[object, Future]] = []

    def submit(self, token: object, nbytes: int, job: Callable[[], None]) -> None:
        self._jobs.append((token, self._pool.submit(self._run, job)))

    def _run(self, job: Callable[[], None]) -> None:
        if self._stream is None:
            job()
            return
        with torch.cuda.stream(self._stream):
            job()
        self._stream.synchronize()

    def done(self) -> list[object]:
        jobs, self._jobs = self._jobs, []
        for _, future in jobs:
            future.result()  # re-raises a failed copy (e.g. an artifact that went missing)
        return [token for token, _ in jobs]
