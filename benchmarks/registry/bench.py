"""`loraplex bench registry`: the etcd registry against a real local etcd (fsync on).

- register_per_s: metadata-only adapter registrations (create-if-absent transactions) per
  second, `REGISTER_CONCURRENCY` in flight from one client.
- propagation_p50_ms / propagation_p99_ms: from sending a registration to its event at each
  of 8 watchers (so the commit itself is included; commit_p50_ms is that part alone).
  Registrations are sent one at a time, so this is latency, not queueing.
- restart_resync_s: a new watcher's time from start() to a full snapshot of
  `snapshot_adapters` adapters (median of 3).
All watchers run in this process on one event loop, as several replicas' would on one host.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.benchmarks.report import log, write_json
from loraplex.registry.etcd_process import INSTALL_HINT, EtcdProcess, find_etcd_binary
from loraplex.registry.models import AdapterRecord, AdapterVersion, Tenant
from loraplex.registry.store import EtcdSettings, RegistryStore
from loraplex.registry.watch import RegistryWatcher

REGISTER_CONCURRENCY = 8
WATCHERS = 8
SHA = "0123456789abcdef" * 4


@dataclass(frozen=True, slots=True)
class Shape:
    registrations: int
    propagation_samples: int
    snapshot_adapters: int


FULL = Shape(registrations=5_000, propagation_samples=1_000, snapshot_adapters=10_000)
QUICK = Shape(registrations=1_000, propagation_samples=200, snapshot_adapters=2_000)


def run_bench(args: argparse.Namespace) -> int:
    shape = QUICK if args.quick else FULL
    binary = find_etcd_binary()
    if binary is None:
        log(f"no etcd server binary; install one: {INSTALL_HINT}")
        return 2
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-registry-") as tmp:
        etcd = EtcdProcess(Path(tmp) / "etcd", binary=binary)
        etcd.start()
        log(f"etcd {binary} on {etcd.endpoint}")
        try:
            results = asyncio.run(_measure(EtcdSettings(endpoints=[etcd.endpoint]), shape))
        finally:
            etcd.stop()
    results = {"quick": bool(args.quick), **results}
    _print_table(results)
    write_json(args.json, results)
    return 0


async def _measure(settings: EtcdSettings, shape: Shape) -> dict[str, float | int]:
    async with RegistryStore(settings) as store:
        await store.create_tenant(Tenant(name="bench", adapter_quota=1_000_000))
        results: dict[str, float | int] = {}
        results.update(await _register(store, shape.registrations))
        results.update(await _propagation(store, settings, shape.propagation_samples))
        registered = shape.registrations + shape.propagation_samples
        results.update(await _resync(store, settings, shape.snapshot_adapters, registered))
    return results


def _version(name: str) -> AdapterVersion:
    return AdapterVersion(
        name=name,
        tenant="bench",
        base_model="meta-llama/Llama-3.1-8B-Instruct",
        rank=16,
        alpha=32.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        dtype="bfloat16",
        size_bytes=27_262_976,
        sha256=SHA,
        artifact=f"sha256/01/{SHA}",
        version=SHA,
    )


async def _create(store: RegistryStore, name: str) -> AdapterRecord:
    """A name at its first version (the tenant API's transaction, without the upload)."""
    version = _version(name)
    return await store.create_adapter(AdapterRecord.naming(version), version)


async def _create_many(store: RegistryStore, names: list[str], concurrency: int) -> None:
    pending = iter(names)

    async def worker() -> None:
        for name in pending:
            await _create(store, name)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _register(store: RegistryStore, count: int) -> dict[str, float | int]:
    names = [f"reg-{i:06d}" for i in range(count)]
    log(f"register: {count} adapters, {REGISTER_CONCURRENCY} in flight")
    started = time.perf_counter()
    await _create_many(store, names, REGISTER_CONCURRENCY)
    elapsed = time.perf_counter() - started
    return {
        "register_per_s": round(count / elapsed, 1),
        "register_concurrency": REGISTER_CONCURRENCY,
        "registrations": count,
    }


async def _propagation(
    store: RegistryStore, settings: EtcdSettings, samples: int
) -> dict[str, float | int]:
    log(f"propagation: {samples} registrations, {WATCHERS} watchers")
    watchers = [RegistryWatcher(settings) for _ in range(WATCHERS)]
    await asyncio.gather(*(w.start() for w in watchers))
    while not all(w.connected for w in watchers):  # every watch stream open
        await asyncio.sleep(0.01)
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    seen = asyncio.Event()
    remaining = samples * WATCHERS

    async def consume(queue: asyncio.Queue) -> None:
        nonlocal remaining
        while True:
            event = await queue.get()
            now = time.perf_counter()
            if event.key in sent_at:
                latencies.append(now - sent_at[event.key])
                remaining -= 1
                if remaining == 0:
                    seen.set()

    consumers = [asyncio.create_task(consume(w.subscribe())) for w in watchers]
    commits = []
    for i in range(samples):
        name = f"prop-{i:06d}"
        key = f"/loraplex/v1/adapters/bench/{name}"
        sent_at[key] = started = time.perf_counter()
        await _create(store, name)
        commits.append(time.perf_counter() - started)
        await asyncio.sleep(0.005)
    await asyncio.wait_for(seen.wait(), 30)
    for task in consumers:
        task.cancel()
    await asyncio.gather(*(w.stop() for w in watchers))
    latencies.sort()
    return {
        "propagation_p50_ms": round(1e3 * _quantile(latencies, 0.50), 2),
        "propagation_p99_ms": round(1e3 * _quantile(latencies, 0.99), 2),
        "propagation_max_ms": round(1e3 * latencies[-1], 2),
        "commit_p50_ms": round(1e3 * statistics.median(commits), 2),
        "watchers": WATCHERS,
    }


async def _resync(
    store: RegistryStore, settings: EtcdSettings, target: int, registered: int
) -> dict[str, float | int]:
    fill = [f"fill-{i:06d}" for i in range(max(0, target - registered))]
    log(f"resync: filling to {target} adapters ({len(fill)} more)")
    await _create_many(store, fill, 32)
    times = []
    for _ in range(3):
        watcher = RegistryWatcher(settings)
        started = time.perf_counter()
        await watcher.start()
        times.append(time.perf_counter() - started)
        count = len(watcher.adapters("bench"))
        await watcher.stop()
        assert count >= target, f"snapshot holds {count} adapters, expected {target}"
    return {"restart_resync_s": round(statistics.median(times), 3), "snapshot_adapters": count}


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _print_table(results: dict[str, float | int | bool]) -> None:
    targets = {
        "register_per_s": ">= 500",
        "propagation_p99_ms": "<= 50",
        "restart_resync_s": "<= 2",
    }
    print(f"{'metric':<22} {'value':>12}  target")
    for key, value in results.items():
        print(f"{key:<22} {value!s:>12}  {targets.get(key, '')}")
