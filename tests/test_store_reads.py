"""The artifact tier's read model: reads paced to latency + bytes / bandwidth, one after
another per replica, and nothing added when it is off."""

from __future__ import annotations

import time

import pytest

from loraplex.replica.config import ArtifactReadConfig, EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.memory.store_reads import ReadModel, ReadPacer


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_reads_take_latency_plus_size_over_bandwidth_one_after_another():
    t = FakeTime()
    pacer = ReadPacer(ReadModel(bytes_per_s=1e6, latency_s=0.05), clock=t, sleep=t.sleep)
    t.now = 0.01  # the first read took 10 ms locally: 0.05 + 0.2 s in all
    pacer.pace(200_000, started=0.0)
    assert t.now == pytest.approx(0.25)
    # Two reads begun together: the second waits for the first's bytes (one stream) but
    # its latency overlaps the first's transfer.
    assert pacer.finish_at(100_000, started=1.0) == pytest.approx(1.15)
    assert pacer.finish_at(100_000, started=1.0) == pytest.approx(1.25)
    t.now = 5.0  # a read slower than the model is not slowed further
    pacer.pace(1_000, started=4.0)
    assert t.now == 5.0 and pacer.reads == 4


def test_the_read_model_is_validated_and_off_by_default():
    with pytest.raises(ValueError, match="bytes_per_s"):
        ReadModel(bytes_per_s=0.0)
    with pytest.raises(ValueError, match="read_latency_ms"):
        ArtifactReadConfig(read_latency_ms=-1.0)
    with pytest.raises(ValueError, match="read_bandwidth_mib_s"):
        ArtifactReadConfig(read_bandwidth_mib_s=0.0)
    assert EngineConfig(model="m").artifacts.read_model() is None
    latency_only = ArtifactReadConfig(read_latency_ms=100.0).read_model()
    assert latency_only.latency_s == 0.1 and latency_only.bytes_per_s == float("inf")
    both = ArtifactReadConfig(read_bandwidth_mib_s=8.0, read_latency_ms=50.0).read_model()
    assert both.bytes_per_s == 8 << 20 and both.latency_s == 0.05


def test_engine_reads_are_paced_only_when_configured(assets):
    adapter = assets.adapters_dir / "sql-r8"
    nbytes = (adapter / "adapter_model.safetensors").stat().st_size
    off = LLMEngine(EngineConfig(model=str(assets.model), pool_bytes=64 << 20))
    start = time.monotonic()
    off.add_adapter("a", adapter)
    unpaced = time.monotonic() - start
    assert off.read_pacer is None

    bandwidth = nbytes / 0.3  # 0.3 s of transfer, + 0.2 s latency
    paced = LLMEngine(
        EngineConfig(
            model=str(assets.model),
            pool_bytes=64 << 20,
            artifacts=ArtifactReadConfig(
                read_bandwidth_mib_s=bandwidth / (1 << 20), read_latency_ms=200
            ),
        )
    )
    start = time.monotonic()
    paced.add_adapter("a", adapter)
    took = time.monotonic() - start
    weights = paced.adapters.host["a"]
    assert took >= 0.2 + weights.nbytes / bandwidth - 1e-3
    assert unpaced < 0.2 + weights.nbytes / bandwidth  # the model, not the disk, set it
    assert paced.read_pacer.reads == 1


def test_a_read_from_the_store_stalls_only_its_own_requests(assets):
    """A running stream keeps producing tokens while another adapter is read again from
    the store (its host copy dropped by the host budget): the read runs beside the steps,
    not inside one. With a 1 s read latency the stream of `sql-r8` makes at least 10 steps
    of progress before the request of `chat-r16`, which waits for its read, gets a token."""
    from loraplex.replica.config import CacheConfig
    from loraplex.replica.sampling import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(assets.model),
            pool_bytes=64 << 20,
            cache=CacheConfig(loading="thread", host_bytes=1),  # every host copy dropped
            artifacts=ArtifactReadConfig(read_latency_ms=1000),
        )
    )
    for name in ("sql-r8", "chat-r16"):
        engine.add_adapter(name, assets.adapters_dir / name)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    engine.add_request([5, 6, 7, 8], long, "sql-r8", request_id="running")
    while not any(o.request_id == "running" for o in engine.step()):
        pass  # its own read (1 s), then its first token
    engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=2, temperature=0), "chat-r16", request_id="reading"
    )
    tokens_meanwhile = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        outs = engine.step()
        if any(o.request_id == "reading" for o in outs):
            break
        tokens_meanwhile += sum(o.request_id == "running" for o in outs)
    assert engine.adapters.stats.disk_reads == 2
    assert tokens_meanwhile >= 10, tokens_meanwhile


def test_a_cold_adapter_is_read_once_on_its_first_use_with_a_full_host_tier(assets):
    """The host tier holds two adapters, both used; a third is read for its first request
    (as AdapterSync does) and that request runs on that copy: no second read from the
    store. (The new copy was dropped first, as never used, and read again by the engine.)"""
    from loraplex.replica.config import CacheConfig
    from loraplex.replica.sampling import SamplingParams

    names = sorted(assets.adapter_names)[:3]
    probe = LLMEngine(EngineConfig(model=str(assets.model), pool_bytes=64 << 20))
    sizes = {n: probe.read_adapter(n, assets.adapters_dir / n).nbytes for n in names}
    old, new = names[:2], names[2]
    budget = sum(sizes[n] for n in old) + sizes[new] - 1  # all three do not fit
    engine = LLMEngine(
        EngineConfig(
            model=str(assets.model),
            pool_bytes=64 << 20,
            cache=CacheConfig(loading="thread", host_bytes=budget),
        )
    )
    params = SamplingParams(max_tokens=2, temperature=0)

    def serve(name: str) -> None:
        engine.add_request([5, 6, 7], params, name, request_id=name)
        deadline = time.monotonic() + 30
        while engine.has_unfinished() and time.monotonic() < deadline:
            engine.step()
        assert not engine.has_unfinished()

    for name in old:
        engine.add_adapter(name, assets.adapters_dir / name)
        serve(name)
    engine.add_adapter(new, assets.adapters_dir / new)  # the first read from the store
    serve(new)
    assert engine.adapters.stats.disk_reads == 0
    assert engine.adapters.stats.host_drops == 1 and new in engine.adapters.host


@pytest.mark.parametrize("policy", ["fifo", "sjf", "chameleon"])
def test_a_warm_request_behind_a_store_read_is_admitted_at_the_next_step(assets, policy):
    """A request whose adapter is being read from the store (1 s) waits aside: the request
    queued behind it, whose adapter is on the device, gets its first token from the very
    next step (FIFO and SJF made it wait for the read)."""
    from loraplex.replica.config import CacheConfig, SchedulerConfig
    from loraplex.replica.sampling import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(assets.model),
            pool_bytes=64 << 20,
            scheduler=SchedulerConfig(policy=policy),
            cache=CacheConfig(loading="thread", host_bytes=1),  # every host copy dropped
            artifacts=ArtifactReadConfig(read_latency_ms=1000),
        )
    )
    warm, cold = "sql-r8", "chat-r16"
    for name in (warm, cold):
        engine.add_adapter(name, assets.adapters_dir / name)
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request([5, 6, 7], params, warm, request_id="first")
    deadline = time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        engine.step()
    assert engine.adapters.tier(warm) == "device"
    engine.add_request([5, 6, 7], params, cold, request_id="reading")
    engine.add_request([5, 6, 8], params, warm, request_id="behind")
    started = time.monotonic()
    first = {o.request_id for o in engine.step()}
    assert "behind" in first and "reading" not in first
    assert time.monotonic() - started < 0.5  # the step did not wait out the read
    while engine.has_unfinished() and time.monotonic() < deadline:
        engine.step()
    assert not engine.has_unfinished() and engine.adapters.stats.disk_reads == 2
