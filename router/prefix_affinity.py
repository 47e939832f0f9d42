"""Which replica served which prompt prefix: the router's side of prefix affinity (pure).

A prompt is named by the keys of its first full KV blocks (`protocol.extend_block_keys`:
each key covers its block and everything before it, and the chain starts from the adapter
version and the tenant, as the replica keys its prefix cache). After a request is routed,
its keys are recorded against the replica; a later request matches a replica by the longest
run of its leading keys recorded there (from the first: a block is only reusable after
its parent). That replica most likely still holds those blocks
in its prefix cache, so prefilling there skips them.

The index is an estimate kept by each router from its own placements, as SGLang's
cache-aware router and Ray Serve's `PrefixCacheAffinityRouter`
(`ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py`, a text
prefix tree filled in `on_request_routed`) keep theirs: it does not see a replica's
evictions, so entries expire after `ttl_s` without use, and it holds at most `max_keys`
keys, the least recently used going first. A key is kept as its first 8 bytes: a
collision (2^-64 per pair) only misplaces one request's routing hint.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, max_keys: int, ttl_s: float):
        if max_keys < 1 or not ttl_s > 0:
            raise ValueError(f"need max_keys >= 1 and ttl_s > 0, got {max_keys} and {ttl_s}")
        self.max_keys = max_keys
        self.ttl_s = ttl_s
        # key -> {replica: last time a request with this prefix was sent there}; least
        # recently used key first
        self._holders: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()
        self.replicas: set[str] = set()  # every replica some key was recorded for

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, keys: Sequence[bytes], replica_id: str, now: float) -> None:
        """A request whose prompt starts with the blocks `keys` was sent to `replica_id`."""
        holders = self._holders
        self.replicas.add(replica_id)
        # deepest first, so a prompt's first blocks (shared by the most prompts) are the most
        # recently used and the last to go, as the replica's cache evicts deepest first
        for key in map(_short, reversed(keys)):
            entry = holders.get(key)
            if entry is None:
                holders[key] = entry = {}
            else:
                holders.move_to_end(key)
            entry[replica_id] = now
        while len(holders) > self.max_keys:
            holders.popitem(last=False)

    def matched(
        self, keys: Sequence[bytes], replica_ids: Iterable[str], now: float
    ) -> dict[str, int]:
        """For each replica, how many leading blocks of `keys` were sent there within
        ttl_s: the longest run from the first block (a block is only reusable after its
        parent). Replicas matching none are absent."""
        horizon = now - self.ttl_s
        candidates = set(replica_ids)
        found: dict[str, int] = {}
        for depth, key in enumerate(keys, start=1):
            entry = self._holders.get(_short(key))
            if entry is None:
                break
            candidates = {r for r in candidates if entry.get(r, -math.inf) >= horizon}
            if not candidates:
                break
            for replica_id in candidates:
                found[replica_id] = depth
        return found

    def forget(self, alive: set[str]) -> None:
        """Drop replicas no longer in the deployment."""
        self.replicas &= alive
        for key in list(self._holders):
            entry = self._holders[key]
            for replica_id in [r for r in entry if r not in alive]:
                del entry[replica_id]
            if not entry:
                del self._holders[key]


def _short(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")
