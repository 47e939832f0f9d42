"""Paged attention, decode form, in torch ops: the path of a decode group when the backend
has no decode kernel (CPU). Same contract as the Triton `paged_attention_decode`, tested
against the reference `kernels.attention.paged_attention`:

    for b in range(B):
        for hq in range(H):
            kvh = hq // (H // KVH)
            p = ctx_lens[b] - 1                         # the query's position
            keys = [j for j in range(ctx_lens[b]) if window is None or j > p - window]
            out[b, hq] = softmax(q[b, hq] . K[b, keys, kvh] * scale) @ V[b, keys, kvh]

scores, softmax and the product with V are computed in float32 whatever the cache's dtype
(a narrower cache, `kv_cache_dtype: bfloat16`, is gathered in its own dtype, half the bytes
read from the pool, then widened into a float32 buffer kept for the step: on this
project's CPU the widening costs about what the smaller gather saves).

The pool is read as rows of head_dim elements. `decode_rows` finds, once per step, the
rows of layer 0's keys and values, ordered [K|V, B, KVH, N] (N: the longest context;
shorter rows repeat their last key, masked out by the bias); layer l's are the same rows of
the pool seen from l layers further on, so no layer has rows of its own to compute or keep.
Each layer then gathers its rows into one reusable buffer and runs two batched matmuls over
[B * KVH] blocks of GQA query heads. Against the reference (a gather of whole pages per K
and per V, then SDPA with a bool mask) this copies only the keys the step reads, in the
layout the matmuls take, into memory that is not reallocated each layer, and converts no
mask per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.attention import attention_bias


@dataclass(frozen=True, slots=True)
class DecodeRows:
    rows: torch.Tensor  # [2 * B * KVH * N] int64 pool rows of layer 0: K then V, [B, KVH, N]
    layer_rows: int  # rows from one layer's to the next's: layer l reads rows + l * this
    bias: torch.Tensor  # [B * KVH, H // KVH, N] float32: 0 on a key the query reads, -inf else
    gathered: torch.Tensor  # [2 * B * KVH * N, head_dim] cache dtype, every layer's buffer
    wide: torch.Tensor | None  # the same in float32 when the cache is narrower; else None


def decode_rows(
    kv_cache: torch.Tensor,  # [num_pages, num_layers, 2, block_size, KVH, head_dim] pool view
    pool_rows: torch.Tensor,  # [rows, head_dim] the same pool
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    ctx_lens: torch.Tensor,  # [B] keys in the cache after this step's writes, each >= 1
    num_heads: int,
    sliding_window: int | None,
) -> DecodeRows:
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    page, layer, k_or_v, token, head, elem = kv_cache.stride()
    assert elem == 1 and pool_rows.is_contiguous() and pool_rows.shape[1] == head_dim
    assert pool_rows.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    # every step between two of the pool's rows is a whole number of rows: counted in rows
    offset = kv_cache.storage_offset() - pool_rows.storage_offset()
    assert all(s % head_dim == 0 for s in (page, layer, k_or_v, token, head, offset))
    page, layer, k_or_v, token, head, offset = (
        s // head_dim for s in (page, layer, k_or_v, token, head, offset)
    )
    device = block_tables.device
    ctx = ctx_lens.to(torch.int64)
    n = int(ctx.max())
    keys = torch.arange(n, device=device)
    key = torch.minimum(keys[None, :], ctx[:, None] - 1)  # [B, N]
    first = block_tables.gather(1, key // block_size) * page + (key % block_size) * token
    first += offset
    rows = (
        first[None, :, None, :]
        + torch.arange(2, device=device)[:, None, None, None] * k_or_v
        + torch.arange(kv_heads, device=device)[None, None, :, None] * head
    ).view(-1)  # [2, B, KVH, N] rows of layer 0

    reads = keys[None, :] < ctx[:, None]
    if sliding_window is not None:
        reads &= keys[None, :] > ctx[:, None] - 1 - sliding_window
    bias = attention_bias(reads)
    b = block_tables.shape[0]
    group = num_heads // kv_heads
    bias = bias[:, None, None, :].expand(b, kv_heads, group, n).reshape(b * kv_heads, group, n)
    gathered = torch.empty(rows.shape[0], head_dim, dtype=kv_cache.dtype, device=device)
    wide = (
        None if kv_cache.dtype == torch.float32 else torch.empty_like(gathered, dtype=torch.float32)
    )
    return DecodeRows(rows, layer, bias, gathered, wide)


def decode_attention(
    q: torch.Tensor,  # [B, H, head_dim], may be strided
    pool_rows: torch.Tensor,  # [rows, head_dim] the pool, as given to decode_rows
    step: DecodeRows,
    layer: int,
    scale: float,
) -> torch.Tensor:  # [B, H, head_dim] in q's dtype
    b, h, head_dim = q.shape
    blocks, group, n = step.bias.shape
    torch.index_select(pool_rows[layer * step.layer_rows :], 0, step.rows, out=step.gathered)
    kv = step.gathered if step.wide is None else step.wide.copy_(step.gathered)
    k, v = kv.view(2, blocks, n, head_dim)
    dtype = q.dtype
    q = q.reshape(blocks, group, head_dim).float()
    scores = torch.baddbmm(step.bias, q, k.transpose(1, 2), alpha=scale)
    out = torch.bmm(scores.softmax(-1), v).view(b, h, head_dim)
    return out if out.dtype == dtype else out.to(dtype)
