"""Paged attention, decode form, in Triton: one query token per sequence, keys and values
read in place from the paged KV cache through block tables; GQA.

Contract (same as `kernels.attention.paged_attention` with q_lens == 1):

    for b in range(B):
        for hq in range(H):
            kvh = hq // (H // KVH)
            p = ctx_lens[b] - 1                         # the query's position
            keys = [j for j in range(ctx_lens[b]) if window == 0 or j > p - window]
            K[j] = k_cache[block_tables[b, j // bs], j % bs, kvh]          # same for V
            out[b, hq] = softmax(q[b, hq] . K[keys] * scale) @ V[keys]     # fp32 softmax
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton_check import FLOAT_DTYPES, check, check_tensor

NO_WINDOW = 1 << 30


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [B, H, D]
    q_ptr,  # [B, H, D]
    k_ptr,  # [P, bs, KVH, D] (strided: a view of the pool)
    v_ptr,  # [P, bs, KVH, D] (strided)
    block_tables_ptr,  # [B, max_blocks]
    ctx_lens_ptr,  # [B]
    scale,
    window,  # keys j >= ctx - window are read (a huge window: all)
    stride_ob,
    stride_oh,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_bt,
    block_size,
    head_dim,
    group,  # H // KVH
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    kvh = hq // group
    ctx = tl.load(ctx_lens_ptr + b)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + hq * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    lo = tl.maximum(ctx - window, 0)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for blk in range(lo // block_size, tl.cdiv(ctx, block_size)):
        page = tl.load(block_tables_ptr + b * stride_bt + blk).to(tl.int64)
        t = tl.arange(0, BLOCK_T)
        pos = blk * block_size + t
        ok = (t < block_size) & (pos < ctx) & (pos >= lo)
        kt = tl.load(
            k_ptr + page * stride_kp + t[:, None] * stride_kt + kvh * stride_kh + d[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        s = tl.where(ok, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        vt = tl.load(
            v_ptr + page * stride_vp + t[:, None] * stride_vt + kvh * stride_vh + d[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(vt * p[:, None], axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(
        out_ptr + b * stride_ob + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok
    )


def paged_attention_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_pages, block_size, KVH, D], head_dim contiguous
    v_cache: torch.Tensor,  # [num_pages, block_size, KVH, D], head_dim contiguous
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    ctx_lens: torch.Tensor,  # [B] int32, each >= 1 and <= max_blocks * block_size
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [B, H, D]
    dev = q.device
    check_tensor("q", q, dims=3, dtypes=FLOAT_DTYPES, device=dev, inner_contiguous=True)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):  # read as float32
        check_tensor(name, c, dims=4, dtypes=FLOAT_DTYPES, device=dev, inner_contiguous=True)
    check(k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape")
    check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache differ in dtype")
    _, block_size, kv_heads, head_dim = k_cache.shape
    b, heads, qd = q.shape
    check(qd == head_dim, f"q head_dim {qd} != cache head_dim {head_dim}")
    check(heads % kv_heads == 0, f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    idx = (torch.int32, torch.int64)
    check_tensor(
        "block_tables", block_tables, dims=2, dtypes=idx, device=dev, inner_contiguous=True
    )
    check_tensor("ctx_lens", ctx_lens, dims=1, dtypes=(torch.int32,), device=dev, contiguous=True)
    check(
        block_tables.shape[0] == b and ctx_lens.shape[0] == b, "one block table and length per row"
    )
    out = torch.empty_like(q)
    if b == 0:
        return out
    _paged_decode_kernel[(b, heads)](
        out, q, k_cache, v_cache, block_tables, ctx_lens, scale, sliding_window or NO_WINDOW,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        block_size, head_dim, heads // kv_heads,
        BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out
