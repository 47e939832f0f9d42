"""Untrusted file work — extracting an archive, reading safetensors headers and adapter
configs, copying from a registration path — in a child process with a time and a memory
limit, so that one upload cannot stall or starve the tenant API.

A thread is not enough: a parser that holds the GIL (CPython's tarfile regex, CVE-2024-6232;
`json` on a deep document) stalls the event loop with it, and a thread cannot be stopped. A
child is forked from a forkserver that has the registry's modules imported (a few ms per
call), runs one function, sends back its result or its `AdapterRejected`, and is killed if
it outlives `timeout_s`. Its address space may grow by at most `memory_bytes`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from loraplex.registry.errors import AdapterRejected, Invalid, TooLarge

T = TypeVar("T")

# Imported once in the server, so that a forked child imports nothing: "__main__" (as
# multiprocessing does by default; in a Ray actor that is Ray) and the modules whose
# functions run in workers (a child that imported fastapi itself would take ~0.5 s).
_PRELOAD = [
    "__main__",
    "loraplex.registry.validation",
    "loraplex.registry.paths",
    "loraplex.registry.uploads",
]
_context_lock = threading.Lock()
_context: Any = None


@dataclass(frozen=True, slots=True)
class WorkLimits:
    timeout_s: float  # wall time of one call, fork included
    memory_bytes: int  # address space the call may add to the forked worker's

    def __post_init__(self) -> None:
        assert self.timeout_s > 0 and self.memory_bytes > 0


class WorkerFailed(RuntimeError):
    """The worker raised something other than a refusal (a bug): the traceback is the message."""


async def run_isolated(limits: WorkLimits, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a fresh child process; its AdapterRejected is raised here. `fn` and
    `args` must pickle (module-level functions, paths, plain data)."""
    context = await asyncio.to_thread(_forkserver)
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_work, args=(sender, limits.memory_bytes, fn, args))
    try:
        await asyncio.to_thread(child.start)
        sender.close()
        if not await _readable(receiver, limits.timeout_s):
            raise TooLarge(
                f"processing the adapter took longer than {limits.timeout_s:g} s "
                "(work_timeout_s); nothing was stored",
            )
        try:
            outcome, value = receiver.recv()
        except EOFError:
            raise _died(child) from None
    finally:
        sender.close()
        receiver.close()
        if child.pid is not None:
            if child.is_alive():  # past its time, or this call was cancelled
                child.kill()
            await asyncio.to_thread(child.join)
    if outcome == "ok":
        return value
    if outcome == "rejected":
        raise value
    raise WorkerFailed(value)


def _forkserver() -> Any:
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(_PRELOAD)
            _context = context
        return _context


async def _readable(connection: Connection, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = connection.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(True))
    try:
        await asyncio.wait_for(ready, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _died(child: Any) -> Exception:
    child.join(1)
    if child.exitcode == -9:  # SIGKILL: the kernel's OOM killer, or an operator
        return TooLarge("processing the adapter was killed (out of memory?); nothing was stored")
    return WorkerFailed(f"the registry's worker process died (exit code {child.exitcode})")


def _work(sender: Connection, memory_bytes: int, fn: Callable[..., Any], args: tuple) -> None:
    _limit_address_space(memory_bytes)
    try:
        result: tuple[str, Any] = ("ok", fn(*args))
    except AdapterRejected as e:
        result = ("rejected", e)
    except MemoryError:
        result = ("rejected", TooLarge(_MEMORY_MESSAGE.format(memory_bytes)))
    except RecursionError:
        message = "a JSON document in the adapter is nested too deeply"
        result = ("rejected", Invalid(message))
    except OSError as e:  # a file that changed or vanished under the reader
        message = f"the adapter's files could not be read ({e.strerror or type(e).__name__})"
        result = ("rejected", Invalid(message))
    except BaseException:
        result = ("failed", traceback.format_exc())
    sender.send(result)
    sender.close()


_MEMORY_MESSAGE = (
    "processing the adapter needs more than {} bytes of memory (work_memory_bytes); "
    "nothing was stored"
)


def _limit_address_space(extra: int) -> None:
    """RLIMIT_AS at what is mapped now plus `extra` (Linux; elsewhere no limit)."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra if hard == resource.RLIM_INFINITY else min(hard, mapped + extra)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
