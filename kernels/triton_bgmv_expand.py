"""LoRA expand, decode form (Punica BGMV), in Triton; every target of a group in one
launch, with a fused per-adapter scale.

Contract (Bt rows read in place from the pool through the row table):

    for t in range(T):
        w = token_slot[t]
        if w < 0: continue                           # a base-model token: skipped at once
        for j in range(J):
            for n in range(cols[j + 1] - cols[j]):
                y[t, cols[j] + n] += scales[w] * sum_{r < t_rank[w, j]}
                    h[t, t_hoff[w, j] + r] * arena[b_rows[w, j, r] + n]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton_check import check_expand_tables, check_lora_io, check_token_slot


@triton.jit
def _bgmv_expand_kernel(
    y_ptr,  # [T, N_total]
    h_ptr,  # [T, R_max] fp32
    arena_ptr,  # [num_elems] flat
    token_slot_ptr,  # [T]
    t_rank_ptr,  # [S, J] (strided)
    t_hoff_ptr,  # [S, J] (strided)
    b_rows_ptr,  # [S, J, r_cap] (strided)
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
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    j = tl.program_id(1) // num_n_blocks
    n0 = (tl.program_id(1) % num_n_blocks) * BLOCK_N
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    col0 = tl.load(cols_ptr + j)
    width = tl.load(cols_ptr + j + 1) - col0
    rank = tl.load(t_rank_ptr + slot * stride_ts + j * stride_tj)
    if (n0 >= width) | (rank == 0):
        return
    hoff = tl.load(t_hoff_ptr + slot * stride_hs + j * stride_hj)
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < width
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rank
        hv = tl.load(h_ptr + t * stride_hm + hoff + r, mask=r_ok, other=0.0)
        rows = tl.load(b_rows_ptr + slot * stride_bs + j * stride_bj + r, mask=r_ok, other=0)
        bt = tl.load(
            arena_ptr + rows[:, None] + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0
        )
        acc += tl.sum(bt.to(tl.float32) * hv[:, None], axis=0)
    acc *= tl.load(scales_ptr + slot)
    y_ptrs = y_ptr + t * stride_ym + col0 + n
    y = tl.load(y_ptrs, mask=n_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=n_ok)


def bgmv_expand(
    y: torch.Tensor,  # [T, N_total], updated in place
    h: torch.Tensor,  # [T, R_max] float32, from the shrink
    arena: torch.Tensor,  # the pool, same dtype as y
    token_slot: torch.Tensor,  # [T] int32, -1: no adapter
    t_rank: torch.Tensor,  # [S, J] int32
    t_hoff: torch.Tensor,  # [S, J] int32
    b_rows: torch.Tensor,  # [S, J, r_cap] int64
    cols: torch.Tensor,  # [J + 1] int32
    scales: torch.Tensor,  # [S] float32
    max_width: int,  # >= every cols[j + 1] - cols[j]
    validate: bool = True,  # False: the caller checked this step's tables (TritonBackend)
) -> None:
    num_targets = cols.shape[0] - 1
    if validate:
        check_lora_io("y", y, h, arena)
        check_token_slot(token_slot, y.shape[0], y.device)
        check_expand_tables(t_rank, t_hoff, b_rows, cols, scales, y.device)
    if y.shape[0] == 0 or max_width == 0:
        return
    block_r, block_n = 16, 64
    n_blocks = triton.cdiv(max_width, block_n)
    grid = (y.shape[0], num_targets * n_blocks)
    _bgmv_expand_kernel[grid](
        y, h, arena, token_slot, t_rank, t_hoff, b_rows, cols, scales,
        y.stride(0), h.stride(0), t_rank.stride(0), t_rank.stride(1), t_hoff.stride(0),
        t_hoff.stride(1), b_rows.stride(0), b_rows.stride(1), n_blocks,
        BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
