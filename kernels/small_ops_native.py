"""A decode step's small ops as compiled loops (small_ops_cpu.c), each against the torch
form the forward pass otherwise runs (replica/model/llama.py `ForwardOps`):

    rms_norm(x, w, eps, residual)   x += residual (in place) first; then llama.rms_norm
    silu_mul(gate_up)               F.silu(gate) * up, gate and up the row's two halves
    rotate_(x, cos, signed_sin)     rope.rotate, in place
    write_kv(rows, k, v, ...)       attention.write_kv
    argmax_rows(logits)             logits.argmax(-1).tolist() (greedy sampling)

Each returns None (write_kv False) where its input is not what the loop takes — anything but
float32 rows with their last dimension contiguous — having touched nothing; the caller
then runs its torch form (ForwardOps, sampling.greedy_tokens), the one copy of it.

On SmolLM2's decode step (batch 32) torch takes 60-90 us a call for each of the first
three where the data is a few tens of kilobytes: two to six ops, each dispatched and
each writing a tensor the weights have just pushed out of the cache. A loop is one pass.
Results agree with the torch forms to float32 rounding (sums in another order, an
expf polynomial within 2 ulp), not bit for bit.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from loraplex.kernels.attention import write_kv as torch_write_kv


def rows_ok(t: torch.Tensor) -> bool:
    """Rows the loops take: float32, 2-D, the last dimension contiguous."""
    return t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1


def rope_tables_ok(cos: torch.Tensor, signed_sin: torch.Tensor, rows: int, dim: int) -> bool:
    """RoPE's tables as the loop reads them: float32 [rows, 1, dim], dim contiguous, both
    with one row stride."""
    return all(
        tab.dtype == torch.float32 and tab.shape == (rows, 1, dim) and tab.stride(2) == 1
        and tab.stride(0) == cos.stride(0)
        for tab in (cos, signed_sin)
    )  # fmt: skip


def cache_rows_ok(cache_rows: torch.Tensor) -> bool:
    """The pool as rows the KV write takes: float32 or bfloat16, contiguous."""
    return cache_rows.dtype in (torch.float32, torch.bfloat16) and cache_rows.is_contiguous()


def rotated(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """rope.rotate's torch form (new rows), the loops' checks' reference."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [T, C] float32; with a residual, x += residual in place first
    weight: torch.Tensor,  # [C]
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [T, C] float32, contiguous: written (else new rows)
) -> torch.Tensor | None:
    """x / sqrt(mean(x^2) + eps) * weight."""
    ok = rows_ok(x) and weight.dtype == torch.float32 and weight.is_contiguous()
    if not ok or (residual is not None and not rows_ok(residual)):
        return None
    y = torch.empty(x.shape, dtype=torch.float32) if out is None else out
    lib.rms_norm(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(), x.shape[0], x.shape[1], eps,
    )  # fmt: skip
    return y


def silu_mul(
    lib: ctypes.CDLL, gate_up: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """[T, 2I] -> [T, I]: silu(gate) * up (into `out`, [T, I] float32 contiguous, if given)."""
    if not rows_ok(gate_up):
        return None
    rows, width = gate_up.shape
    if out is None:
        out = torch.empty(rows, width // 2, dtype=torch.float32)
    lib.silu_mul(
        out.data_ptr(), out.stride(0), gate_up.data_ptr(), gate_up.stride(0), rows, width // 2
    )
    return out


def rotate_(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [T, heads, D], D contiguous: rotated in place
    cos: torch.Tensor,  # [T, 1, D]
    signed_sin: torch.Tensor,  # [T, 1, D], the first half negated
) -> torch.Tensor | None:
    """x, rotated in place (rope.rotate's result)."""
    t, heads, dim = x.shape
    tables = rope_tables_ok(cos, signed_sin, t, dim)
    if x.dtype != torch.float32 or x.stride(2) != 1 or dim % 2 or not tables:
        return None
    lib.rope(
        x.data_ptr(), x.stride(0), x.stride(1), t, heads, dim,
        cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0),
    )  # fmt: skip
    return x


def write_kv(
    lib: ctypes.CDLL,
    cache_rows: torch.Tensor,  # [num_rows, kv_heads * head_dim], float32 or bfloat16
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    k_rows: torch.Tensor,  # [T] int64
    v_rows: torch.Tensor,
) -> bool:
    """attention.write_kv: cache_rows[k_rows[t]] = k[t], the same for v; False (nothing
    written) where the loop does not take these tensors."""
    width = cache_rows.shape[1]
    flat = all(
        t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)
    )
    rows_ok = all(r.dtype == torch.int64 and r.is_contiguous() for r in (k_rows, v_rows))
    if not (flat and rows_ok and cache_rows_ok(cache_rows)) or k.shape[1] * k.shape[2] != width:
        return False
    lib.write_kv(
        cache_rows.data_ptr(), width, int(cache_rows.dtype == torch.bfloat16),
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        k_rows.data_ptr(), v_rows.data_ptr(), k.shape[0],
    )  # fmt: skip
    return True


def argmax_rows(lib: ctypes.CDLL, logits: torch.Tensor) -> list[int] | None:
    """[n, V] -> each row's argmax (the first of equal maxima; of NaNs, the first NaN).
    torch's argmax took 1.3 ms over SmolLM2's 32 x 49,152 logits in cache, 2.1 out of it."""
    if not rows_ok(logits):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows(out.data_ptr(), logits.data_ptr(), logits.stride(0), *logits.shape)
    return out.tolist()


def declare(lib: ctypes.CDLL) -> None:
    """The loops' argument types."""
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.rms_norm.argtypes = [p, i, p, i, p, i, p, i, i, f]
    lib.silu_mul.argtypes = [p, i, p, i, i, i]
    lib.rope.argtypes = [p, i, i, i, i, i, p, p, i]
    lib.write_kv.argtypes = [p, i, i, p, i, p, i, p, p, i]
    lib.argmax_rows.argtypes = [p, p, i, i, i]
    for fn in (lib.rms_norm, lib.silu_mul, lib.rope, lib.write_kv, lib.argmax_rows):
        fn.restype = None


TOL = {"rtol": 1e-5, "atol": 1e-5}


def check(lib: ctypes.CDLL) -> None:
    """Each loop against its torch form on a few rows (strided where the step's are)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=gen) * 3
    res, w = torch.randn(5, 48, generator=gen), torch.randn(48, generator=gen)
    want_h = x + res
    got = rms_norm(lib, x, w, 1e-5, res)
    ok = got is not None and torch.equal(x, want_h)
    ok &= got is not None and torch.allclose(got, F.rms_norm(want_h, w.shape, w, 1e-5), **TOL)
    gate_up = torch.randn(5, 2 * 24, generator=gen) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    act = silu_mul(lib, gate_up)
    ok &= act is not None and torch.allclose(act, F.silu(gate) * up, **TOL)
    qkv = torch.randn(5, 7, 16, generator=gen)  # rotate the first 6 heads of 7
    cos, sin = torch.randn(5, 1, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
    want_r = rotated(qkv[:, :6], cos, sin)
    ok &= rotate_(lib, qkv[:, :6], cos, sin) is not None
    ok &= torch.allclose(qkv[:, :6], want_r, **TOL)
    for dtype in (torch.float32, torch.bfloat16):
        cache, want_c = torch.zeros(12, 32, dtype=dtype), torch.zeros(12, 32, dtype=dtype)
        k, v = qkv[:, :2].contiguous(), qkv[:, 2:4].contiguous()
        k_rows, v_rows = torch.tensor([0, 3, 4, 9, 11]), torch.tensor([1, 2, 5, 7, 10])
        ok &= write_kv(lib, cache, k, v, k_rows, v_rows)
        torch_write_kv(want_c, k, v, k_rows, v_rows)
        ok &= torch.equal(cache, want_c)
    logits = torch.randn(4, 37, generator=gen)
    logits[1, 5] = logits[1, 30] = 9.0  # a tie: the first
    logits[2, 7] = float("nan")
    logits[3] = float("-inf")
    ok &= argmax_rows(lib, logits) == logits.argmax(dim=-1).tolist()
    if not ok:
        raise RuntimeError("the compiled small ops disagree with their torch forms")
