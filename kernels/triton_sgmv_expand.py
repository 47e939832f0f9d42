"""LoRA expand, prefill form (Punica SGMV), in Triton; every target of a group (q/k/v or
gate/up) in one launch, with a fused per-adapter scale.

Contract (Bt rows read in place from the pool through the row table):

    for seg in range(num_segs):
        w = seg_slot[seg]
        for j in range(J):                           # the group's targets
            for t in seg_start[seg] .. seg_start[seg] + seg_len[seg] - 1:
                for n in range(cols[j + 1] - cols[j]):
                    y[t, cols[j] + n] += scales[w] * sum_{r < t_rank[w, j]}
                        h[t, t_hoff[w, j] + r] * arena[b_rows[w, j, r] + n]

A target the adapter lacks has t_rank 0 and adds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton_check import (
    check_expand_tables,
    check_lora_io,
    check_segments,
    dot_in_fp32,
)


@triton.jit
def _sgmv_expand_kernel(
    y_ptr,  # [T, N_total]
    h_ptr,  # [T, R_max] fp32
    arena_ptr,  # [num_elems] flat
    seg_start_ptr,  # [num_segs]
    seg_len_ptr,  # [num_segs]
    seg_slot_ptr,  # [num_segs]
    t_rank_ptr,  # [S, J] (strided)
    t_hoff_ptr,  # [S, J] (strided)
    b_rows_ptr,  # [S, J, r_cap] (strided, last dim contiguous)
    cols_ptr,  # [J + 1]
    scales_ptr,  # [S] fp32
    stride_ym,
    stride_hm,
    stride_ts,
    stride_tj,
    stride_hs,
    stride_hj,
    stride_bs,
    stride_bj,
    num_n_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    j = tl.program_id(2) // num_n_blocks
    n0 = (tl.program_id(2) % num_n_blocks) * BLOCK_N
    slot = tl.load(seg_slot_ptr + seg)
    seg_len = tl.load(seg_len_ptr + seg)
    col0 = tl.load(cols_ptr + j)
    width = tl.load(cols_ptr + j + 1) - col0
    rank = tl.load(t_rank_ptr + slot * stride_ts + j * stride_tj)
    if (m0 >= seg_len) | (n0 >= width) | (rank == 0):
        return
    start = tl.load(seg_start_ptr + seg)
    hoff = tl.load(t_hoff_ptr + slot * stride_hs + j * stride_hj)
    m = m0 + tl.arange(0, BLOCK_M)
    n = n0 + tl.arange(0, BLOCK_N)
    m_ok = m < seg_len
    n_ok = n < width
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rank
        ht = tl.load(
            h_ptr + (start + m)[:, None] * stride_hm + (hoff + r)[None, :],
            mask=m_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        rows = tl.load(b_rows_ptr + slot * stride_bs + j * stride_bj + r, mask=r_ok, other=0)
        bt = tl.load(
            arena_ptr + rows[:, None] + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0
        )
        if DOT_F32:
            acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(ht.to(bt.dtype), bt)
    acc *= tl.load(scales_ptr + slot)
    y_ptrs = y_ptr + (start + m)[:, None] * stride_ym + (col0 + n)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def sgmv_expand(
    y: torch.Tensor,  # [T, N_total], updated in place
    h: torch.Tensor,  # [T, R_max] float32, from the shrink
    arena: torch.Tensor,  # the pool, same dtype as y
    seg_start: torch.Tensor,  # [num_segs] int32
    seg_len: torch.Tensor,  # [num_segs] int32
    seg_slot: torch.Tensor,  # [num_segs] int32
    t_rank: torch.Tensor,  # [S, J] int32
    t_hoff: torch.Tensor,  # [S, J] int32
    b_rows: torch.Tensor,  # [S, J, r_cap] int64
    cols: torch.Tensor,  # [J + 1] int32, non-decreasing, cols[J] <= N_total
    scales: torch.Tensor,  # [S] float32
    max_seg_len: int,
    max_width: int,  # >= every cols[j + 1] - cols[j]
    validate: bool = True,  # False: the caller checked this step's tables (TritonBackend)
) -> None:
    num_targets = cols.shape[0] - 1
    if validate:
        check_lora_io("y", y, h, arena)
        check_segments(seg_start, seg_len, seg_slot, y.device)
        check_expand_tables(t_rank, t_hoff, b_rows, cols, scales, y.device)
    num_segs = seg_start.shape[0]
    if num_segs == 0 or max_seg_len == 0 or max_width == 0:
        return
    block_m, block_r, block_n = 16, 16, 64
    n_blocks = triton.cdiv(max_width, block_n)
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), num_targets * n_blocks)
    _sgmv_expand_kernel[grid](
        y, h, arena, seg_start, seg_len, seg_slot, t_rank, t_hoff, b_rows, cols, scales,
        y.stride(0), h.stride(0), t_rank.stride(0), t_rank.stride(1), t_hoff.stride(0),
        t_hoff.stride(1), b_rows.stride(0), b_rows.stride(1), n_blocks,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, DOT_F32=dot_in_fp32(y),
    )  # fmt: skip
