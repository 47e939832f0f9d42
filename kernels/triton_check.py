"""Input checks shared by the Triton launchers: a wrong argument is a clear error, not a
silent out-of-bounds read."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dims: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    contiguous: bool = False,
    inner_contiguous: bool = False,
) -> None:
    check(t.dim() == dims, f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    check(t.dtype in dtypes, f"{name} must be one of {dtypes}, got {t.dtype}")
    check(t.device == device, f"{name} is on {t.device}, expected {device}")
    check(not contiguous or t.is_contiguous(), f"{name} must be contiguous")
    check(not inner_contiguous or t.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def dot_in_fp32(x: torch.Tensor) -> bool:
    """Upcast tiles before tl.dot: for fp32 (exact IEEE products, no TF32) and on the CPU
    interpreter, which computes bf16 tl.dot wrongly without an error."""
    return x.dtype == torch.float32 or x.device.type == "cpu"


INDEX = (torch.int32,)


def check_lora_io(name: str, t: torch.Tensor, h: torch.Tensor, arena: torch.Tensor) -> None:
    """t: the model-dtype operand (x read by a shrink, y updated by an expand); h: the fp32
    [T, R] intermediate; arena: the pool, in t's dtype."""
    dev = t.device
    check_tensor(name, t, dims=2, dtypes=FLOAT_DTYPES, device=dev, inner_contiguous=True)
    check_tensor("h", h, dims=2, dtypes=(torch.float32,), device=dev, inner_contiguous=True)
    check(h.shape[0] == t.shape[0], f"h has {h.shape[0]} rows, {name} {t.shape[0]}")
    check(arena.dtype == t.dtype, f"arena dtype {arena.dtype} != {name} dtype {t.dtype}")
    check(
        arena.is_contiguous() and arena.device == dev,
        f"arena must be contiguous, on {name}'s device",
    )


def check_segments(seg_start, seg_len, seg_slot, device: torch.device) -> None:
    for name, t in (("seg_start", seg_start), ("seg_len", seg_len), ("seg_slot", seg_slot)):
        check_tensor(name, t, dims=1, dtypes=INDEX, device=device, contiguous=True)
        check(t.shape[0] == seg_start.shape[0], f"{name} has {t.shape[0]} segments")


def check_token_slot(token_slot: torch.Tensor, num_tokens: int, device: torch.device) -> None:
    check_tensor("token_slot", token_slot, dims=1, dtypes=INDEX, device=device, contiguous=True)
    check(token_slot.shape[0] == num_tokens, f"token_slot has {token_slot.shape[0]} tokens")


def check_shrink_tables(ranks, a_rows, max_rank: int, h: torch.Tensor) -> None:
    dev = h.device
    check(h.shape[1] >= max_rank, f"h has {h.shape[1]} columns < max_rank {max_rank}")
    check_tensor("ranks", ranks, dims=1, dtypes=INDEX, device=dev)
    check_tensor("a_rows", a_rows, dims=2, dtypes=(torch.int64,), device=dev, inner_contiguous=True)
    check(a_rows.shape[1] >= max_rank, f"a_rows holds {a_rows.shape[1]} rows < {max_rank}")


def check_expand_tables(t_rank, t_hoff, b_rows, cols, scales, device: torch.device) -> int:
    """Checks the expand's tables; returns the number of targets J."""
    check_tensor("t_rank", t_rank, dims=2, dtypes=INDEX, device=device)
    check_tensor("t_hoff", t_hoff, dims=2, dtypes=INDEX, device=device)
    check_tensor(
        "b_rows", b_rows, dims=3, dtypes=(torch.int64,), device=device, inner_contiguous=True
    )
    check_tensor("cols", cols, dims=1, dtypes=INDEX, device=device, contiguous=True)
    check_tensor("scales", scales, dims=1, dtypes=(torch.float32,), device=device, contiguous=True)
    num_targets = cols.shape[0] - 1
    check(
        t_rank.shape[1] == num_targets, f"t_rank has {t_rank.shape[1]} targets, cols {num_targets}"
    )
    return num_targets
