"""How adapter loads reach the device: the copy runs beside the compute.

A `Transfer` takes copy jobs and reports which have finished. The adapter cache submits a
job when it starts a load and collects finished ones at the start of each schedule.

- `Immediate`: the copy runs at submit (no overlap; tests and small tools).
- `CopyThread`: one background thread (a CUDA copy stream on GPU). `done()` joins the
  copies submitted so far, so a load started while scheduling step k overlaps step k's
  forward and is ready for step k+1 — the same schedule on every run. A job submitted
  with `join=False` (a load that first reads the adapter from the artifact store again:
  tens to hundreds of ms behind a network store) runs on a second thread and `done()`
  reports it once it has finished: the engine keeps stepping meanwhile, so only that
  adapter's requests wait for the read, not the whole batch (as the simulator models it).
  `wait(timeout)` waits for one of those, for an engine with nothing else to run.
- The simulator's link model (benchmarks/sim) finishes a load after bytes / bandwidth,
  sharing the link among concurrent loads.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol

import torch

from loraplex.replica.cpu_threads import serial_torch_ops


class Transfer(Protocol):
    def submit(
        self, token: object, nbytes: int, job: Callable[[], None], join: bool = True
    ) -> None: ...

    def done(self) -> list[object]:
        """Tokens of the jobs finished since the last call."""

    def wait(self, timeout_s: float) -> None:
        """Return once a job not joined by `done()` has finished, or after `timeout_s`."""


class Immediate:
    def __init__(self):
        self._done: list[object] = []

    def submit(
        self, token: object, nbytes: int, job: Callable[[], None], join: bool = True
    ) -> None:
        job()
        self._done.append(token)

    def done(self) -> list[object]:
        done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float) -> None:
        return None  # every job finished at submit


class CopyThread:
    def __init__(self, device: torch.device):
        # beside the compute, on a thread of their own, not on the compute's cores (and a
        # parallel copy here would slow every step after it: replica/cpu_threads.py)
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="loraplex-copy", initializer=serial_torch_ops
        )
        self._reads = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="loraplex-read", initializer=serial_torch_ops
        )
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: list[tuple[object, Future, bool]] = []

    def submit(
        self, token: object, nbytes: int, job: Callable[[], None], join: bool = True
    ) -> None:
        pool = self._pool if join else self._reads
        self._jobs.append((token, pool.submit(self._run, job), join))

    def _run(self, job: Callable[[], None]) -> None:
        if self._stream is None:
            job()
            return
        with torch.cuda.stream(self._stream):
            job()
        self._stream.synchronize()

    def done(self) -> list[object]:
        finished, waiting = [], []
        for token, future, join in self._jobs:
            if join or future.done():
                future.result()  # re-raises a failed copy (e.g. an artifact that went missing)
                finished.append(token)
            else:
                waiting.append((token, future, join))
        self._jobs = waiting
        return finished

    def wait(self, timeout_s: float) -> None:
        pending = [future for _, future, join in self._jobs if not join]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
