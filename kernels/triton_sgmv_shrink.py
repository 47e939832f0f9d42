"""LoRA shrink, prefill form (Punica SGMV), in Triton: segments of tokens sharing an adapter.

Contract (A_cat rows read in place from the pool through the row table):

    for seg in range(num_segs):
        w = seg_slot[seg]                            # segments never hold base tokens
        for t in seg_start[seg] .. seg_start[seg] + seg_len[seg] - 1:
            for r in range(ranks[w]):
                h[t, r] = sum_k x[t, k] * arena[a_rows[w, r] + k]     # fp32 accumulate

Rows t of tokens without an adapter and columns r >= ranks[w] of h are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton_check import (
    check_lora_io,
    check_segments,
    check_shrink_tables,
    dot_in_fp32,
)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,  # [T, K]
    arena_ptr,  # [num_elems] the pool, flat
    h_ptr,  # [T, R_max] fp32
    seg_start_ptr,  # [num_segs]
    seg_len_ptr,  # [num_segs]
    seg_slot_ptr,  # [num_segs]
    ranks_ptr,  # [S] (strided)
    a_rows_ptr,  # [S, R_cap] (strided)
    K,
    stride_xm,
    stride_hm,
    stride_rank,
    stride_as,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    r0 = tl.program_id(2) * BLOCK_R
    slot = tl.load(seg_slot_ptr + seg)
    rank = tl.load(ranks_ptr + slot * stride_rank)
    seg_len = tl.load(seg_len_ptr + seg)
    if (m0 >= seg_len) | (r0 >= rank):
        return
    start = tl.load(seg_start_ptr + seg)
    m = m0 + tl.arange(0, BLOCK_M)
    r = r0 + tl.arange(0, BLOCK_R)
    m_ok = m < seg_len
    r_ok = r < rank
    rows = tl.load(a_rows_ptr + slot * stride_as + r, mask=r_ok, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(
            x_ptr + (start + m)[:, None] * stride_xm + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        at = tl.load(
            arena_ptr + rows[None, :] + k[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0
        )
        if DOT_F32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    tl.store(
        h_ptr + (start + m)[:, None] * stride_hm + r[None, :],
        acc,
        mask=m_ok[:, None] & r_ok[None, :],
    )


def sgmv_shrink(
    h: torch.Tensor,  # [T, R_max] float32, written
    x: torch.Tensor,  # [T, K]
    arena: torch.Tensor,  # [num_pages, page_elems] or flat, same dtype as x
    seg_start: torch.Tensor,  # [num_segs] int32
    seg_len: torch.Tensor,  # [num_segs] int32
    seg_slot: torch.Tensor,  # [num_segs] int32, each >= 0
    ranks: torch.Tensor,  # [S] int32 (any stride)
    a_rows: torch.Tensor,  # [S, R_cap] int64 (last dim contiguous)
    max_seg_len: int,
    max_rank: int,  # >= every ranks[w] used (sizes the grid)
    validate: bool = True,  # False: the caller checked this step's tables (TritonBackend)
) -> None:
    if validate:
        check_lora_io("x", x, h, arena)
        check_segments(seg_start, seg_len, seg_slot, x.device)
        check_shrink_tables(ranks, a_rows, max_rank, h)
    num_segs = seg_start.shape[0]
    if num_segs == 0 or max_seg_len == 0 or max_rank == 0:
        return
    block_m, block_r, block_k = 16, 16, 32
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(max_rank, block_r))
    _sgmv_shrink_kernel[grid](
        x, arena, h, seg_start, seg_len, seg_slot, ranks, a_rows,
        x.shape[1], x.stride(0), h.stride(0), ranks.stride(0), a_rows.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, DOT_F32=dot_in_fp32(x),
    )  # fmt: skip
