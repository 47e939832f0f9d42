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
