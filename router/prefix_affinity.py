"""Which replica served which prompt prefix: the router's side of prefix affinity (pure).

A prompt is named by the keys of its first full KV blocks (`protocol.extend_block_keys`:
each key covers its block and everything before it, and the chain starts from the adapter
version and the tenant, as the replica keys its prefix cache). After a request is routed,
its keys are recorded against the replica; a later request matches a replica by the longest
run of its leading keys recorded there. That replica most likely still holds those blocks
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

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, keys: Sequence[bytes], replica_id: str, now: float) -> None:
        """A request whose prompt starts with the blocks `keys` was sent to `replica_id`."""
        holders = self._holders
        for key in map(_short, keys):
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
        """For each replica, how many leading blocks of `keys` it was sent within ttl_s
        (keys chain, so the deepest key recorded for a replica gives its whole match)."""
        wanted = set(replica_ids)
        found: dict[str, int] = {}
        horizon = now - self.ttl_s
        for depth in range(len(keys), 0, -1):
            entry = self._holders.get(_short(keys[depth - 1]))
            if entry is None:
                continue
            for replica_id, at in entry.items():
                if at >= horizon and replica_id in wanted and replica_id not in found:
                    found[replica_id] = depth
            if len(found) == len(wanted):
                break
        return found

    def forget(self, alive: set[str]) -> None:
        """Drop replicas no longer in the deployment."""
        for key in list(self._holders):
            entry = self._holders[key]
            for replica_id in [r for r in entry if r not in alive]:
                del entry[replica_id]
            if not entry:
                del self._holders[key]


def _short(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")
