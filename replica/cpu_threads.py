"""Torch's CPU ops on a helper thread run on that thread alone.

Torch spreads a CPU op over OpenMP threads, and every thread that runs such an op becomes
the master of a team of its own, kept for as long as it lives. Once a process holds more
OpenMP threads than CPUs, GNU OpenMP (the runtime torch's wheels ship) cuts how long a
waiting team thread spins before it sleeps, from 300,000 iterations to 100 (its throttled
GOMP_SPINCOUNT), so every parallel op of the engine's step must wake its threads through
the kernel. Measured on 2 cores (2026-12-04): one parallel copy on the adapter copy thread
made a decode step's small batched matmuls 2.6-5x slower (23 -> 60 us) for as long as that
thread lived, and SmolLM2's LoRA step overhead 0.08 -> 0.18; GOMP_SPINCOUNT=100 alone
does the same, with no second team. A thread that works beside the compute must not take
the compute's cores anyway: the engine's thread keeps them, and a helper that calls
`serial_torch_ops` first runs its ops on itself.

torch.set_num_threads cannot say this: it sets the process's count, every thread's. The
OpenMP runtime's own omp_set_num_threads sets the calling thread's (nthreads-var is a
per-thread setting), which is what torch reads when it splits an op.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")

# the OpenMP runtimes torch is built against (GNU, Intel, LLVM)
_RUNTIMES = ("libgomp", "libiomp", "libomp")
_local = threading.local()


def serial_torch_ops() -> None:
    """From now on, torch's CPU ops on the calling thread run on it alone; every other
    thread keeps its count. Without a loaded OpenMP runtime (not Linux, or torch built
    without one) nothing changes."""
    if getattr(_local, "serial", False):
        return
    torch.get_num_threads()  # torch's first-use setup of this thread, which sets the count
    set_num_threads = _omp_set_num_threads()
    if set_num_threads is not None:
        set_num_threads(1)
    _local.serial = True


def serially(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn`, on whichever thread calls it, after `serial_torch_ops` (for asyncio.to_thread)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        serial_torch_ops()
        return fn(*args, **kwargs)

    return call


def flush_denormals() -> bool:
    """Flush denormal floats to zero on the calling thread (x86's FTZ and DAZ, through
    torch.set_flush_denormal), and say whether its parallel ops flush them too.

    A decode step's attention makes denormals: the softmax of a sharp row (a model's first
    token takes most of the weight) leaves many probabilities under float32's smallest
    normal, 1.2e-38, and the exps and products that reach them take the CPU's slow path.
    Measured on 2 cores (2026-12-05, SmolLM2's shapes at 130 tokens, 11% of the
    probabilities denormal): softmax 30 -> 16 us, the product with V 142-191 -> 100 us.
    Results change only where a value was under 1.2e-38.

    The mode is a thread's own (MXCSR). An OpenMP worker copies its master's when the
    master starts its team, at the master's first parallel op, and keeps it: so call this
    first on a thread, before any parallel torch op there. Called later, the thread's own
    share of each op flushes and its workers' do not: False."""
    if not torch.set_flush_denormal(True):
        return False  # a CPU without the mode
    # denormals by their bits (a float fill would be flushed here already), split over the
    # team's threads
    probe = torch.full((1 << 18,), 1 << 20, dtype=torch.int32).view(torch.float32)
    return int(torch.count_nonzero(probe * 2)) == 0


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """omp_set_num_threads of the OpenMP runtime this process has loaded, or None."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if not (path.startswith("/") and Path(path).name.startswith(_RUNTIMES)):
            continue
        function = getattr(ctypes.CDLL(path), "omp_set_num_threads", None)
        if function is not None:
            function.argtypes, function.restype = [ctypes.c_int], None
            return function
    return None
