"""RegistryWatcher against a real etcd. The oracle is etcd's own history, replayed by a plain
aetcd watch from revision 1: every watcher must report exactly that sequence, across etcd
restarts; after a compaction or a replaced etcd it must converge on a fresh full read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aetcd
import grpc
import pytest
from etcd_server import EtcdServer, TcpProxy, etcd_server_fixture  # noqa: F401 (fixture)

from loraplex.registry.models import (
    PREFIX,
    AdapterRecord,
    AdapterVersion,
    Tenant,
    adapter_key,
    tenant_key,
    version_key,
)
from loraplex.registry.store import (
    AlreadyExists,
    EtcdSettings,
    NotFound,
    RegistryStore,
    RegistryUnavailable,
    RevisionConflict,
)
from loraplex.registry.watch import RegistryEvent, RegistryWatcher

pytestmark = pytest.mark.etcd

SHA = "cd" * 32


def version_of(tenant: str, name: str, **overrides) -> AdapterVersion:
    fields = dict(
        name=name,
        tenant=tenant,
        base_model="demo/base",
        rank=8,
        alpha=16.0,
        target_modules=["q_proj"],
        dtype="float16",
        size_bytes=10,
        sha256=SHA,
        artifact=f"sha256/cd/{SHA}",
        version=SHA,
    )
    return AdapterVersion(**(fields | overrides))


async def create(store: RegistryStore, tenant: str, name: str) -> AdapterRecord:
    """A name at its first version, as the tenant API writes it."""
    version = version_of(tenant, name)
    return await store.create_adapter(AdapterRecord.naming(version), version)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def drain(queue: asyncio.Queue[RegistryEvent]) -> list[RegistryEvent]:
    events = []
    while not queue.empty():
        events.append(queue.get_nowait())
    return events


def replay(state: dict, events: list[RegistryEvent]) -> dict:
    state = dict(state)
    for event in events:
        if event.kind == "delete":
            assert state.pop(event.key) == event.previous
        else:
            assert state.get(event.key) == event.previous
            state[event.key] = event.value
    return state


async def etcd_history(endpoint: str, first: int, last: int) -> list[tuple[str, str, int]]:
    """(kind, key, revision) of every change under PREFIX in [first, last], from etcd."""
    host, _, port = endpoint.rpartition(":")
    history: list[tuple[str, str, int]] = []
    if last < first:
        return history
    async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
        watch = await client.watch_prefix((PREFIX + "/").encode(), start_revision=first)
        events = aiter(watch)
        while True:
            # one revision may hold several events (a transaction): once `last` is reached,
            # read on until the stream stays quiet
            reached = history and history[-1][2] >= last
            try:
                event = await asyncio.wait_for(anext(events), 0.5 if reached else None)
            except TimeoutError:
                break
            kv = event.kv
            kind = "delete" if event.kind == "DELETE" else "add" if kv.version == 1 else "update"
            history.append((kind, kv.key.decode(), kv.mod_revision))
        await watch.cancel()
    return [h for h in history if h[2] <= last]


async def persist(write):
    """Retry a write while etcd is down; a retried write may have been applied already."""
    while True:
        try:
            return await write()
        except (AlreadyExists, NotFound):
            return None
        except (RegistryUnavailable, RevisionConflict):
            await asyncio.sleep(0.05)


async def churn(store: RegistryStore, tenant: str, tag: str, count: int) -> None:
    """Creates, updates and deletes of adapters `tag-*`, retrying through outages."""
    for i in range(count):
        name = f"{tag}-{i}"
        await persist(lambda name=name: create(store, tenant, name))
        if i % 3 == 0:

            async def pin(name=name):
                current = await store.get_adapter(tenant, name)
                await store.update_adapter(
                    current.model_copy(update={"pinned": True}), current.updated_revision
                )

            await persist(pin)
        if i % 4 == 3:
            await persist(lambda i=i: store.delete_adapter(tenant, f"{tag}-{i - 1}"))


def test_three_watchers_see_etcds_history_across_a_restart(etcd_server: EtcdServer):
    async def body():
        settings = etcd_server.settings(timeout_s=1.0)
        async with RegistryStore(settings) as store:
            await store.create_tenant(Tenant(name="t"))
            await store.create_tenant(Tenant(name="u"))
            for name in ("p", "q", "r"):
                await create(store, "u", name)
            watchers = [RegistryWatcher(settings, reconnect_delay_s=0.05) for _ in range(3)]
            for watcher in watchers:
                await watcher.start()
            first = watchers[0].revision + 1
            queues = [w.subscribe() for w in watchers]

            await churn(store, "t", "before", 12)
            writer = asyncio.create_task(churn(store, "t", "during", 30))
            await asyncio.sleep(0.05)
            await asyncio.to_thread(etcd_server.stop, kill=True)
            await until(lambda: not any(w.connected for w in watchers))
            for watcher in watchers:  # reads answer from the snapshot while etcd is down
                assert watcher.adapter("u", "p") is not None
                assert watcher.tenant("t") is not None
            await asyncio.sleep(0.3)
            await asyncio.to_thread(etcd_server.start)
            await writer
            await store.delete_tenant("u")  # four deletions at one revision
            await churn(store, "t", "after", 12)

            truth, last = await store.read_all()
            for watcher in watchers:
                assert await watcher.wait_for_revision(last, 10)
                assert watcher.connected
            expected = await etcd_history(etcd_server.endpoint, first, last)
            assert len(expected) > 60
            for watcher, queue in zip(watchers, queues, strict=True):
                assert [(e.kind, e.key, e.revision) for e in drain(queue)] == expected
                assert dict(watcher.snapshot) == truth
                assert watcher.resyncs == 0
                await watcher.stop()

    asyncio.run(body())


def test_compaction_past_a_disconnected_watcher_resyncs_and_emits_the_difference(
    etcd_server: EtcdServer,
):
    async def body():
        async with RegistryStore(etcd_server.settings()) as store:
            await store.create_tenant(Tenant(name="c"))
            for name in "abc":
                await create(store, "c", name)
            proxy = await TcpProxy(etcd_server.endpoint).start()
            watcher = RegistryWatcher(
                EtcdSettings(endpoints=[proxy.endpoint], timeout_s=1.0), reconnect_delay_s=0.05
            )
            await watcher.start()
            before = dict(watcher.snapshot)
            queue = watcher.subscribe()
            await until(lambda: watcher.connected)

            await proxy.cut()  # etcd stays up; only this watcher's link is down
            await until(lambda: not watcher.connected)
            a = await store.get_adapter("c", "a")
            await store.update_adapter(a.model_copy(update={"rank": 4}), a.updated_revision)
            await store.delete_adapter("c", "b")
            await create(store, "c", "d")
            await create(store, "c", "e")
            await store.delete_adapter("c", "e")  # came and went: no event for it
            truth, revision = await store.read_all()
            await etcd_server.compact(revision)
            assert watcher.revision < revision - 1  # its resume point is gone
            proxy.restore()

            assert await watcher.wait_for_revision(revision, 10)
            assert watcher.resyncs == 1
            assert dict(watcher.snapshot) == truth
            events = drain(queue)
            assert sorted((e.kind, e.key) for e in events) == [
                ("add", adapter_key("c", "d")),
                ("add", version_key("c", "d", SHA)),
                ("delete", adapter_key("c", "b")),
                ("delete", version_key("c", "b", SHA)),
                ("update", adapter_key("c", "a")),
            ]
            assert [e.revision for e in events] == sorted(e.revision for e in events)
            assert replay(before, events) == truth

            f = await create(store, "c", "f")  # and it follows again
            assert await watcher.wait_for_revision(f.updated_revision, 5)
            assert watcher.adapter("c", "f") == f
            assert [e.kind for e in drain(queue)] == ["add", "add"]  # the name, its version
            await watcher.stop()
            await proxy.close()

    asyncio.run(body())


def test_snapshot_answers_while_etcd_is_down_and_catches_up(etcd_server: EtcdServer):
    async def body():
        settings = etcd_server.settings(timeout_s=0.5)
        async with RegistryStore(settings) as store:
            await store.create_tenant(Tenant(name="d"))
            kept = await create(store, "d", "kept")
            watcher = RegistryWatcher(settings, reconnect_delay_s=0.05)
            await watcher.start()
            assert watcher.adapters("d") == [kept]

            etcd_server.stop(kill=True)
            await until(lambda: not watcher.connected)
            assert watcher.adapter("d", "kept") == kept
            assert watcher.adapters() == [kept]
            assert watcher.tenant("d").name == "d"
            assert not await watcher.wait_for_revision(watcher.revision + 1, 0.2)
            with pytest.raises(RegistryUnavailable):  # a new watcher cannot start blind
                await RegistryWatcher(settings).start()

            await asyncio.to_thread(etcd_server.start)
            added = await persist(lambda: create(store, "d", "added"))
            assert await watcher.wait_for_revision(added.updated_revision, 10)
            assert watcher.adapters("d") == [added, kept]
            assert watcher.connected
            await watcher.stop()

    asyncio.run(body())


def test_etcd_replaced_by_one_with_a_shorter_history_resyncs(etcd_server: EtcdServer, tmp_path):
    async def body():
        settings = etcd_server.settings()
        async with RegistryStore(settings) as store:
            await store.create_tenant(Tenant(name="old"))
            for i in range(6):
                await create(store, "old", f"a{i}")
            watcher = RegistryWatcher(settings, reconnect_delay_s=0.05)
            await watcher.start()
            before = dict(watcher.snapshot)
            queue = watcher.subscribe()

            etcd_server.stop(kill=True)
            replacement = EtcdServer(  # an empty etcd on the same address (data lost)
                tmp_path / "replacement",
                client_port=etcd_server.client_port,
                peer_port=etcd_server.peer_port,
                binary=etcd_server.binary,
            )
            await asyncio.to_thread(replacement.start)
            try:
                await persist(lambda: store.create_tenant(Tenant(name="new")))
                await until(lambda: watcher.resyncs == 1 and watcher.tenant("new") is not None)
                truth, _ = await store.read_all()
                assert set(truth) == {tenant_key("new")}
                assert dict(watcher.snapshot) == truth
                assert replay(before, drain(queue)) == truth
            finally:
                await watcher.stop()
                replacement.stop(kill=True)

    asyncio.run(body())


def test_an_alias_is_never_seen_before_the_version_it_names(etcd_server: EtcdServer):
    """A registration, and a new version, is one transaction whose events a watcher applies
    one by one in the transaction's order. The version record comes first, so whoever sees
    the alias (AdapterSync resolving a request, waiting for the write's revision) already
    sees the version it names: no reader needs a fallback to the alias's own fields."""

    async def body():
        settings = etcd_server.settings()
        async with RegistryStore(settings) as store:
            await store.create_tenant(Tenant(name="o"))
            watcher = RegistryWatcher(settings)
            await watcher.start()
            events = watcher.subscribe()
            created = await create(store, "o", "a")
            newer = version_of("o", "a", version="ef" * 32, sha256="ef" * 32)
            moved = await store.move_adapter(
                created.pointing_to(newer), created.updated_revision, add=[newer], drop=[SHA]
            )
            assert await watcher.wait_for_revision(moved.updated_revision, 10)
            await watcher.stop()
        seen = [events.get_nowait() for _ in range(events.qsize())]
        keys = [e.key for e in seen]
        aliases = [i for i, e in enumerate(seen) if isinstance(e.value, AdapterRecord)]
        assert len(aliases) == 2
        for i in aliases:
            named = version_key("o", "a", seen[i].value.version)
            assert named in keys[:i], f"alias event {i} came before its version: {keys}"

    asyncio.run(body())


def test_stop_ends_even_when_aetcds_watch_stream_cannot_shut_down(etcd_server: EtcdServer):
    """aetcd's close shuts its watcher down under the watcher's lock first, and that lock is
    held across awaits that can wait forever (a response handler putting a cancel request on
    a full queue of 10 that no stream drains any more): stop() then waited forever, and an
    app with it. Here a task holds that lock, as such a handler would, on a real stream to a
    real etcd: stop() ends within its bound, and the channel is closed all the same."""

    async def body():
        watcher = RegistryWatcher(etcd_server.settings(timeout_s=0.5))
        await watcher.start()
        await until(lambda: watcher.connected)
        client = watcher._connection._client
        assert client is not None and client._watcher is not None
        held = asyncio.Event()

        async def stuck_stream():
            async with client._watcher._lock:
                held.set()
                await asyncio.Event().wait()

        holder = asyncio.create_task(stuck_stream())
        await held.wait()
        channel = client.channel
        await asyncio.wait_for(watcher.stop(), 5.0)
        assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        holder.cancel()

    asyncio.run(body())
