"""Attention over a paged KV cache (block tables) — torch reference.

The cache of one layer is viewed as

    k_cache, v_cache  [num_pages, block_size, kv_heads, head_dim]

and sequence i's token j lives at (block_tables[i, j // block_size], j % block_size).

Contract of `paged_attention` (causal; GQA: query head h reads kv head h // (H / kv_heads)):

    for i in range(B):
        for qi in range(q_lens[i]):                     # padded rows qi >= q_lens[i] are 0
            p = q_start[i] + qi                         # absolute position of the query
            keys = tokens 0..p of sequence i (all < ctx_lens[i])
            out[i, qi] = softmax(q[i, qi] . K[keys] * scale) @ V[keys]

The decode form is the case q_lens == 1, q_start == ctx_lens - 1; the prefill form
(a chunk of new tokens after q_start cached ones) is the general case.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    cache_rows: torch.Tensor,  # [num_rows, kv_heads * head_dim] the pool seen as KV rows
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_rows: torch.Tensor,  # [T] int64 row of each token's K slot
    v_rows: torch.Tensor,  # [T] int64 row of each token's V slot
) -> None:
    """cache_rows[k_rows[t]] = k[t]; cache_rows[v_rows[t]] = v[t], in the cache's dtype."""
    cache_rows.index_copy_(0, k_rows, k.reshape(k.shape[0], -1).to(cache_rows.dtype))
    cache_rows.index_copy_(0, v_rows, v.reshape(v.shape[0], -1).to(cache_rows.dtype))


def attention_mask(
    q_start: torch.Tensor,  # [B] position of each row's first query
    q_len_max: int,
    ctx_lens: torch.Tensor,  # [B] keys in the cache after this step's writes
    ctx_max: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """[B, 1, q_len_max, ctx_max] bool: query qi of row i may read key j. Built once per step.
    With a sliding window (Mistral), a query at position p reads keys p - window < j <= p."""
    q_pos = (q_start[:, None] + torch.arange(q_len_max)[None, :])[:, :, None]  # [B, Q, 1]
    keys = torch.arange(ctx_max)[None, None, :]
    mask = (keys <= q_pos) & (keys < ctx_lens[:, None, None])
    if sliding_window is not None:
        mask &= keys > q_pos - sliding_window
    return mask[:, None]


def attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """The bool mask as the float32 bias SDPA adds (0 where read, -inf elsewhere), built once
    per step: given the bool mask, SDPA converts it in every layer."""
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


def paged_attention(
    q: torch.Tensor,  # [B, Q, H, head_dim], padded rows arbitrary
    k_cache: torch.Tensor,  # [num_pages, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int64, padded with any valid page
    mask: torch.Tensor,  # [B, 1, Q, max_blocks * block_size] bool from attention_mask, or
    # its attention_bias
    scale: float,
) -> torch.Tensor:  # [B, Q, H, head_dim]
    b, nb = block_tables.shape
    bs, kvh, hd = k_cache.shape[1:]
    # index_select on the page dim is ~4x faster than advanced indexing on these strided views
    pages = block_tables.reshape(-1)
    k = k_cache.index_select(0, pages).view(b, nb * bs, kvh, hd).transpose(1, 2)
    v = v_cache.index_select(0, pages).view(b, nb * bs, kvh, hd).transpose(1, 2)
    qt = q.transpose(1, 2)
    compute = q.dtype
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        # torch's CPU attention in bf16 took 1.83 ms a layer on SmolLM2's decode shape (32
        # rows, 80 keys, one thread) against 0.33 ms with the operands cast to fp32: half of
        # a bf16 step. fp32 is also the more accurate of the two.
        compute = torch.float32
    # a cache narrower than q (kv_cache_dtype) is widened to q's dtype here
    qt, k, v = (t if t.dtype == compute else t.to(compute) for t in (qt, k, v))
    if mask.is_floating_point() and mask.dtype != qt.dtype:
        mask = mask.to(qt.dtype)
    out = F.scaled_dot_product_attention(
        qt, k, v, attn_mask=mask, scale=scale, enable_gqa=kvh != q.shape[2]
    )
    return out.transpose(1, 2).to(q.dtype)
