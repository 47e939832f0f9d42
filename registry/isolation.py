"""Untrusted file work — extracting an archive, reading safetensors headers and adapter
configs, copying from a registration path — in a child process with a time and a memory
limit, so that one upload cannot stall or starve the tenant API.

A thread is not enough: a parser that holds the GIL (CPython's tarfile regex, CVE-2024-6232;
`json` on a deep document) stalls the event loop with it, and a thread cannot be stopped.

Each API process starts one helper, `python -m loraplex.registry.isolation SOCKET`: a small
single-threaded server that imports the registry's file-work modules once, then forks a
child for every connection. The child sends its pid, reads one call (a module-level function
and its arguments, pickled), limits its address space, runs the call and sends back the
result or the refusal. The API kills the child if it outlives `timeout_s`. Multiprocessing's
own forkserver is not used: it makes every child import the API's main module again (for
`python -m loraplex.cluster.cli`, torch: seconds per call), or preloads it into the server
(a forked child of a process holding torch took ~5 s to answer). The helper exits when the
API process does (its stdin, a pipe from the API, reaches end of file).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from loraplex.errors import AdapterRejected, Invalid, TooLarge

T = TypeVar("T")

# What the helper imports once, so that a forked child imports nothing: the modules whose
# functions run in workers.
_PRELOAD = ("loraplex.adapter_format", "loraplex.registry.paths", "loraplex.registry.uploads")
_LENGTH = struct.Struct("<Q")
_PID = struct.Struct("<q")


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
    address = await asyncio.to_thread(_HELPER.address)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.timeout_s
    reader, writer = await asyncio.open_unix_connection(address)
    pid, answered = None, False
    try:
        request = pickle.dumps((fn, args, limits))
        writer.write(_LENGTH.pack(len(request)) + request)
        await writer.drain()
        try:
            async with asyncio.timeout_at(deadline):
                (pid,) = _PID.unpack(await reader.readexactly(_PID.size))
                (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                outcome, value = pickle.loads(await reader.readexactly(size))
            answered = True
        except TimeoutError:
            raise TooLarge(
                f"processing the adapter took longer than {limits.timeout_s:g} s "
                "(work_timeout_s); nothing was stored"
            ) from None
        except asyncio.IncompleteReadError:
            raise TooLarge(
                "the process reading the adapter died (out of memory?); nothing was stored"
            ) from None
    finally:
        writer.close()
        if pid is not None and not answered:  # past its time, or this call was cancelled
            _kill(pid)  # (once it has answered it exits, and its pid may be reused)
    if outcome == "ok":
        return value
    if outcome == "rejected":
        raise value
    raise WorkerFailed(value)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Helper:
    """This process's helper server, started on first use and again if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._socket = ""

    def address(self) -> str:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            return self._socket

    def _start(self) -> None:
        folder = tempfile.mkdtemp(prefix="loraplex-worker-")  # 0700: only this user connects
        self._socket = os.path.join(folder, "socket")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "loraplex.registry.isolation", self._socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        assert self._process.stdout is not None
        if self._process.stdout.readline() != b"ready\n":
            self._process.kill()
            raise RuntimeError("the registry's worker helper did not start (see its stderr)")


_HELPER = _Helper()


# ---------------------------------------------------------------- the helper process


def serve(socket_path: str) -> None:
    for module in _PRELOAD:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # nobody reads the pipe after this line
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            break  # the API process is gone
        if listener in ready:
            connection, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    _work(connection)
                finally:
                    os._exit(0)
            connection.close()
    listener.close()
    os.unlink(socket_path)


def _work(connection: socket.socket) -> None:
    stream = connection.makefile("rwb")
    stream.write(_PID.pack(os.getpid()))
    stream.flush()
    (size,) = _LENGTH.unpack(stream.read(_LENGTH.size))
    fn, args, limits = pickle.loads(stream.read(size))
    signal.alarm(int(limits.timeout_s) + 5)  # never outlive the API's deadline for long
    _limit_address_space(limits.memory_bytes)
    try:
        result: tuple[str, Any] = ("ok", fn(*args))
    except AdapterRejected as e:
        result = ("rejected", e)
    except MemoryError:
        result = ("rejected", TooLarge(_MEMORY_MESSAGE.format(limits.memory_bytes)))
    except RecursionError:
        result = ("rejected", Invalid("a JSON document in the adapter is nested too deeply"))
    except OSError as e:  # a file that changed or vanished under the reader
        message = f"the adapter's files could not be read ({e.strerror or type(e).__name__})"
        result = ("rejected", Invalid(message))
    except BaseException:
        result = ("failed", traceback.format_exc())
    reply = pickle.dumps(result)
    stream.write(_LENGTH.pack(len(reply)) + reply)
    stream.flush()


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


if __name__ == "__main__":
    serve(sys.argv[1])
