"""Who may reuse whose cached KV blocks, on the real engine.

The salt is the tenant (then the request's cache_salt): another tenant's request with the
exact prompt and a same-named adapter of identical weights computes its whole prefill (the
counters show no hit). With share_base_prefix, base-model blocks are shared across tenants
and adapter blocks never are. An adapter's identity is its version (a content digest of
its files, as the registry computes it): other weights registered under the same name never
hit the old weights' blocks, and their logits are those of the new weights (PEFT oracle).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from test_engine_oracle import Driver, check_against_oracle, demo_engine, greedy, token_prompt

from loraplex.registry.artifacts import ArtifactStore
from loraplex.replica.async_engine import Engine
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.local_backend import LocalBackend
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.memory.adapters import load_adapter
from loraplex.replica.protocol import GenerateRequest

PAGE = 16 * 1024  # 8 tokens a block
PROMPT = token_prompt(37, 7)  # 4 full blocks can hit (never the last token)


def run(engine: LLMEngine, adapter: str | None, tenant: str | None, salt: str | None = None):
    """Serve one greedy request; (prompt tokens it found cached, its final output)."""
    seq = engine.add_request(PROMPT, greedy(4), adapter, tenant=tenant, cache_salt=salt)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.finish_reason == "length"
    assert final.num_cached_tokens == seq.num_cached_tokens
    return seq.num_cached_tokens, final


def hits(engine: LLMEngine) -> int:
    return engine.stats()["prefix_cache"]["hit_blocks"]


def test_tenants_never_share_blocks_even_for_identical_adapters(demo_assets, tmp_path: Path):
    engine = demo_engine(demo_assets, page_bytes=PAGE)
    path = demo_assets.adapters_dir / "sql-r8"
    a = engine.add_adapter("acme/sql", path)
    b = engine.add_adapter("globex/sql", path)
    registry_digest = ArtifactStore(tmp_path / "artifacts").put_dir(path).digest
    assert a.version == b.version == registry_digest

    assert run(engine, "acme/sql", "acme")[0] == 0
    cached, first = run(engine, "acme/sql", "acme")
    assert cached == 32 and hits(engine) == 4
    cached, other = run(engine, "globex/sql", "globex")  # same prompt, same weights
    assert cached == 0 and hits(engine) == 4
    assert other.token_ids == first.token_ids  # computed again, to the same result

    # a request's cache_salt narrows its tenant's cache further
    assert run(engine, "acme/sql", "acme", salt="doc-1")[0] == 0
    assert run(engine, "acme/sql", "acme", salt="doc-1")[0] == 32
    assert run(engine, "acme/sql", "acme", salt="doc-2")[0] == 0

    # the base model: per tenant by default
    assert run(engine, None, "acme")[0] == 0
    assert run(engine, None, "globex")[0] == 0
    assert run(engine, None, "acme")[0] == 32


def test_share_base_prefix_shares_base_blocks_but_never_adapter_blocks(demo_assets):
    engine = demo_engine(demo_assets, page_bytes=PAGE, share_base_prefix=True)
    path = demo_assets.adapters_dir / "chat-r16"
    engine.add_adapter("acme/chat", path)
    engine.add_adapter("globex/chat", path)
    assert run(engine, None, "acme")[0] == 0
    assert run(engine, None, "globex")[0] == 32
    assert run(engine, None, "globex", salt="private")[0] == 0  # a salt still separates
    assert run(engine, "acme/chat", "acme")[0] == 0
    assert run(engine, "globex/chat", "globex")[0] == 0
    assert run(engine, "acme/chat", "acme")[0] == 32


@pytest.mark.oracle
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_other_weights_under_one_name_never_hit_the_old_blocks(
    demo_assets, oracle_logits, tmp_path: Path
):
    engine = demo_engine(demo_assets, page_bytes=PAGE)
    sql, legal = demo_assets.adapters_dir / "sql-r8", demo_assets.adapters_dir / "legal-r8"
    first = engine.add_adapter("acme/x", sql)

    ids = itertools.count()

    def serve(name_in_oracle: str) -> int:
        """Tokens it found cached; its logits are those of `name_in_oracle`'s weights."""
        driver = Driver(engine)
        run_ = driver.add(f"r{next(ids)}", PROMPT, 6, "acme/x", tenant="acme")
        while engine.has_unfinished():
            driver.step()
        check_against_oracle([replace(run_, adapter=name_in_oracle)], oracle_logits, atol=1e-4)
        return run_.seq.num_cached_tokens

    assert serve("sql-r8") == 0
    assert serve("sql-r8") == 32
    second = engine.add_adapter("acme/x", legal)  # re-registered: other weights, one name
    assert second.version != first.version
    assert serve("legal-r8") == 0  # the sql-r8 blocks are still cached, and not used
    assert serve("legal-r8") == 32
    third = engine.add_adapter("acme/x", sql)  # the first weights again: the same version
    assert third.version == first.version
    assert serve("sql-r8") == 32

    # a version the caller names (the registry's) is what identifies the weights
    copy = tmp_path / "copy"
    shutil.copytree(sql, copy)
    assert engine.add_adapter("acme/x", copy, version="v7").version == "v7"
    assert serve("sql-r8") == 0


def test_weights_registered_without_files_get_a_digest_of_their_tensors(demo_assets):
    engine = demo_engine(demo_assets, page_bytes=PAGE)
    mc, adapters = engine.model_config, demo_assets.adapters_dir

    def read(name: str):
        return replace(load_adapter(adapters / name, "x", mc, 128), version=None)

    a = engine.register_adapter(read("sql-r8"))
    b = engine.register_adapter(replace(read("sql-r8"), name="y"))
    c = engine.register_adapter(read("legal-r8"))
    assert a.version == b.version != c.version and len(a.version) == 64


def test_weights_changed_on_disk_are_refused_when_read_again(demo_assets, tmp_path: Path):
    """A host budget of 0 drops host copies: a load reads the folder again, and must find
    the weights it registered (cached blocks are keyed by them)."""
    folder = tmp_path / "sql"
    shutil.copytree(demo_assets.adapters_dir / "sql-r8", folder)
    engine = demo_engine(
        demo_assets,
        page_bytes=PAGE,
        pool_bytes=48 * PAGE,
        cache=CacheConfig(host_bytes=0, loading="sync"),
    )
    engine.add_adapter("acme/sql", folder)
    assert run(engine, "acme/sql", "acme")[1].finish_reason == "length"
    assert engine.stats()["adapters"]["disk_reads"] == 1
    long = token_prompt(370, 8)  # 47 of 48 pages: KV takes the idle adapter's pages
    engine.add_request(long, greedy(2), None, tenant="acme")
    while engine.has_unfinished():
        engine.step()
    assert not engine.adapters.is_resident("acme/sql")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(demo_assets.adapters_dir / "legal-r8" / name, folder / name)
    engine.add_request(PROMPT, greedy(4), "acme/sql", request_id="stale", tenant="acme")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (final,) = [o for o in outs if o.finished]
    assert final.finish_reason == "error" and final.token_ids == []
    assert engine.stats()["adapters"]["load_failures"] == 1


@pytest.mark.parametrize("enabled", [True, False])
def test_stats_count_prompt_tokens_computed(demo_assets, enabled: bool):
    engine = demo_engine(demo_assets, page_bytes=PAGE, enable_prefix_caching=enabled)
    for _ in range(3):
        run(engine, None, "acme")
    stats = engine.stats()["prefix_cache"]
    assert stats["enabled"] is enabled and stats["prompt_tokens"] == 3 * len(PROMPT)
    cached = 2 * 32 if enabled else 0
    assert stats["prompt_tokens_computed"] == 3 * len(PROMPT) - cached
    if enabled:
        assert (stats["lookups"], stats["hit_blocks"], stats["miss_blocks"]) == (3, 8, 4)
        assert engine.reset_prefix_cache() > 0 and run(engine, None, "acme")[0] == 0


def test_the_replica_protocol_carries_the_tenant_and_cache_salt(demo_assets):
    engine = Engine(
        EngineConfig(model=str(demo_assets.model), page_bytes=PAGE, pool_bytes=32 << 20)
    )
    backend = LocalBackend(engine)
    ids = itertools.count()

    async def cached(**salts) -> int:
        request = GenerateRequest(
            request_id=f"p{next(ids)}",
            prompt_token_ids=PROMPT,
            adapter=None,
            params={"max_tokens": 2, "temperature": 0, "ignore_eos": True},
            **salts,
        )
        chunks = [c async for c in backend.generate(request)]
        assert chunks[-1]["finished"] and chunks[-1]["num_prompt_tokens"] == len(PROMPT)
        return chunks[-1]["num_cached_tokens"]

    async def main() -> list[int]:
        return [
            await cached(tenant="acme"),
            await cached(tenant="acme"),
            await cached(tenant="globex"),
            await cached(tenant="acme", cache_salt="s"),
            await cached(),  # an ingress that sends neither field: no tenant
            await cached(),
        ]

    try:
        assert asyncio.run(main()) == [0, 32, 0, 0, 0, 32]
    finally:
        engine.shutdown()
