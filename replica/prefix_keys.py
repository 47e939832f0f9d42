"""Prefix-cache block keys: how a replica's prefix cache names a full KV block, and how the
ingress names a prompt's first blocks to route it where they are cached. One definition,
used by both (replica/memory/prefix_cache.py, and the router through replica/protocol.py,
which re-exports it): two copies could drift, and then no routed prefix would ever hit.

key(-1) = root = sha256(tag, adapter version, salt), each part framed (absent, or length
and bytes) so no two part lists hash alike; key(i) = sha256(key(i-1) + block i's token ids
as int64). A key names a full block and everything before it, computed with one adapter's
exact weights (the version is their content digest; None for the base model) within one
salt (the tenant, narrowed by a request's cache_salt).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_TAG = b"loraplex-prefix-v1"


def prefix_root(
    version: str | None, tenant: str | None, cache_salt: str | None, *, share_base: bool = False
) -> bytes:
    """The root of a request's chain of block keys: its adapter version (None: the base
    model) and its salt (the tenant, narrowed by the request's cache_salt; with
    `share_base`, a base-model request's tenant is left out, so base-model blocks are shared
    across tenants, never adapter blocks). Each part is framed (absent, or length and
    bytes), so no two part lists hash alike."""
    if version is None and share_base:
        tenant = None
    h = hashlib.sha256(ROOT_TAG)
    for part in (version, tenant, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode()
            h.update(b"\x01" + len(raw).to_bytes(4, "little") + raw)
    return h.digest()


def extend_block_keys(
    keys: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int, n: int
) -> list[bytes]:
    """Append to the chain `keys` (the keys of blocks 0..len(keys)-1 of `token_ids`) the
    keys of blocks len(keys)..n-1: key(i) = sha256(key(i-1) + the block's token ids as
    int64), key(-1) = root. A key names a full block and everything before it."""
    parent = keys[-1] if keys else root
    for i in range(len(keys), n):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent)
    return keys
