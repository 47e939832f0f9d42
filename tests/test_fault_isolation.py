"""A fault that belongs to one request ends that request and nothing else (issue 14).

The poison of the report: `temperature 1, top_p 1e-46` is positive as a Python float and 0 in
float32, so the nucleus filter dropped every token and `torch.multinomial` raised, which
stopped the replica's whole engine. The ingress and `SamplingParams` now refuse it, and the
nucleus keeps its top token whatever top_p reads as (test_sampling.py), so it no longer
raises; a fractional top_k, which torch.topk refuses, stands in for it. These tests force
such values past validation (as any future hole would let them through) and check that the
engine ends only that request and its batch-mates finish with the tokens they get without
it.
"""

import asyncio
import shutil
from pathlib import Path

import pytest

from loraplex.demo.assets import DemoAssets
from loraplex.replica.async_engine import Engine
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import RequestOutput

PAGE = 64 * 1024
GOOD = (  # (prompt, params, adapter): greedy and seeded sampling, base and adapters
    ("Once upon a time there was", SamplingParams(max_tokens=24, temperature=0.0), None),
    ("The quick brown fox", SamplingParams(max_tokens=24, temperature=0.8, seed=7), "sql-r8"),
    ("def add(a, b):", SamplingParams(max_tokens=24, temperature=0.0), "chat-r16"),
    ("The morning train", SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=3), None),
)


class _RaisingStop(str):
    """A stop string whose length cannot be taken: stop handling raises mid-request."""

    def __len__(self) -> int:
        raise RuntimeError("stop handling blew up")


def _forced(params: SamplingParams, **fields) -> SamplingParams:
    """`params` with fields set past validation (the frozen dataclass's own setattr)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def _poisons() -> list[tuple[str, SamplingParams, str | None]]:
    return [
        ("poison top_k", _forced(SamplingParams(max_tokens=8), top_k=2.5), None),
        (
            "poison nan temperature",
            _forced(SamplingParams(max_tokens=8), temperature=float("nan")),
            "sql-r8",
        ),
        ("poison stop", _forced(SamplingParams(max_tokens=8), stop=(_RaisingStop("x"),)), None),
    ]


def _engine(assets: DemoAssets, **cache) -> LLMEngine:
    cfg = EngineConfig(
        model=str(assets.model),
        page_bytes=PAGE,
        pool_bytes=256 * PAGE,
        cache=CacheConfig(loading="thread", **cache),
    )
    eng = LLMEngine(cfg)
    for name in ("sql-r8", "chat-r16"):
        eng.add_adapter(name, assets.adapters_dir / name)
    return eng


def _drain(eng: LLMEngine, final: dict[str, RequestOutput], max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return
        for out in eng.step():
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
    pytest.fail("the engine did not drain")


@pytest.fixture(scope="module")
def reference(assets: DemoAssets) -> list[list[int]]:
    """The good requests' tokens, run together in an engine that never saw a poison."""
    eng = _engine(assets)
    outs = eng.generate(*map(list, zip(*GOOD, strict=True)))
    return [out.token_ids for out in outs]


def test_raising_requests_injected_into_a_running_batch_end_alone(assets, reference):
    eng = _engine(assets)
    good_ids = [eng.add_request(p, sp, a).request_id for p, sp, a in GOOD]
    final: dict[str, RequestOutput] = {}
    for _ in range(3):  # the good requests are running (prefilled, decoding) ...
        for out in eng.step():
            assert not out.finished
    poison_ids = [eng.add_request(p, sp, a).request_id for p, sp, a in _poisons()]
    _drain(eng, final)  # ... when the poisons join their batch

    for rid in poison_ids:
        assert final[rid].finish_reason == "error"
        assert final[rid].error == "generation failed for this request"
    assert [final[rid].token_ids for rid in good_ids] == reference
    assert all(final[rid].finish_reason in ("stop", "length") for rid in good_ids)
    assert eng.stats()["running"] == 0 and not eng.requests
    assert eng.pool.stats().kv_pages == 0  # the failed requests' KV blocks were freed

    # the engine goes on: the same requests again give the same tokens
    again = eng.generate(*map(list, zip(*GOOD, strict=True)))
    assert [out.token_ids for out in again] == reference


@pytest.mark.parametrize("loading", ["sync", "thread"])
def test_an_adapter_that_fails_to_load_fails_only_its_requests(
    assets: DemoAssets, tmp_path: Path, reference, loading: str
):
    """Its artifact went missing after registration (the host tier dropped its copy, so the
    load reads the disk): the requests for it end with an error, the others finish with
    their usual tokens, and once the file is back a new request loads it."""
    broken = tmp_path / "broken"
    shutil.copytree(assets.adapters_dir / "math-r64", broken)
    cfg = EngineConfig(
        model=str(assets.model),
        page_bytes=PAGE,
        pool_bytes=256 * PAGE,
        cache=CacheConfig(loading=loading, host_bytes=0),  # every host copy is dropped
    )
    eng = LLMEngine(cfg)
    for name in ("sql-r8", "chat-r16"):
        eng.add_adapter(name, assets.adapters_dir / name)
    eng.add_adapter("broken", broken)
    expected = eng.generate(["Hello"], [SamplingParams(max_tokens=6, temperature=0.0)], ["broken"])
    eng.adapters._evict_one("broken")  # off the device: the next use reads the disk again

    weights = broken / "adapter_model.safetensors"
    hidden = tmp_path / "hidden.safetensors"
    weights.rename(hidden)
    good_ids = [eng.add_request(p, sp, a).request_id for p, sp, a in GOOD]
    failing = eng.add_request("Hello", SamplingParams(max_tokens=6, temperature=0.0), "broken")
    final: dict[str, RequestOutput] = {}
    _drain(eng, final)
    assert final[failing.request_id].finish_reason == "error"
    assert "failed to load" in final[failing.request_id].error
    assert [final[rid].token_ids for rid in good_ids] == reference
    assert eng.adapters.stats.load_failures == 1
    assert "broken" not in eng.adapters.loading and "broken" not in eng.adapters.resident

    hidden.rename(weights)  # back: the next request retries the load
    again = eng.generate(["Hello"], [SamplingParams(max_tokens=6, temperature=0.0)], ["broken"])
    assert again[0].token_ids == expected[0].token_ids


def test_the_async_engine_keeps_serving_after_a_request_fails(assets: DemoAssets, reference):
    """The step loop survives a failing request: other streams finish, the health check
    reports nothing, and new requests are served."""
    engine = Engine(EngineConfig(model=str(assets.model), page_bytes=PAGE, pool_bytes=256 * PAGE))

    async def run(prompt, params, adapter) -> RequestOutput:
        last = None
        async for out in engine.generate(prompt, params, adapter):
            last = out
        assert last is not None
        return last

    async def main():
        for name in ("sql-r8", "chat-r16"):
            await engine.add_adapter(name, assets.adapters_dir / name)
        jobs = [run(*req) for req in GOOD] + [run(*req) for req in _poisons()]
        outs = await asyncio.gather(*jobs)
        after = await asyncio.gather(*(run(*req) for req in GOOD))
        return outs, after

    try:
        outs, after = asyncio.run(main())
        assert [out.token_ids for out in outs[: len(GOOD)]] == reference
        assert [out.finish_reason for out in outs[len(GOOD) :]] == ["error"] * 3
        assert engine.failure() is None
        assert [out.token_ids for out in after] == reference
    finally:
        engine.shutdown()
