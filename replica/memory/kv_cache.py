"""KV-cache blocks in the unified pool: one block is one page holding `block_size` tokens of
K and V for every layer.

Each block has a reference count: the running sequences whose block table holds it. With a
prefix cache, a sequence starts from the cached blocks of its prompt's longest cached
prefix (`match`), shared with other requests; the blocks it fills are registered as they
fill (`commit`); a block whose last holder leaves stays cached (prefix_cache.py) instead of
being freed. Only full blocks are shared, and a sequence writes only past its shared ones.
"""

from __future__ import annotations

import numpy as np
import torch

from loraplex.replica.memory.pool import PageKind, UnifiedPool
from loraplex.replica.memory.prefix_cache import PrefixCache
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.sequence import Sequence


class KVCache:
    """The pool's pages as KV blocks. `dtype` is what K and V are stored in (default: the
    pool's): a narrower one than the pool's (bfloat16 KV beside float32 weights, the
    engine's `kv_cache_dtype`) views the same pages as that dtype, so a page holds that
    many more tokens and the attention reads that many fewer bytes; the pages themselves,
    and what the pool counts, are unchanged."""

    def __init__(self, pool: UnifiedPool, cfg: ModelConfig, dtype: torch.dtype | None = None):
        arena = pool.arena if dtype is None else _view_as(pool.arena, dtype)
        page_elems = arena.shape[1]
        elem = arena.element_size()
        per_token = cfg.kv_elems_per_token()
        self.block_size = page_elems // per_token
        if self.block_size < 1:
            raise ValueError(
                f"a page of {pool.page_bytes} bytes cannot hold one token's KV "
                f"({per_token * elem} bytes); raise page_bytes"
            )
        if page_elems % cfg.kv_size:
            raise ValueError(
                f"page_bytes {pool.page_bytes} must be a multiple of one KV row "
                f"(kv_heads * head_dim * dtype size = {cfg.kv_size * elem} bytes)"
            )
        self.pool = pool
        self.dtype = arena.dtype
        self.num_layers = cfg.num_layers
        n = pool.num_pages
        # page layout: [layer, K|V, block_size, kv_heads, head_dim]
        self.view = arena[:, : self.block_size * per_token].view(
            n, cfg.num_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim
        )
        self.rows = arena.view(-1, cfg.kv_size)  # writes go through index_copy_ on rows
        self.rows_per_page = page_elems // cfg.kv_size
        self.refs = np.zeros(n, dtype=np.int32)  # running sequences holding each block
        self.prefix: PrefixCache | None = None  # set to cache full blocks (engine.py)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` tokens. False (nothing changed) if the pool,
        after reclaiming idle adapter pages, cannot."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        pages = self.pool.allocate(missing, PageKind.KV)
        self.refs[pages] = 1
        seq.block_table.extend(pages)
        return True

    def free(self, seq: Sequence) -> None:
        """`seq` lets go of its blocks: each is freed, or kept cached, once no sequence
        holds it."""
        pages = seq.block_table
        seq.block_table = []
        if not pages:
            return
        self.refs[pages] -= 1  # a table never holds a page twice
        assert (self.refs[pages] >= 0).all(), "a block was let go more often than held"
        unheld = [p for p in pages if self.refs[p] == 0]
        if self.prefix is not None:
            unheld = self.prefix.park(unheld)
        self.pool.free(unheld)

    def match(self, seq: Sequence, root: bytes) -> int:
        """At admission: start `seq` from the cached blocks of its longest cached prefix
        (full blocks only, and never its last token: that one is computed for its logits).
        The number of blocks it now holds; `free` undoes it."""
        assert self.prefix is not None and not seq.block_table and seq.num_computed == 0
        if seq.prefix_root != root:
            seq.prefix_root, seq.block_keys = root, []
        limit = (seq.num_tokens - 1) // self.block_size
        if len(seq.block_keys) < limit:
            self.prefix.extend_keys(seq.block_keys, root, seq.all_token_ids(), limit)
        pages = self.prefix.lookup(seq.block_keys[:limit])
        self.prefix.take(pages)
        self.refs[pages] += 1
        seq.block_table = pages
        seq.num_computed = seq.num_committed = len(pages) * self.block_size
        return len(pages)

    def admitted(self, seq: Sequence) -> None:
        """`seq`'s admission went through: count its lookup, and its hits as uses."""
        prefix = self.prefix
        assert prefix is not None
        hits = seq.num_computed // self.block_size
        limit = (seq.num_tokens - 1) // self.block_size
        prefix.touch(seq.block_table[:hits])
        prefix.stats.lookups += 1
        prefix.stats.hit_blocks += hits
        prefix.stats.miss_blocks += limit - hits
        prefix.stats.hit_tokens += hits * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hits * self.block_size

    def commit(self, seq: Sequence) -> None:
        """After a step: register the blocks `seq` filled (their KV is in the cache now)."""
        if self.prefix is None or seq.prefix_root is None:
            return
        bs = self.block_size
        first, full = seq.num_committed // bs, seq.num_computed // bs
        if full <= first:
            return
        if len(seq.block_keys) < full:
            self.prefix.extend_keys(seq.block_keys, seq.prefix_root, seq.all_token_ids(), full)
        for i in range(first, full):
            self.prefix.register(seq.block_keys[i], seq.block_table[i], i)
        seq.num_committed = full * bs

    def slots(self, seq: Sequence, start: int, end: int) -> tuple[list[int], list[int]]:
        """(page, offset) of positions start..end-1 of `seq`."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] for p in range(start, end)], [p % bs for p in range(start, end)]

    def write_rows(self, pages: list[int], offsets: list[int]) -> torch.Tensor:
        """[num_layers, 2, T] rows of `self.rows` where each token's K and V go, per layer."""
        base = torch.tensor(pages, dtype=torch.int64) * self.rows_per_page + torch.tensor(
            offsets, dtype=torch.int64
        )
        layer_kv = torch.arange(self.num_layers * 2, dtype=torch.int64).view(self.num_layers, 2, 1)
        return base[None, None, :] + layer_kv * self.block_size

    def block_table_tensor(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [s.block_table[0]] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int64)


def _view_as(arena: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The arena's bytes as `dtype` elements (same pages, each of page_bytes / its size)."""
    if dtype == arena.dtype:
        return arena
    if dtype.itemsize > arena.element_size():
        raise ValueError(
            f"a KV cache of {dtype} cannot be wider than the pool's {arena.dtype}: "
            "choose kv_cache_dtype auto or a narrower one"
        )
    return arena.view(dtype)
