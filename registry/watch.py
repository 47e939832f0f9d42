"""A local copy of the registry kept current by an etcd watch, and its change events.

Request paths read the snapshot (`adapter`, `adapters`, `tenant`), never etcd, so they keep
answering while etcd is down. The watch resumes from the last applied revision + 1 after any
disconnect or etcd restart: etcd replays what was missed, in order, once. If etcd compacted
that revision away, or its revision went backwards (restored or replaced), a full read
replaces the snapshot and the difference is emitted as events.

Subscribers get every event after the moment they subscribed, in revision order:
`dict(watcher.snapshot)` taken when subscribing, plus the events, equals the snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import aetcd
from aetcd import rpc
from aetcd.utils import prefix_range_end

from .etcd_client import EtcdConnection, EtcdSettings
from .models import PREFIX, AdapterRecord, AdapterVersion, RegistryValue, Tenant, tenant_key
from .store import decode_kv, read_prefix

__all__ = ["RegistryEvent", "RegistryWatcher"]

log = logging.getLogger(__name__)

WATCH_PREFIX = (PREFIX + "/").encode()
MAX_RECONNECT_DELAY_S = 2.0


@dataclass(frozen=True, slots=True)
class RegistryEvent:
    kind: Literal["add", "update", "delete"]
    key: str
    revision: int  # etcd revision of the change (of the full read, for a resync's deletes)
    value: RegistryValue | None  # new value; None on delete
    previous: RegistryValue | None  # value before; None on add


class RegistryWatcher:
    """Snapshot of every tenant and adapter, followed by one etcd watch."""

    def __init__(self, settings: EtcdSettings, *, reconnect_delay_s: float = 0.2):
        self.settings = settings
        self.reconnect_delay_s = reconnect_delay_s
        self.resyncs = 0  # full reads after the first: compactions and rewinds
        self._connection = EtcdConnection(settings)
        self._snapshot: dict[str, RegistryValue] = {}
        self._view = MappingProxyType(self._snapshot)
        self._adapters: dict[str, dict[str, AdapterRecord]] = {}  # tenant -> name -> record
        # (tenant, name) -> version -> its record
        self._versions: dict[tuple[str, str], dict[str, AdapterVersion]] = {}
        self._revision = 0
        self._subscribers: list[asyncio.Queue[RegistryEvent]] = []
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._connected = False
        self._resync_needed = False

    # lifecycle

    async def start(self) -> None:
        """Read everything (RegistryUnavailable if etcd does not answer within
        settings.timeout_s), then follow changes in a background task."""
        if self._task is not None:
            return
        values, revision = await self._connection.request(lambda c: read_prefix(c, PREFIX + "/"))
        self._replace(values, revision)
        self._task = asyncio.create_task(self._follow_forever(), name="loraplex-registry-watch")

    async def stop(self) -> None:
        """Stop following and close the connection. A watch cancelled while aetcd is still
        setting its stream up may not end (seen once in five test runs, when an app was
        stopped right after it started): it is waited for settings.timeout_s at most, and
        closing the connection ends it. Closing is bounded too (`_Client.close`): at most
        2 x settings.timeout_s in all."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=self.settings.timeout_s)
            if not done:
                log.warning("registry watch did not stop within %gs", self.settings.timeout_s)
        self._connected = False
        await self._connection.close()

    async def __aenter__(self) -> RegistryWatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    # reads (the request path)

    @property
    def snapshot(self) -> Mapping[str, RegistryValue]:
        """Read-only live view, keyed by etcd key."""
        return self._view

    @property
    def revision(self) -> int:
        """The etcd revision the snapshot reflects."""
        return self._revision

    @property
    def connected(self) -> bool:
        """Whether the watch stream is established (False while etcd is unreachable)."""
        return self._connected

    def tenant(self, name: str) -> Tenant | None:
        value = self._snapshot.get(tenant_key(name))
        return value if isinstance(value, Tenant) else None

    def adapter(self, tenant: str, name: str) -> AdapterRecord | None:
        return self._adapters.get(tenant, {}).get(name)

    def adapters(self, tenant: str | None = None) -> list[AdapterRecord]:
        """Sorted by (tenant, name)."""
        tenants = sorted(self._adapters) if tenant is None else [tenant]
        return [
            record
            for owner in tenants
            for _, record in sorted(self._adapters.get(owner, {}).items())
        ]

    def versions(self, tenant: str, name: str) -> list[AdapterVersion]:
        """The retained versions of one adapter, oldest first."""
        found = self._versions.get((tenant, name), {}).values()
        return sorted(found, key=lambda v: v.created_revision)

    def version(self, tenant: str, name: str, version: str) -> AdapterVersion | None:
        return self._versions.get((tenant, name), {}).get(version)

    # events

    def subscribe(self) -> asyncio.Queue[RegistryEvent]:
        """A queue of every event from now on, unbounded: drain it or unsubscribe."""
        queue: asyncio.Queue[RegistryEvent] = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[RegistryEvent]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(queue)

    async def wait_for_revision(self, revision: int, timeout: float) -> bool:
        """Whether the snapshot reaches `revision` within `timeout` seconds. Meant for the
        revision of a registry write (revisions of other keys produce no event here)."""
        if self._revision >= revision:
            return True
        waiter = (revision, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter[1], timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters.remove(waiter)

    # following etcd

    async def _follow_forever(self) -> None:
        delay = self.reconnect_delay_s
        while True:
            try:
                await self._follow()
            except aetcd.RevisionCompactedError as e:
                log.warning(
                    "registry watch: etcd compacted revision %d (kept from %d): full resync",
                    self._revision + 1,
                    e.compacted_revision,
                )
                self._resync_needed = True
                self._connected = False
                continue
            except Exception as e:  # any failure of the stream: reconnect and resume
                if self._connected:
                    log.warning("registry watch lost at revision %d: %r", self._revision, e)
                    delay = self.reconnect_delay_s
                else:
                    log.debug("registry watch: etcd still unreachable: %r", e)
            self._connected = False
            await self._connection.reset()
            await asyncio.sleep(delay)
            delay = min(2 * delay, max(MAX_RECONNECT_DELAY_S, self.reconnect_delay_s))

    async def _follow(self) -> None:
        client = await self._connection.client()
        current = await _current_revision(client, self.settings.timeout_s)
        if current < self._revision:
            log.warning(
                "etcd is at revision %d, behind the registry's %d (restored or replaced?): "
                "full resync",
                current,
                self._revision,
            )
            self._resync_needed = True
        if self._resync_needed:
            values, revision = await read_prefix(client, PREFIX + "/")
            self._replace(values, revision)
            self._resync_needed = False
            self.resyncs += 1
        watch = await client.watch_prefix(WATCH_PREFIX, start_revision=self._revision + 1)
        self._connected = True
        log.info("registry watch from revision %d on %s", self._revision + 1, client.endpoint)
        async for event in watch:
            self._apply(event)
        raise ConnectionError("etcd ended the watch stream")

    def _apply(self, event: aetcd.Event) -> None:
        key = event.kv.key.decode()
        revision = event.kv.mod_revision  # on a delete, the revision of the delete
        previous = self._snapshot.get(key)
        value = decode_kv(event.kv) if event.kind == "PUT" else None
        if value is not None:
            self._put(key, value)
            self._publish(
                RegistryEvent("update" if previous else "add", key, revision, value, previous)
            )
        elif previous is not None:  # deleted, or overwritten by something unreadable
            self._remove(key, previous)
            self._publish(RegistryEvent("delete", key, revision, None, previous))
        self._advance(revision)

    def _replace(self, values: dict[str, RegistryValue], revision: int) -> None:
        """Make the snapshot `values` (read at `revision`), emitting the difference: changed
        and new values in the order they were written, then deletions at `revision`."""
        changed = sorted(
            (key for key, value in values.items() if self._snapshot.get(key) != value),
            key=lambda key: (values[key].updated_revision, key),
        )
        gone = sorted(self._snapshot.keys() - values.keys())
        events = [
            RegistryEvent(
                "update" if key in self._snapshot else "add",
                key,
                values[key].updated_revision,
                values[key],
                self._snapshot.get(key),
            )
            for key in changed
        ]
        events += [
            RegistryEvent("delete", key, revision, None, self._snapshot[key]) for key in gone
        ]
        for key in gone:
            self._remove(key, self._snapshot[key])
        for key in changed:
            self._put(key, values[key])
        for event in events:
            self._publish(event)
        self._revision = revision  # may go down: etcd restored from an older backup
        self._advance(revision)

    def _put(self, key: str, value: RegistryValue) -> None:
        self._snapshot[key] = value
        if isinstance(value, AdapterRecord):
            self._adapters.setdefault(value.tenant, {})[value.name] = value
        elif isinstance(value, AdapterVersion):
            self._versions.setdefault((value.tenant, value.name), {})[value.version] = value

    def _remove(self, key: str, value: RegistryValue) -> None:
        del self._snapshot[key]
        if isinstance(value, AdapterRecord):
            names = self._adapters[value.tenant]
            del names[value.name]
            if not names:
                del self._adapters[value.tenant]
        elif isinstance(value, AdapterVersion):
            versions = self._versions[value.tenant, value.name]
            del versions[value.version]
            if not versions:
                del self._versions[value.tenant, value.name]

    def _publish(self, event: RegistryEvent) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)

    def _advance(self, revision: int) -> None:
        self._revision = max(self._revision, revision)
        for wanted, future in self._waiters:
            if wanted <= self._revision and not future.done():
                future.set_result(None)


async def _current_revision(client: aetcd.Client, timeout: float) -> int:
    """etcd's current revision, from a count-only range read (no values transferred)."""
    request = rpc.RangeRequest(
        key=WATCH_PREFIX, range_end=prefix_range_end(WATCH_PREFIX), count_only=True
    )
    response = await client.kvstub.Range(request, timeout=timeout, metadata=client.metadata)
    return response.header.revision
