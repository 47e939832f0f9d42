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

In a decode step the forward pass calls `DecodeLayers` instead: from a layer's fused qkv
rows, the rotary embedding, the KV write and the attention in one call (`decode_layer`),
where they were three Python wrappers and ctypes calls, each paying for code and data the
GEMM before it had pushed out of the cache.
"""

from __future__ import annotations

import ctypes

import torch

from loraplex.kernels import small_ops_native as small_ops
from loraplex.kernels.attention import attention_mask, paged_attention, write_kv

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
        args = self._bind((q.stride(0), q.stride(1)), k_cache, block_tables, ctx_lens, heads)
        args.scale, args.window = scale, sliding_window or NO_WINDOW
        args.out, args.q = out.data_ptr(), q.data_ptr()
        args.k, args.v = k_cache.data_ptr(), v_cache.data_ptr()
        if self.lib.decode_attention(ctypes.byref(args)) != 0:
            raise RuntimeError(f"decode_attention refused {heads}/{kv_heads} heads of {head_dim}")
        return out if dtype == torch.float32 else out.to(dtype)

    def _bind(
        self,
        q_strides: tuple[int, int],
        k_cache: torch.Tensor,  # [num_pages, block_size, KVH, D]
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        heads: int,
    ) -> Args:
        """The loop's arguments for a step's tables and this shape: kept from the step's
        first call (scale and window are set by the caller, the pointers per layer)."""
        step = self._step
        if step is None or step[0] is not block_tables or step[1] is not ctx_lens:
            tables = block_tables.to(torch.int64)
            tables = tables if tables.stride(1) == 1 else tables.contiguous()
            step = (block_tables, ctx_lens, tables, ctx_lens.to(torch.int32).contiguous())
            self._step, self._key = step, ()
        _, block_size, kv_heads, head_dim = k_cache.shape
        key = (q_strides, k_cache.stride(), k_cache.dtype, heads, kv_heads, head_dim, block_size)
        args = self._args
        if args is None or key != self._key:
            tables, lens = step[2], step[3]
            args = Args(
                0, 0, *q_strides, 0, 0, *k_cache.stride()[:3],
                int(k_cache.dtype == torch.bfloat16), tables.data_ptr(), tables.stride(0),
                lens.data_ptr(), tables.shape[0], heads, kv_heads, head_dim, block_size,
            )  # fmt: skip
            self._args, self._key = args, key
        return args

    def layers(
        self,
        kv_cache: torch.Tensor,  # [num_pages, num_layers, 2, block_size, KVH, D]
        block_tables: torch.Tensor,  # [B, max_blocks]: a decode step's, its rows all the step's
        ctx_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        tables: tuple[torch.Tensor, torch.Tensor],  # RoPE's cos and signed sin, [B, 1, D]
        cache_rows: torch.Tensor,  # the pool as [rows, KVH * D]
        kv_rows: torch.Tensor,  # [num_layers, 2, B] int64: where each layer's k and v go
        heads: int,
    ) -> DecodeLayers | None:
        """The step's layers' attention with the rotary embedding and the KV write before
        it, one call a layer (`DecodeLayers`); None where the loops do not take these
        tensors (the caller then runs the three apart)."""
        b = block_tables.shape[0]
        _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
        cos, signed_sin = tables
        ok = (
            b > 0
            and takes(heads, kv_heads, head_dim, kv_cache.dtype)
            and kv_cache.stride(5) == 1
            and cache_rows.dtype == kv_cache.dtype
            and small_ops.cache_rows_ok(cache_rows)
            and cache_rows.shape[1] == kv_heads * head_dim
            and kv_rows.dtype == torch.int64
            and kv_rows.is_contiguous()
            and kv_rows.shape[1:] == (2, b)
            and small_ops.rope_tables_ok(cos, signed_sin, b, head_dim)
        )
        if not ok:
            return None
        qkv_stride = (heads + 2 * kv_heads) * head_dim
        k_cache = kv_cache[:, 0, 0]
        args = self._bind((qkv_stride, head_dim), k_cache, block_tables, ctx_lens, heads)
        args.scale, args.window = scale, sliding_window or NO_WINDOW
        layer = Layer(
            args, cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0), cache_rows.data_ptr(),
        )  # fmt: skip
        held = (cos, signed_sin, cache_rows, self._step)
        return DecodeLayers(self.lib, layer, kv_cache, kv_rows, held, qkv_stride, heads * head_dim)


class Layer(ctypes.Structure):
    """attention_cpu.c's layer_t."""

    _fields_ = [  # noqa: RUF012 (ctypes reads the class attribute)
        ("att", Args),
        ("cos", ctypes.c_void_p),
        ("ssin", ctypes.c_void_p),
        ("tab_stride", ctypes.c_int64),
        ("cache_rows", ctypes.c_void_p),
        ("k_rows", ctypes.c_void_p),
        ("v_rows", ctypes.c_void_p),
    ]


class DecodeLayers:
    """A decode step's attention from each layer's fused qkv rows (`decode_layer` in
    attention_cpu.c): q and k rotated in place, k and v written to the pool, then the
    attention loop reading q where it lies. One call a layer, where the forward pass made
    three: each a Python wrapper and a ctypes call whose code and data the GEMM before it
    had pushed out of the cache (the first torch op after one of SmolLM2's GEMMs took
    ~16 us where it takes ~1). Built by `DecodeAttention.layers`."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        layer: Layer,
        kv_cache: torch.Tensor,  # [num_pages, num_layers, 2, block_size, KVH, D]
        kv_rows: torch.Tensor,  # [num_layers, 2, B] int64
        held: tuple,  # the other tensors `layer` points to
        qkv_width: int,
        out_width: int,
    ):
        self.lib, self.layer, self.qkv_width = lib, layer, qkv_width
        self.held = (kv_cache, kv_rows, *held)  # alive while the loop reads them
        size = kv_cache.element_size()
        self.k0, self.layer_bytes = kv_cache.data_ptr(), kv_cache.stride(1) * size
        self.v_bytes = kv_cache.stride(2) * size
        self.rows0, self.rows_layer = kv_rows.data_ptr(), kv_rows.stride(0) * 8
        self.rows_v = kv_rows.stride(1) * 8
        # one output for every layer: the o projection reads it before the next layer
        self.out = torch.empty(layer.att.B, out_width, dtype=torch.float32)
        layer.att.out = self.out.data_ptr()

    def __call__(self, qkv: torch.Tensor, i: int) -> torch.Tensor | None:
        """qkv [B, (H + 2 KVH) D], layer i -> the attention's output [B, H D] (the same
        tensor for every layer, overwritten by the next); None (nothing touched) for rows
        the loop does not take."""
        layer, att = self.layer, self.layer.att
        if qkv.dtype != torch.float32 or qkv.stride() != (self.qkv_width, 1) or len(qkv) != att.B:
            return None
        att.q = qkv.data_ptr()
        att.k = self.k0 + i * self.layer_bytes
        att.v = att.k + self.v_bytes
        layer.k_rows = self.rows0 + i * self.rows_layer
        layer.v_rows = layer.k_rows + self.rows_v
        if self.lib.decode_layer(ctypes.byref(layer)) != 0:
            raise RuntimeError(f"decode_layer refused {att.H}/{att.KVH} heads of {att.D}")
        return self.out


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
    lib.decode_layer.argtypes = [ctypes.POINTER(Layer)]
    for fn in (lib.decode_attention, lib.decode_layer):
        fn.restype = ctypes.c_int


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
    _check_layers(lib, gen)


def _check_layers(lib: ctypes.CDLL, gen: torch.Generator) -> None:
    """The layer call against RoPE, the KV write and attention apart (the torch forms)."""
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 4
    pool = torch.randn(6, 1, 2, block_size, kv_heads, head_dim, generator=gen)
    tables, ctx = torch.tensor([[4, 1], [0, 5]]), torch.tensor([6, 3], dtype=torch.int32)
    slot = (ctx.long() - 1) % block_size
    page = tables[torch.arange(2), (ctx.long() - 1) // block_size]
    kv_rows = torch.stack([(page * 2 + kv) * block_size + slot for kv in (0, 1)])[None]
    rope = torch.randn(2, 1, head_dim, generator=gen), torch.randn(2, 1, head_dim, generator=gen)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * head_dim, generator=gen)
    want_pool, split = pool.clone(), (heads + kv_heads) * head_dim
    qk = small_ops.rotated(qkv[:, :split].view(2, -1, head_dim), *rope)
    q, k = qk.split((heads, kv_heads), dim=1)
    v = qkv[:, split:].view(2, kv_heads, head_dim)
    write_kv(want_pool.view(-1, kv_heads * head_dim), k, v, kv_rows[0, 0], kv_rows[0, 1])
    want = _reference(q, want_pool[:, 0, 0], want_pool[:, 0, 1], tables, ctx, 0.2, None)
    rows = pool.view(-1, kv_heads * head_dim)
    step = DecodeAttention(lib).layers(pool, tables, ctx, 0.2, None, rope, rows, kv_rows, heads)
    got = None if step is None else step(qkv, 0)
    ok = got is not None and torch.allclose(got, want.reshape(2, -1), rtol=1e-4, atol=1e-5)
    if not (ok and torch.allclose(pool, want_pool, rtol=1e-5, atol=1e-5)):
        raise RuntimeError("the compiled decode layer disagrees with its ops apart")
