"""The unified paged pool (S-LoRA unified paging, seed 002).

One arena per device, cut into fixed-size pages. KV-cache blocks and adapter weights both
take pages from the same free list, so the split between them moves with load. A third kind,
CACHED, is a full KV block no running request holds, kept for the prefix cache: like an idle
adapter it is evictable (memory/prefix_cache.py). Pages are
never required to be contiguous: a KV block is one page, and an adapter is laid out as
row-chunks that each live inside one page (see `RowPacker`). So an allocation of n pages
succeeds whenever n pages are free: there is no external fragmentation.

Ownership and pins are tracked per page. A pinned page cannot be freed; the adapter cache
pins an adapter's pages while a running request uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch


class PageKind(IntEnum):
    FREE = 0
    KV = 1  # a KV block held by running requests
    ADAPTER = 2
    CACHED = 3  # a full KV block no running request holds, kept for the prefix cache


class PoolExhausted(RuntimeError):
    """Fewer pages are free (after reclaiming) than an allocation asked for."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_pages: int
    page_bytes: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    pinned_pages: int
    cached_pages: int


class UnifiedPool:
    """`arena[page]` is one page of `page_elems` elements of the model dtype."""

    def __init__(self, num_pages: int, page_elems: int, dtype: torch.dtype, device: torch.device):
        if num_pages < 1 or page_elems < 1:
            raise ValueError(
                f"pool needs >= 1 page of >= 1 element, got {num_pages} x {page_elems}"
            )
        self.arena = torch.zeros(num_pages, page_elems, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_elems = page_elems
        self.kind = np.zeros(num_pages, dtype=np.int8)
        self.pins = np.zeros(num_pages, dtype=np.int32)
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._reclaim: Callable[[int], None] | None = None

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.arena.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def set_reclaimer(self, reclaim: Callable[[int], None]) -> None:
        """`reclaim(n)` is asked to free pages (e.g. evict idle adapters) when an
        allocation finds fewer than n free. It may free fewer."""
        self._reclaim = reclaim

    def can_allocate(self, n: int, *, reclaim: bool = True) -> bool:
        if n <= self.num_free:
            return True
        if reclaim and self._reclaim is not None:
            self._reclaim(n - self.num_free)
        return n <= self.num_free

    def allocate(self, n: int, kind: PageKind, *, reclaim: bool = True) -> list[int]:
        assert kind != PageKind.FREE
        if not self.can_allocate(n, reclaim=reclaim):
            raise PoolExhausted(f"need {n} pages, {self.num_free} free of {self.num_pages}")
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        assert not self.kind[pages].any(), "allocated a page that was already owned"
        self.kind[pages] = kind
        return pages

    def free(self, pages: list[int]) -> None:
        if not pages:
            return
        assert self.kind[pages].all(), "freed a page that was not allocated"
        assert not self.pins[pages].any(), "freed a pinned page"
        assert len(set(pages)) == len(pages), "freed a page twice"
        self.kind[pages] = PageKind.FREE
        self._free.extend(pages)

    def retag(self, pages: list[int], kind: PageKind) -> None:
        """Pages change kind without leaving their owner (a KV block parked in the prefix
        cache, or taken back from it)."""
        assert kind != PageKind.FREE and self.kind[pages].all(), "retagged a free page"
        self.kind[pages] = kind

    def pin(self, pages: list[int]) -> None:
        assert self.kind[pages].all(), "pinned a free page"
        np.add.at(self.pins, pages, 1)

    def unpin(self, pages: list[int]) -> None:
        np.subtract.at(self.pins, pages, 1)
        assert (self.pins[pages] >= 0).all(), "unpinned a page more often than pinned"

    def stats(self) -> PoolStats:
        return PoolStats(
            num_pages=self.num_pages,
            page_bytes=self.page_bytes,
            free_pages=self.num_free,
            kv_pages=int((self.kind == PageKind.KV).sum()),
            adapter_pages=int((self.kind == PageKind.ADAPTER).sum()),
            pinned_pages=int((self.pins > 0).sum()),
            cached_pages=int((self.kind == PageKind.CACHED).sum()),
        )

    def check_invariants(self) -> None:
        """Every page is either free (exactly once in the free list) or owned."""
        free = np.zeros(self.num_pages, dtype=np.int32)
        np.add.at(free, self._free, 1)
        assert (free <= 1).all(), "a page is in the free list twice"
        assert ((free == 1) == (self.kind == PageKind.FREE)).all(), "free list and kinds disagree"
        assert not (self.pins[self.kind == PageKind.FREE] > 0).any(), "a free page is pinned"


@dataclass(frozen=True, slots=True)
class RowChunk:
    """`rows` consecutive rows of one matrix stored in `page` at element `offset`."""

    page: int  # index into the allocation's page list until placed, then a pool page id
    offset: int
    row_start: int
    rows: int


@dataclass(frozen=True, slots=True)
class MatrixPlacement:
    rows: int
    row_len: int
    chunks: tuple[RowChunk, ...]


class RowPacker:
    """Lays matrices out as whole rows in fixed-size pages, in the order given.

    No row is split across pages: a row that does not fit in the rest of the current
    page starts the next one. A matrix that does not fit in one page is split into a few
    row-chunks. Packing matrices that are used together (e.g. the A matrices of q, k and
    v, which share the input) back to back keeps them in one chunk, so a kernel can read
    them as one [r_q + r_k + r_v, in] view.
    """

    def __init__(self, page_elems: int):
        self.page_elems = page_elems
        self.page = 0
        self.offset = 0
        self.used_elems = 0
        self.placements: list[MatrixPlacement] = []

    def add(self, rows: int, row_len: int) -> int:
        if row_len > self.page_elems:
            raise ValueError(
                f"a row of {row_len} elements does not fit a page of {self.page_elems}"
            )
        chunks = []
        row = 0
        while row < rows:
            fit = (self.page_elems - self.offset) // row_len
            if fit == 0:
                self.page, self.offset = self.page + 1, 0
                continue
            take = min(fit, rows - row)
            chunks.append(RowChunk(self.page, self.offset, row, take))
            self.offset += take * row_len
            row += take
        self.used_elems += rows * row_len
        self.placements.append(MatrixPlacement(rows, row_len, tuple(chunks)))
        return len(self.placements) - 1

    @property
    def num_pages(self) -> int:
        return self.page + (1 if self.offset > 0 else 0)

    def fragmentation(self) -> float:
        """Unused fraction of the pages this layout occupies."""
        total = self.num_pages * self.page_elems
        return 0.0 if total == 0 else 1.0 - self.used_elems / total


def chunk_views(
    arena: torch.Tensor, placement: MatrixPlacement, pages: list[int]
) -> list[torch.Tensor]:
    """Views [rows_i, row_len] into the arena for each chunk of a placed matrix."""
    views = []
    for c in placement.chunks:
        n = c.rows * placement.row_len
        views.append(arena[pages[c.page], c.offset : c.offset + n].view(c.rows, placement.row_len))
    return views
