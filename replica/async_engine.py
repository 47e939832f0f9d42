"""`Engine`: `LLMEngine` (replica/engine.py) stepping on its own thread, with async streaming
generation, adapter registration and cancellation for servers (the Serve deployment, the
in-process backend)."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from loraplex.replica.config import EngineConfig
from loraplex.replica.cpu_threads import flush_denormals, serially
from loraplex.replica.engine import AdapterInfo, LLMEngine
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import Continuation, RequestOutput


class Engine:
    """`LLMEngine` on a background thread, with async streaming for servers."""

    core: LLMEngine
    flushes_denormals: bool  # its thread's parallel ops flush denormals (cpu_threads.py)

    def __init__(self, cfg: EngineConfig):
        self._lock = threading.Lock()
        self._waiters = 0  # callers waiting for the lock; the step loop yields to them
        self._aborts: collections.deque[str] = collections.deque()  # thread-safe appends/pops
        self._work = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = False
        self._error: BaseException | None = None
        # the engine is built on the thread that steps it, the one thread whose torch ops
        # take the cores; helpers run theirs serially (replica/cpu_threads.py)
        self._build_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(cfg, ready), name="loraplex-engine", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._build_error is not None:
            raise self._build_error

    def _run(self, cfg: EngineConfig, ready: threading.Event) -> None:
        # before any torch op on this thread: its OpenMP team copies the mode when it starts
        self.flushes_denormals = flush_denormals()
        try:
            self.core = LLMEngine(cfg)
        except BaseException as e:
            self._build_error = e
            return
        finally:
            ready.set()
        self._step_loop()

    def _step_loop(self) -> None:
        while not self._closed:
            while self._waiters:  # a caller wants the lock: let it in between two steps
                time.sleep(0.0005)
            with self._lock:
                self._drain_aborts()
                busy = self.core.has_unfinished()
                try:
                    outputs = self.core.step() if busy else []
                except BaseException as e:  # the engine is broken: fail every stream, stop
                    self._error = e
                    outputs = []
            if self._error is not None:
                for loop, queue in list(self._streams.values()):
                    loop.call_soon_threadsafe(queue.put_nowait, self._error)
                return
            # first tokens first: every process on the way (this replica's loop, the ingress,
            # the HTTP proxy) relays chunks in the order they come, so a stream's first chunk
            # sent after this step's other chunks waits behind all of them in each
            for out in sorted(outputs, key=_continues):
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream[0].call_soon_threadsafe(stream[1].put_nowait, out)
            if not busy:
                self._work.wait(0.1)
                self._work.clear()

    def _drain_aborts(self) -> None:
        while self._aborts:
            self.core.abort(self._aborts.pop())

    def abort(self, request_id: str) -> None:
        """Abort a request; never blocks (safe from a cancelled task or a finalizer). Its
        pages are freed before the next step, or at once if the loop is idle."""
        self._aborts.append(request_id)
        if self._lock.acquire(blocking=False):
            try:
                self._drain_aborts()
            finally:
                self._lock.release()
        self._work.set()

    async def _locked(self, fn, *args):
        def call():
            self._waiters += 1
            try:
                with self._lock:
                    return fn(*args)
            finally:
                self._waiters -= 1

        return await asyncio.to_thread(serially(call))

    async def add_adapter(self, name: str, path: Path, version: str | None = None) -> AdapterInfo:
        weights = await asyncio.to_thread(serially(self.core.read_adapter), name, path)
        return await self._locked(self.core.register_adapter, weights, path, version)

    async def remove_adapter(self, name: str) -> None:
        await self._locked(self.core.remove_adapter, name)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
        continuation: Continuation | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs step by step; a consumer that falls behind the steps
        gets the outputs waiting for it as one (`RequestOutput.followed_by`), so a slow relay
        carries fewer, larger chunks instead of falling further behind. Chunks after the
        first with text are spaced so that each stream sends at most `stream_events_per_s_per_stream`
        and the replica at most `stream_events_per_s` (all streams together), each carrying
        what was made meanwhile. Closing the iterator early (or cancelling the task) aborts
        the request and frees its pages.
        `tenant` and `cache_salt`: see `LLMEngine.add_request`."""
        if self._error is not None or self._closed:
            raise RuntimeError(f"the engine is stopped: {self._error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add():
            seq = self.core.add_request(
                prompt,
                params,
                adapter,
                request_id,
                continuation=continuation,
                tenant=tenant,
                cache_salt=cache_salt,
            )
            self._streams[seq.request_id] = (loop, queue)
            return seq

        seq = await self._locked(add)
        self._work.set()
        finished = False
        held = None  # taken from the queue while coalescing, not foldable: next to yield
        last_yield: float | None = None  # None until the first text: it is never held
        try:
            while not finished:
                out = held if held is not None else await queue.get()
                held = None
                if isinstance(out, BaseException):
                    raise RuntimeError("the engine failed") from out
                if last_yield is not None and out.logits is None and not out.finished:
                    wait = last_yield + self._stream_gap() - loop.time()
                    if wait > 0:  # the outputs made meanwhile are folded in below
                        await asyncio.sleep(wait)
                while out.logits is None and not out.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException) or later.logits is not None:
                        held = later  # an error, or a step's logits, stays its own
                        break
                    out = out.followed_by(later)
                finished = out.finished
                yield out
                if out.text:  # chunks without text yet send a reader nothing: not paced
                    last_yield = loop.time()
        finally:
            self._streams.pop(seq.request_id, None)
            if not finished:
                self.abort(seq.request_id)  # queued first: a cancellation cannot lose it
                await self._locked(self._drain_aborts)  # then wait until it is applied

    def _stream_gap(self) -> float:
        """Seconds between one stream's chunks: at least 1 / `stream_events_per_s_per_stream`,
        and enough to keep this replica's chunks within `stream_events_per_s`, which the
        streams that make tokens share (the running sequences; queued ones send nothing)."""
        cfg = self.core.cfg
        each = cfg.stream_events_per_s_per_stream
        gap = 1.0 / each if each > 0 else 0.0
        if cfg.stream_events_per_s > 0:
            gap = max(gap, len(self.core.scheduler.running) / cfg.stream_events_per_s)
        return gap

    async def stats(self) -> dict:
        return await self._locked(self.core.stats)

    def failure(self) -> str | None:
        """Why the step loop is not running, or None while it is (for health checks)."""
        if self._error is not None:
            return repr(self._error)
        if self._closed:
            return "shut down"
        if not self._thread.is_alive():
            return "the engine thread exited"
        if self.core.tp is not None:
            return self.core.tp.failure()
        return None

    def shutdown(self) -> None:
        """Stop the loop; streams still open end with an error instead of waiting forever."""
        self._closed = True
        self._work.set()
        self._thread.join(timeout=30)
        self.core.close()
        stopped = RuntimeError("the engine was shut down")
        for loop, queue in list(self._streams.values()):
            loop.call_soon_threadsafe(queue.put_nowait, stopped)


def _continues(out: RequestOutput) -> bool:
    """Whether `out` follows text its stream already sent (False for a reader's first text, or
    a chunk that shows none yet: the ingress sends a reader no event without text)."""
    return len(out.text) > len(out.new_text)
