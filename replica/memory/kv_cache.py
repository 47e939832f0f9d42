"""KV-cache blocks in the unified pool: one block is one page holding `block_size` tokens of
K and V for every layer."""

from __future__ import annotations

import torch

from loraplex.replica.memory.pool import PageKind, UnifiedPool
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.sequence import Sequence


class KVCache:
    def __init__(self, pool: UnifiedPool, cfg: ModelConfig):
        per_token = cfg.kv_elems_per_token()
        self.block_size = pool.page_elems // per_token
        if self.block_size < 1:
            raise ValueError(
                f"a page of {pool.page_bytes} bytes cannot hold one token's KV "
                f"({per_token * pool.arena.element_size()} bytes); raise page_bytes"
            )
        if pool.page_elems % cfg.kv_size:
            raise ValueError(
                f"page_bytes {pool.page_bytes} must be a multiple of one KV row "
                f"(kv_heads * head_dim * dtype size = {cfg.kv_size * pool.arena.element_size()} bytes)"
            )
        self.pool = pool
        self.num_layers = cfg.num_layers
        n = pool.num_pages
        # page layout: [layer, K|V, block_size, kv_heads, head_dim]
        self.view = pool.arena[:, : self.block_size * per_token].view(
            n, cfg.num_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim
        )
        self.rows = pool.arena.view(-1, cfg.kv_size)  # writes go through index_copy_ on rows
        self.rows_per_page = pool.page_elems // cfg.kv_size

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
        seq.block_table.extend(self.pool.allocate(missing, PageKind.KV))
        return True

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []

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
