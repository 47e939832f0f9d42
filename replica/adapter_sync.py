"""Keeps one replica's engine consistent with the adapter registry, version by version.

The registry (a `RegistryWatcher`'s snapshot and events) says which versions of which
adapters exist and which of them each name serves; this object decides which versions the
engine holds. The engine names each version by its id, `tenant/name@version`
(`protocol.adapter_id`), so two versions of one name are two adapters to it: their pages,
host copies and cached KV blocks never mix, and both can be resident at once.

    servable  a version the registry holds (a retained version, or what a name points to):
              a request naming it is served, read from the artifact store on first use
    target    a version a name serves new requests with (its current version, its canary)
    loaded    in the engine (host tier, maybe also the device pool)

Reads are lazy: a version is read when a request needs it; the targets of pinned names are
read at once. A version that stops being a target stays loaded while requests run on it and
is removed from the engine (its pages freed) when the last of them ends. A version the
registry deletes (its name deleted, or pruned) is removed at once: its running requests
finish, its queued ones are aborted by the engine, new ones get `AdapterNotFound`.

A request resolved by an ingress whose registry watch is ahead of this replica's carries
the revision it was resolved at (`GenerateRequest.adapter_revision`): an unknown version is
only called unknown once this replica's watch has reached that revision.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from loraplex.registry.models import AdapterRecord, AdapterVersion
from loraplex.replica.memory.adapter_cache import UnknownAdapter
from loraplex.replica.protocol import AdapterNotFound, adapter_id, parse_adapter_id

if TYPE_CHECKING:
    from loraplex.registry.artifacts import ArtifactStore
    from loraplex.registry.watch import RegistryEvent, RegistryWatcher
    from loraplex.replica.async_engine import Engine

log = logging.getLogger(__name__)


class AdapterSync:
    """catch_up_timeout_s  how long a request naming a version this replica does not know
    waits for the registry watch to reach the revision it was
    resolved at"""

    def __init__(
        self,
        engine: Engine,
        watcher: RegistryWatcher,
        artifacts: ArtifactStore,
        *,
        catch_up_timeout_s: float = 5.0,
    ):
        self.engine = engine
        self.watcher = watcher
        self.artifacts = artifacts
        self.catch_up_timeout_s = catch_up_timeout_s
        self._loaded: set[str] = set()  # version ids held in the engine
        self._loading: set[str] = set()
        self._active: collections.Counter[str] = collections.Counter()  # requests per id
        self._locks: dict[str, asyncio.Lock] = {}
        self._events: asyncio.Queue[RegistryEvent] | None = None
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.reads = 0  # adapters read from the artifact store into the host tier
        self.read_seconds = 0.0

    @property
    def mean_read_s(self) -> float | None:
        """The mean time of a read from the store (None before the first)."""
        return self.read_seconds / self.reads if self.reads else None

    # lifecycle

    def start(self) -> None:
        """Take the watcher's snapshot and follow its events (the watcher must be started).
        Subscribing and reading the snapshot happen with no await between them, so no
        event is missed."""
        assert self._task is None, "AdapterSync started twice"
        self._events = self.watcher.subscribe()
        for record in self.watcher.adapters():
            self._preload_targets(record)
        self._task = asyncio.create_task(self._follow(), name="loraplex-adapter-sync")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        if self._events is not None:
            self.watcher.unsubscribe(self._events)
            self._events = None

    # state read by routing stats (version ids)

    @property
    def registered(self) -> frozenset[str]:
        """Every servable version: each can be served here."""
        return frozenset(
            adapter_id(v.tenant, v.name, v.version)
            for record in self.watcher.adapters()
            for v in self.watcher.versions(record.tenant, record.name)
        )

    @property
    def host(self) -> frozenset[str]:
        """Versions whose weights are in the engine (host tier, maybe also on the device)."""
        return frozenset(self._loaded)

    @property
    def loading(self) -> frozenset[str]:
        """Versions being read into the engine now."""
        return frozenset(self._loading)

    @property
    def requests(self) -> dict[str, int]:
        """Requests held here per version: waiting for its read, queued or running."""
        return dict(self._active)

    # the request path

    @contextlib.asynccontextmanager
    async def serving(self, adapter: str, revision: int | None = None) -> AsyncIterator[None]:
        """Hold `adapter` (a version id) in the engine while inside: `ensure` it, and once
        the last request inside ends, remove it if no name serves it any more."""
        self._active[adapter] += 1
        try:
            await self.ensure(adapter, revision)
            yield
        finally:
            self._active[adapter] -= 1
            if not self._active[adapter]:
                del self._active[adapter]
                self._spawn(self._settle(adapter), f"settle {adapter}")

    async def ensure(self, adapter: str, revision: int | None = None) -> None:
        """Make `adapter` (a version id) servable by the engine, reading it on first use.
        AdapterNotFound if the registry does not hold that version (waiting first, up to
        catch_up_timeout_s, for the watch to reach `revision`), or deletes it meanwhile.
        Concurrent calls for one version read it once."""
        if self._servable(adapter) is None and revision is not None:
            if self.watcher.revision < revision:
                await self.watcher.wait_for_revision(revision, self.catch_up_timeout_s)
        while adapter not in self._loaded:
            lock = self._locks.setdefault(adapter, asyncio.Lock())
            async with lock:
                if adapter not in self._loaded:  # another caller may have loaded it
                    await self._load(adapter)

    def _servable(self, adapter: str) -> AdapterVersion | None:
        """The registry's record of the version `adapter` names. (The store writes a version
        before the alias naming it, so an alias is never seen without its version.)"""
        try:
            tenant, name, version = parse_adapter_id(adapter)
        except ValueError:
            return None
        return self.watcher.version(tenant, name, version)

    def _is_target(self, adapter: str) -> bool:
        tenant, name, version = parse_adapter_id(adapter)
        record = self.watcher.adapter(tenant, name)
        return record is not None and version in record.targets

    async def _load(self, adapter: str) -> None:
        """Read the version into the engine (under its lock). If the registry deletes it
        meanwhile, its weights are removed again and AdapterNotFound raised."""
        record = self._servable(adapter)
        if record is None:
            raise AdapterNotFound(f"adapter {adapter!r} is not registered")
        self._loading.add(adapter)
        started = time.monotonic()
        try:
            path = self.artifacts.path_of(record.artifact)
            await self.engine.add_adapter(adapter, path, record.version)
            self.reads += 1
            self.read_seconds += time.monotonic() - started
        finally:
            self._loading.discard(adapter)
        self._loaded.add(adapter)
        if self._servable(adapter) is None:
            await self._unload(adapter)
            raise AdapterNotFound(f"adapter {adapter!r} was deleted while it was read")
        log.info("adapter %s loaded from %s", adapter, record.artifact)

    async def _unload(self, adapter: str) -> None:
        self._loaded.discard(adapter)
        with contextlib.suppress(UnknownAdapter):
            await self.engine.remove_adapter(adapter)

    async def _settle(self, adapter: str) -> None:
        """Remove a loaded version that no request holds and no name serves (a deleted one
        goes whether or not requests hold it: the engine finishes the running ones)."""
        lock = self._locks.setdefault(adapter, asyncio.Lock())
        async with lock:
            if adapter not in self._loaded:
                return
            if self._servable(adapter) is None:
                reason = "deleted from the registry"
            elif adapter in self._active or self._is_target(adapter):
                return
            else:
                reason = "no name serves it and its last request ended"
            await self._unload(adapter)
        log.info("adapter %s removed (%s)", adapter, reason)

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
        """A change of a name or a version: settle the versions of that name held here, and
        read a pinned name's targets."""
        changed = event.value if event.value is not None else event.previous
        if not isinstance(changed, AdapterRecord | AdapterVersion):
            return
        if isinstance(event.value, AdapterRecord):
            self._preload_targets(event.value)
        owner = adapter_id(changed.tenant, changed.name, "")
        for adapter in sorted(a for a in self._loaded if a.startswith(owner)):
            await self._settle(adapter)

    def _preload_targets(self, record: AdapterRecord) -> None:
        if not record.pinned:
            return
        for version in sorted(record.targets):
            adapter = adapter_id(record.tenant, record.name, version)
            if adapter not in self._loaded:
                self._spawn(self._preload(adapter), f"preload {adapter}")

    async def _preload(self, adapter: str) -> None:
        try:
            await self.ensure(adapter)
        except AdapterNotFound:
            pass  # deleted before it was read
        except Exception:
            log.exception("adapter sync: preloading pinned adapter %s failed", adapter)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
