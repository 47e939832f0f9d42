"""Keeps one replica's engine consistent with the adapter registry.

The registry (a `RegistryWatcher`'s snapshot and events) says which adapters exist; this
object decides which of them the engine holds. Registration is lazy: a record is only
remembered until a request needs it, then `ensure` reads its weights from the artifact
store into the engine's host tier. Pinned adapters are read at once. A deleted adapter is
removed from the engine at once: its running requests finish, its queued ones are aborted
by the engine, and new ones get `AdapterNotFound`. A new or restarted replica starts from
the watcher's snapshot, so it serves every registered adapter without a redeploy.

Adapters are named in the engine by their id, `tenant/name` (`protocol.adapter_id`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from loraplex.registry.models import AdapterRecord
from loraplex.replica.memory.adapter_cache import UnknownAdapter
from loraplex.replica.protocol import AdapterNotFound, adapter_id

if TYPE_CHECKING:
    from loraplex.registry.artifacts import ArtifactStore
    from loraplex.registry.watch import RegistryEvent, RegistryWatcher
    from loraplex.replica.async_engine import Engine

log = logging.getLogger(__name__)


class AdapterSync:
    def __init__(self, engine: Engine, watcher: RegistryWatcher, artifacts: ArtifactStore):
        self.engine = engine
        self.watcher = watcher
        self.artifacts = artifacts
        self._records: dict[str, AdapterRecord] = {}  # what the registry holds, by id
        self._loaded: dict[str, str] = {}  # id -> artifact held in the engine's host tier
        self._loading: set[str] = set()
        self._reads: dict[str, object] = {}  # id -> token of the read in flight
        self._locks: dict[str, asyncio.Lock] = {}
        self._events: asyncio.Queue[RegistryEvent] | None = None
        self._task: asyncio.Task[None] | None = None
        self._preloads: set[asyncio.Task[None]] = set()
        self.reads = 0  # adapters read from the artifact store into the host tier
        self.read_seconds = 0.0

    # lifecycle

    def start(self) -> None:
        """Take the watcher's snapshot and follow its events (the watcher must be started).
        Subscribing and reading the snapshot happen with no await between them, so no
        event is missed or applied twice."""
        assert self._task is None, "AdapterSync started twice"
        self._events = self.watcher.subscribe()
        for record in self.watcher.adapters():
            self._put(record)
        self._task = asyncio.create_task(self._follow(), name="loraplex-adapter-sync")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._preloads) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        if self._events is not None:
            self.watcher.unsubscribe(self._events)
            self._events = None

    # state read by routing stats (adapter ids)

    @property
    def registered(self) -> frozenset[str]:
        """Adapters the registry holds: every one of them can be served here."""
        return frozenset(self._records)

    @property
    def host(self) -> frozenset[str]:
        """Adapters whose weights are in the engine (host tier, maybe also on the device)."""
        return frozenset(self._loaded)

    @property
    def loading(self) -> frozenset[str]:
        """Adapters being read into the engine now."""
        return frozenset(self._loading)

    # the request path

    async def ensure(self, adapter: str) -> None:
        """Make `adapter` (an id) servable by the engine, reading it on first use.
        AdapterNotFound if the registry does not hold it (or deletes it meanwhile).
        Concurrent calls for one adapter read it once."""
        while not self._current(adapter):
            lock = self._locks.setdefault(adapter, asyncio.Lock())
            async with lock:
                if not self._current(adapter):  # another caller may have loaded it
                    await self._load(adapter, self._records[adapter])

    def _current(self, adapter: str) -> bool:
        """Whether the engine holds the registry's version; AdapterNotFound if none."""
        record = self._records.get(adapter)
        if record is None:
            raise AdapterNotFound(f"adapter {adapter!r} is not registered")
        return self._loaded.get(adapter) == record.artifact

    async def _load(self, adapter: str, record: AdapterRecord) -> None:
        """Read `record` into the engine (under the adapter's lock). A delete arriving
        meanwhile drops the read's token: the weights are removed again, and `ensure`
        either raises AdapterNotFound or reads a record registered since."""
        token = self._reads[adapter] = object()
        self._loading.add(adapter)
        started = time.monotonic()
        try:
            path = self.artifacts.path_of(record.artifact)
            await self.engine.add_adapter(adapter, path)
            self.reads += 1
            self.read_seconds += time.monotonic() - started
        finally:
            self._loading.discard(adapter)
            deleted = self._reads.pop(adapter, None) is not token
        if deleted:
            await self._unload(adapter)
            return
        self._loaded[adapter] = record.artifact
        log.info("adapter %s loaded from %s", adapter, record.artifact)

    async def _unload(self, adapter: str) -> None:
        self._loaded.pop(adapter, None)
        with contextlib.suppress(UnknownAdapter):
            await self.engine.remove_adapter(adapter)

    # registry events

    async def _follow(self) -> None:
        assert self._events is not None
        while True:
            event = await self._events.get()
            try:
                await self._apply(event)
            except Exception:  # one bad event must not stop the replica following
                log.exception("adapter sync: failed to apply %s %s", event.kind, event.key)

    async def _apply(self, event: RegistryEvent) -> None:
        if event.kind == "delete":
            if isinstance(event.previous, AdapterRecord):
                await self._delete(adapter_id(event.previous.tenant, event.previous.name))
        elif isinstance(event.value, AdapterRecord):
            self._put(event.value)

    def _put(self, record: AdapterRecord) -> None:
        """Remember a new or changed record. A changed artifact is read again on the next
        `ensure` (the engine keeps serving the old weights to requests that hold them)."""
        adapter = adapter_id(record.tenant, record.name)
        self._records[adapter] = record
        if record.pinned and not self._current(adapter):
            task = asyncio.create_task(self._preload(adapter), name=f"preload {adapter}")
            self._preloads.add(task)
            task.add_done_callback(self._preloads.discard)

    async def _preload(self, adapter: str) -> None:
        try:
            await self.ensure(adapter)
        except AdapterNotFound:
            pass  # deleted before it was read
        except Exception:
            log.exception("adapter sync: preloading pinned adapter %s failed", adapter)

    async def _delete(self, adapter: str) -> None:
        self._records.pop(adapter, None)
        self._reads.pop(adapter, None)
        lock = self._locks.get(adapter)
        if lock is not None and not lock.locked():
            del self._locks[adapter]
        if adapter in self._loaded:
            await self._unload(adapter)
            log.info("adapter %s removed (deleted from the registry)", adapter)
