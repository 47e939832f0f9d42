"""Large untrusted JSON bodies parsed in a child process, so that parsing them never holds
the caller's interpreter.

`json.loads` holds the GIL from the first byte to the last: a thread does not help. A 4 MiB
body of two million token ids takes ~0.1-0.5 s to parse on a busy two-core machine, and eight
clients posting such bodies (each refused afterwards, on its length) kept an ingress's event
loop waiting for the interpreter, moving another tenant's time to first token from 0.02 s to
~1 s. In a child the parse costs the caller only the pipe: the bytes out, and back either the
value (pickled; a body that passes is one the ingress would read anyway) or the refusal. The
child refuses any array longer than `max_array_items` (for the inference routes: the
context window, or the messages' limit if larger), so an over-long list of ids never comes
back as millions of Python ints. It runs at a lower priority (nice 10), so that on a busy
host its parse yields the CPU to the serving processes.

Run as `python -m loraplex.json_process`: frames on stdin (`>II`: length, max array items;
then the bytes), replies on stdout (`>BI`: kind, length; then the payload).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any

from loraplex import strict_json

_REQUEST = struct.Struct(">II")
_REPLY = struct.Struct(">BI")
_VALUE, _NOT_STRICT, _NOT_JSON, _TOO_DEEP, _TOO_MANY = range(5)


class TooManyItems(strict_json.NotStrictJSON):
    def __init__(self, count: int, limit: int, path: tuple[str | int, ...], why: str = ""):
        super().__init__(f"an array of {count} items; at most {limit}{why}", path)
        self.count, self.limit = count, limit


def loads_capped(data: bytes, max_array_items: int, why: str = "") -> Any:
    """`strict_json.loads`, and TooManyItems for an array longer than `max_array_items`
    (`why`, if given, ends its message)."""
    value = strict_json.loads(data)
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, list):
            if len(item) > max_array_items:
                raise TooManyItems(len(item), max_array_items, path, why)
            stack.extend(((*path, i), c) for i, c in enumerate(item) if isinstance(c, list | dict))
        elif isinstance(item, dict):
            stack.extend(((*path, k), c) for k, c in item.items() if isinstance(c, list | dict))
    return value


class JsonProcess:
    """One child parsing one body at a time. The pipe's reads and writes run on a worker
    thread (they release the GIL; the event loop goes on), with plain `subprocess`, so
    the child does not depend on any event loop's child watcher: the ingress may be served
    from more than one loop, or thread. Started at the first body and again after a child
    dies; a body whose child dies is parsed on the thread instead, so nothing is refused
    for the child's sake."""

    def __init__(self, max_array_items: int, why: str = ""):
        self.max_array_items, self.why = max_array_items, why
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()

    async def loads(self, data: bytes) -> Any:
        """As `loads_capped`: the value, or NotStrictJSON (TooManyItems for an over-long
        array), json.JSONDecodeError (not JSON at all), RecursionError (nested too
        deeply)."""
        return await asyncio.to_thread(self._loads, data)

    def _loads(self, data: bytes) -> Any:
        with self._lock:
            try:
                kind, payload = self._ask(data)
            except (OSError, EOFError, ValueError):
                self._stop()  # a dead or confused child: the next body starts another
                return loads_capped(data, self.max_array_items, self.why)
        if kind == _VALUE:
            return pickle.loads(payload)
        if kind == _TOO_MANY:
            count, path = pickle.loads(payload)
            raise TooManyItems(count, self.max_array_items, tuple(path), self.why)
        if kind == _NOT_STRICT:
            problem, path = pickle.loads(payload)
            raise strict_json.NotStrictJSON(problem, tuple(path))
        if kind == _TOO_DEEP:
            raise RecursionError("JSON nested too deeply")
        raise json.JSONDecodeError(payload.decode("utf-8", "replace"), "", 0)

    def _ask(self, data: bytes) -> tuple[int, bytes]:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "loraplex.json_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        child = self._child
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(_REQUEST.pack(len(data), self.max_array_items))
        child.stdin.write(data)
        child.stdin.flush()
        kind, length = _REPLY.unpack(_read_exactly(child.stdout, _REPLY.size))
        if kind > _TOO_MANY:
            raise ValueError(f"json child replied kind {kind}")
        return kind, _read_exactly(child.stdout, length)

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()

    @property
    def pid(self) -> int | None:
        """The running child's process id (None before the first large body)."""
        child = self._child
        return None if child is None or child.poll() is not None else child.pid

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        with self._lock:
            child, self._child = self._child, None
            if child is None or child.poll() is not None:
                return
            assert child.stdin is not None
            child.stdin.close()  # the child exits at end of input
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _read_exactly(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError(f"the json child closed its output ({len(data)} of {n} bytes)")
    return data


def _serve(stdin, stdout) -> None:
    while header := stdin.read(_REQUEST.size):
        length, max_items = _REQUEST.unpack(header)
        data = stdin.read(length)
        try:
            kind, payload = _VALUE, pickle.dumps(loads_capped(data, max_items), protocol=5)
        except TooManyItems as e:
            kind, payload = _TOO_MANY, pickle.dumps((e.count, e.path))
        except strict_json.NotStrictJSON as e:
            kind, payload = _NOT_STRICT, pickle.dumps((e.problem, e.path))
        except RecursionError:
            kind, payload = _TOO_DEEP, b""
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            kind, payload = _NOT_JSON, str(e).encode()
        stdout.write(_REPLY.pack(kind, len(payload)))
        stdout.write(payload)
        stdout.flush()


if __name__ == "__main__":
    with contextlib.suppress(OSError):
        os.nice(10)
    _serve(sys.stdin.buffer, sys.stdout.buffer)
