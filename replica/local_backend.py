"""A Backend over an engine in this process (no Ray): the single-process server, tests, and
the ingress's contract checked against the real engine."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.replica.memory.adapter_cache import UnknownAdapter
from loraplex.replica.protocol import (
    AdapterNotFound,
    GenerateChunk,
    GenerateRequest,
    cache_salts,
    chunk,
    continuation,
    sampling_params,
)

if TYPE_CHECKING:
    from loraplex.replica.async_engine import Engine
    from loraplex.replica.engine import AdapterInfo

LOCAL_REPLICA = "local"  # the replica id of the engine in process


class LocalBackend:
    """Implements `Backend` over an async `Engine`. Adapters are registered in the engine
    under their id `tenant/name` with `ensure_adapter`; closing a `generate` stream early
    aborts the request in the engine and frees its pages."""

    resumed = 0  # one engine, no other replica to resume on

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._paths: dict[str, Path] = {}  # adapter id -> folder it was loaded from

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        params = sampling_params(request)  # ValueError: the ingress answers 400
        outputs = self.engine.generate(
            request["prompt_token_ids"],
            params,
            request["adapter"],
            request["request_id"],
            **cache_salts(request),
            continuation=continuation(request),
        )
        # aclosing: closing this generator must close the engine's at once (that aborts the
        # request); `async for` alone would leave it to the garbage collector.
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    yield chunk(out)
            except UnknownAdapter:
                raise AdapterNotFound(request["adapter"]) from None

    async def ensure_adapter(self, adapter_id: str, path: str | Path) -> AdapterInfo | None:
        """Load the adapter at `path` as `adapter_id` unless it is already loaded from there;
        the info of a new load, None when nothing had to be done. Loading under a known id
        from another folder replaces the weights (requests running on the old ones finish
        on them). Concurrent calls for one id may both load: the last one stays."""
        path = Path(path)
        if self._paths.get(adapter_id) == path:
            return None
        info = await self.engine.add_adapter(adapter_id, path)
        self._paths[adapter_id] = path
        return info

    async def remove_adapter(self, adapter_id: str) -> None:
        """Unregister an adapter: running requests finish, queued ones end with "abort"."""
        self._paths.pop(adapter_id, None)
        try:
            await self.engine.remove_adapter(adapter_id)
        except UnknownAdapter:
            raise AdapterNotFound(adapter_id) from None

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """The engine's stats, as the one replica "local"."""
        stats = await self.engine.stats()
        adapters = stats["adapters"]
        device = list(adapters["resident"])
        stats["tiers"] = {
            "device": device,
            "host": sorted(set(adapters["host"]) - set(device)),
            "loading": list(adapters["loading"]),
        }
        return {LOCAL_REPLICA: stats}
