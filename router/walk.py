"""Each adapter's consistent-hash walk over the replicas (rendezvous hashing)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from loraplex.replica.protocol import adapter_name


def walk_order(adapter: str, replica_ids: Sequence[str]) -> list[str]:
    """The adapter's consistent-hash walk: replicas by descending hash(name, replica)
    (rendezvous hashing), the name being the adapter's without its version, so a name's new
    version goes where its old one was. The first is the adapter's home. Removing a replica
    changes the home only of the adapters it was home to, and adding one takes only the
    adapters it now outranks: ~1/N either way. A hot home's overflow goes to each adapter's own next
    replica, so it spreads over all others instead of piling onto one ring neighbour.
    blake2b, not hash(): every router process must agree on the walk."""
    return list(cached_walk(adapter, tuple(replica_ids)))


@functools.lru_cache(maxsize=1 << 16)  # the replica set changes rarely: walks repeat
def cached_walk(adapter: str, replica_ids: tuple[str, ...]) -> tuple[str, ...]:
    name = adapter_name(adapter)

    def weight(replica_id: str) -> bytes:
        key = f"{name}\0{replica_id}".encode()
        return hashlib.blake2b(key, digest_size=8).digest()

    return tuple(sorted(replica_ids, key=lambda rid: (weight(rid), rid), reverse=True))
