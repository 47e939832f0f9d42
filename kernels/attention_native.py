"""Decode attention on a CPU as one compiled loop a layer (attention_cpu.c): every key and
value read where the paged pool keeps it, no gathered copy, no op dispatched per step part.
The contract is the Triton kernel's (triton_paged_attention.paged_attention_decode); the
backend `native` offers it as its `decode_attention`.

The torch path (decode_attention.py) gathers each layer's keys and values into a buffer,
then runs a scaled product, a softmax and a product with V over it: ~7 ops a layer, and
the gather writes what the products read again. Measured on SmolLM2's shape (batch 32,
9 query and 3 kv heads of 64, 60-100 keys, 30 layers, 2 cores, 2026-12-07): the loop took
9.1 ms a step on keys in cache and 14.1 with the cache flushed between layers, where the
torch path took ~21. In the loop each sequence and kv head is a work item; keys go in tiles
whose rows are all prefetched first (one row after another, its loads waited on memory:
17.6 ms), dot products four keys at a time, the product with V four vectors at a time.

Shapes it does not take (head_dim not a multiple of 32 or over 256, more than 8 query
heads a kv head, a float16 cache) go to the torch reference.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels.attention import attention_mask, paged_attention

NO_WINDOW = 1 << 30
MAX_GROUP = 8
MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 32
CACHE_DTYPES = (torch.float32, torch.bfloat16)


class Args(ctypes.Structure):
    """attention_cpu.c's args_t."""

    _fields_ = [  # noqa: RUF012 (ctypes reads the class attribute)
        ("out", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("q_sb", ctypes.c_int64),
        ("q_sh", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("c_sp", ctypes.c_int64),
        ("c_st", ctypes.c_int64),
        ("c_sh", ctypes.c_int64),
        ("bf16", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("bt_stride", ctypes.c_int64),
        ("ctx_lens", ctypes.c_void_p),
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("KVH", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("window", ctypes.c_int64),
    ]


def takes(heads: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the loop takes this shape (else `decode_attention` runs the reference)."""
    return (
        heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and head_dim % HEAD_DIM_STEP == 0
        and head_dim <= MAX_HEAD_DIM
        and cache_dtype in CACHE_DTYPES
    )


class DecodeAttention:
    """`decode_attention` bound to the library: the backend's decode kernel (the Triton
    contract's arguments). A step calls it once a layer with the same tables; what comes
    from them (converted tables, the loop's arguments) is kept from the step's first call
    (held, so that `is` finds the same tensors), and each later layer sets only q, the
    output and the layer's keys and values: ~30 us of a ~150 us call on SmolLM2's shape
    was building them."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._args: Args | None = None
        self._key: tuple = ()

    def __call__(
        self,
        q: torch.Tensor,  # [B, H, D], head_dim contiguous
        k_cache: torch.Tensor,  # [num_pages, block_size, KVH, D], head_dim contiguous
        v_cache: torch.Tensor,  # the same strides as k_cache
        block_tables: torch.Tensor,  # [B, max_blocks] int64 (int32 converted)
        ctx_lens: torch.Tensor,  # [B] int32, each >= 1
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [B, H, D] in q's dtype
        b, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        if not takes(heads, kv_heads, head_dim, k_cache.dtype) or (
            k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1
        ):
            return _reference(q, k_cache, v_cache, block_tables, ctx_lens, scale, sliding_window)
        dtype = q.dtype
        if q.dtype != torch.float32 or q.stride(2) != 1:
            q = q.float().contiguous()
        out = torch.empty(b, heads, head_dim, dtype=torch.float32)
        if b == 0:
            return out.to(dtype)
        step = self._step
        if step is None or step[0] is not block_tables or step[1] is not ctx_lens:
            tables = block_tables.to(torch.int64)
            tables = tables if tables.stride(1) == 1 else tables.contiguous()
            step = (block_tables, ctx_lens, tables, ctx_lens.to(torch.int32).contiguous())
            self._step, self._key = step, ()
        key = (
            q.stride(0), q.stride(1), k_cache.stride(), k_cache.dtype, heads, kv_heads,
            head_dim, block_size, scale, sliding_window,
        )  # fmt: skip
        args = self._args
        if args is None or key != self._key:
            tables, lens = step[2], step[3]
            args = Args(
                0, 0, q.stride(0), q.stride(1), 0, 0, *k_cache.stride()[:3],
                int(k_cache.dtype == torch.bfloat16), tables.data_ptr(), tables.stride(0),
                lens.data_ptr(), b, heads, kv_heads, head_dim, block_size, scale,
                sliding_window or NO_WINDOW,
            )  # fmt: skip
            self._args, self._key = args, key
        args.out, args.q = out.data_ptr(), q.data_ptr()
        args.k, args.v = k_cache.data_ptr(), v_cache.data_ptr()
        if self.lib.decode_attention(ctypes.byref(args)) != 0:
            raise RuntimeError(f"decode_attention refused {heads}/{kv_heads} heads of {head_dim}")
        return out if dtype == torch.float32 else out.to(dtype)


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One call of the loop (`DecodeAttention` keeps a step's tables between layers)."""
    return DecodeAttention(lib)(q, k_cache, v_cache, block_tables, ctx_lens, scale, sliding_window)


def _reference(q, k_cache, v_cache, block_tables, ctx_lens, scale, sliding_window):
    ctx = ctx_lens.to(torch.int64)
    width = block_tables.shape[1] * k_cache.shape[1]
    mask = attention_mask(ctx - 1, 1, ctx, width, sliding_window)
    out = paged_attention(q[:, None], k_cache, v_cache, block_tables.long(), mask, scale)
    return out[:, 0]


def declare(lib: ctypes.CDLL) -> None:
    """The loop's argument types."""
    lib.decode_attention.argtypes = [ctypes.POINTER(Args)]
    lib.decode_attention.restype = ctypes.c_int


def check(lib: ctypes.CDLL) -> None:
    """The loop against the torch reference on a small pool: pages out of order, a row
    longer than a tile, a sliding window, a bfloat16 cache."""
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, head_dim = 4, 2, 32
    pool = torch.randn(24, 2, block_size, kv_heads, head_dim, generator=gen)
    block_tables = torch.randperm(24, generator=gen)[:20].view(2, 10)
    ctx_lens = torch.tensor([37, 5], dtype=torch.int32)
    q = torch.randn(2, 6, head_dim, generator=gen)
    for dtype, window in ((torch.float32, None), (torch.float32, 9), (torch.bfloat16, None)):
        k, v = pool.to(dtype).unbind(1)
        got = decode_attention(lib, q, k, v, block_tables, ctx_lens, 0.2, window)
        want = _reference(q, k.float(), v.float(), block_tables, ctx_lens, 0.2, window)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise RuntimeError("the compiled decode attention disagrees with the reference")
