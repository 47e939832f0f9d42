"""The router's prefix keys are the replica's: after the real engine served a prompt, every
key the ingress computes for that prompt's first blocks (`prompt_prefix_keys`, from what the
replica publishes in its routing stats, `prefix_routing`) names a block the engine's prefix
cache holds. Otherwise prefix affinity would route by keys that never hit.

The adapter is loaded as AdapterSync loads it: under its version id (`tenant/name@version`)
with the registry's version (the artifact store's content digest) passed to the engine, so
the router's root (the version parsed from the id) and the engine's root are one version.
The oracle is the engine's own cache (`PrefixCache.blocks`), filled by serving the prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_oracle import demo_engine, greedy, token_prompt

from loraplex.registry.artifacts import ArtifactStore
from loraplex.replica.engine import LLMEngine
from loraplex.replica.protocol import GenerateRequest, adapter_id
from loraplex.replica.routing_report import prefix_routing

pytest.importorskip("ray")

from loraplex.router.request_router import prompt_prefix_keys  # noqa: E402

PAGE = 16 * 1024  # 8 tokens a block
PROMPT = token_prompt(45, 11)  # 5 full blocks, the last one only partly


def serve(engine: LLMEngine, request: GenerateRequest) -> int:
    """Serve the request to its end; the prompt tokens it found cached."""
    seq = engine.add_request(
        request["prompt_token_ids"],
        greedy(3),
        request["adapter"],
        tenant=request.get("tenant"),
        cache_salt=request.get("cache_salt"),
    )
    while engine.has_unfinished():
        engine.step()
    return seq.num_cached_tokens


def request(adapter: str | None, tenant: str, salt: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        prompt_token_ids=PROMPT,
        adapter=adapter,
        params={},
        tenant=tenant,
        cache_salt=salt,
    )


@pytest.mark.parametrize("share_base", [False, True])
def test_router_keys_are_the_engine_cached_block_keys(demo_assets, tmp_path: Path, share_base):
    engine = demo_engine(demo_assets, page_bytes=PAGE, share_base_prefix=share_base)
    path = demo_assets.adapters_dir / "sql-r8"
    version = ArtifactStore(tmp_path / "artifacts").put_dir(path).digest
    sql = adapter_id("acme", "sql", version)
    assert engine.add_adapter(sql, path, version).version == version

    published = prefix_routing(engine.stats())
    assert published == {"prefix_block_size": 8, "prefix_share_base": share_base}

    def keys(r: GenerateRequest) -> tuple[bytes, ...]:
        return prompt_prefix_keys(
            r, published["prefix_block_size"], published["prefix_share_base"], 128
        )

    cached = engine.kv.prefix.blocks
    for served in (request(sql, "acme"), request(None, "acme"), request(sql, "acme", "doc-1")):
        assert not set(keys(served)) & cached.keys()  # not served yet: nothing of it cached
        assert serve(engine, served) == 0
        assert len(keys(served)) == len(PROMPT) // 8 == 5
        assert set(keys(served)) <= cached.keys(), served
        assert serve(engine, served) == 40  # and the engine finds them again

    # Another tenant's keys differ, and its request finds nothing cached, except base-model
    # blocks when the replica shares them (the router then keys them alike).
    other_sql = adapter_id("globex", "sql", version)
    engine.add_adapter(other_sql, path, version)
    for other, shared in ((request(other_sql, "globex"), False), (request(None, "globex"), True)):
        found = set(keys(other)) <= cached.keys()
        assert found == (shared and share_base), other
        assert serve(engine, other) == (40 if found else 0)
    # A new version of the name keys apart from the old one's blocks.
    new = adapter_id("acme", "sql", "f" * 64)
    engine.add_adapter(new, demo_assets.adapters_dir / "chat-r16", "f" * 64)
    assert not set(keys(request(new, "acme"))) & cached.keys()
