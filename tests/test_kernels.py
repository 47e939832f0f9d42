"""The Triton kernels against the torch references: on CPU under TRITON_INTERPRET=1 (set by
conftest), natively on CUDA when present. Shapes are Llama-3-8B's divided by tp, scaled
down 16x for the interpreter; ranks 1-128 mixed in one batch, tokens without adapters,
segment edges at the kernels' block sizes, adapters in shuffled pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import (
    DECODE,
    TARGET_RANKS,
    group_shape,
    runs_of,
    scattered_adapters,
    segments_of,
    table_builder,
)

from loraplex.kernels import native
from loraplex.kernels.attention import attention_mask, paged_attention
from loraplex.kernels.backend import resolve_kernels
from loraplex.kernels.lora import lora_sgmv

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="CUDA present: runs natively")),
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device")),
]
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2)}

# (segment length, adapter index or None); 16 and 17 straddle BLOCK_M, adapter 0 twice
PREFILL = [(3, None), (17, 0), (1, 1), (16, 2), (2, None), (5, 3), (4, 0)]


@pytest.fixture(autouse=True)
def _interpreter_on_cpu():
    """Without a GPU the kernels can only run interpreted; never pass by not running."""
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "CPU runs need TRITON_INTERPRET=1"


def _lora_case(kind: str, tp: int, dtype: torch.dtype, decode: bool, device: str):
    from loraplex.kernels.triton_bgmv_expand import bgmv_expand
    from loraplex.kernels.triton_bgmv_shrink import bgmv_shrink
    from loraplex.kernels.triton_sgmv_expand import sgmv_expand
    from loraplex.kernels.triton_sgmv_shrink import sgmv_shrink

    fan_in, widths = group_shape(kind, tp)
    ranks = TARGET_RANKS[len(widths)]
    # fp32 arena holding values rounded to `dtype`: the reference sees what the kernel sees
    arena32, residents = scattered_adapters(fan_in, widths, ranks, torch.float32)
    arena32.copy_(arena32.to(dtype).float())
    runs, num_tokens = runs_of(DECODE if decode else PREFILL, residents)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, fan_in, generator=g).to(dtype)
    y0 = torch.randn(num_tokens, sum(widths), generator=g).to(dtype)
    scales = torch.rand(len(residents), generator=g) + 0.5

    delta = torch.zeros(num_tokens, sum(widths))
    lora_sgmv(delta, x.float(), segments_of(runs))
    slot_of = {}
    for _, _, r in runs:
        if r is not None:
            slot_of.setdefault(id(r), len(slot_of))
    token_scale = torch.zeros(num_tokens, 1)
    for s, e, r in runs:
        if r is not None:
            token_scale[s:e] = scales[slot_of[id(r)]]
    expected = y0.float() + token_scale * delta

    builder = table_builder(arena32, widths, max_rank=128, max_tokens=64, max_loras=8)
    meta = builder.build([(s, e, r) for s, e, r in runs if r is not None], num_tokens, decode)
    dev = torch.device(device)
    t = meta.tables
    arena = arena32.to(dtype).to(dev)
    ranks_, a_rows = t.ranks[:, 0, 0].to(dev), t.a_rows[:, 0, 0].to(dev)
    t_rank, t_hoff, b_rows = (t.t_rank[:, 0, 0].to(dev), t.t_hoff[:, 0, 0].to(dev),
                              t.b_rows[:, 0, 0].to(dev))  # fmt: skip
    cols, max_width = meta.cols[0].to(dev), max(widths)
    xd, y = x.to(dev), y0.to(dev).clone()
    h = torch.full((num_tokens, meta.max_r), float("nan"), device=dev)
    if decode:
        slots = meta.token_slot.to(dev)
        bgmv_shrink(h, xd, arena, slots, ranks_, a_rows, meta.max_r)
        bgmv_expand(y, h, arena, slots, t_rank, t_hoff, b_rows, cols, scales.to(dev), max_width)
    else:
        seg = [meta.seg_start.to(dev), meta.seg_len.to(dev), meta.seg_slot.to(dev)]
        sgmv_shrink(h, xd, arena, *seg, ranks_, a_rows, meta.max_seg_len, meta.max_r)
        sgmv_expand(
            y, h, arena, *seg, t_rank, t_hoff, b_rows, cols, scales.to(dev),
            meta.max_seg_len, max_width,
        )  # fmt: skip
    rtol, atol = TOL[dtype]
    y = y.cpu().float()
    base_rows = token_scale[:, 0] == 0
    assert torch.equal(y[base_rows], y0.float()[base_rows]), "tokens without adapter changed"
    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol * expected.abs().max().item())


CASES = [("qkv", 1), ("gate_up", 1), ("o", 1), ("down", 1)]
CASES += [(k, tp) for tp in (2, 4, 8) for k in ("qkv", "down")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode", [False, True], ids=["sgmv", "bgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("kind", "tp"), CASES, ids=[f"{k}-tp{tp}" for k, tp in CASES])
def test_lora_kernels_match_reference(kind, tp, dtype, decode, device):
    _lora_case(kind, tp, dtype, decode, device)


# (heads, kv_heads, head_dim) of Llama-3-8B / tp, and a scaled Mistral with a window
ATTENTION = [((32, 8, 128), 1, None), ((32, 8, 128), 8, None), ((8, 2, 64), 1, 9)]


# (q's dtype, the cache's): the cache in the model's dtype, or narrower (kv_cache_dtype)
QUERY_AND_CACHE = {
    "fp32": (torch.float32, torch.float32),
    "fp16": (torch.float16, torch.float16),
    "fp32-bf16kv": (torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", QUERY_AND_CACHE.values(), ids=QUERY_AND_CACHE.keys())
@pytest.mark.parametrize(("shape", "tp", "window"), ATTENTION)
def test_paged_attention_decode_matches_reference(shape, tp, window, dtypes, device):
    from loraplex.kernels.triton_paged_attention import paged_attention_decode

    dtype, kv_dtype = dtypes
    heads, kv_heads, head_dim = shape[0] // tp, shape[1] // tp, shape[2]
    g = torch.Generator().manual_seed(0)
    pages, bs, batch, max_blocks = 24, 6, 4, 5  # bs 6: not a power of two
    cache = torch.randn(pages, 2, bs, kv_heads, head_dim, generator=g).to(kv_dtype)
    k, v = cache[:, 0], cache[:, 1]  # strided views, like the pool's
    tables = torch.stack([torch.randperm(pages, generator=g)[:max_blocks] for _ in range(batch)])
    ctx = torch.tensor([1, 7, 18, 30], dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    mask = attention_mask(ctx.long() - 1, 1, ctx.long(), max_blocks * bs, window)
    expected = paged_attention(q[:, None].float(), k.float(), v.float(), tables, mask, 0.1)[:, 0]
    dev = torch.device(device)
    out = paged_attention_decode(
        q.to(dev), k.to(dev), v.to(dev), tables.to(dev), ctx.to(dev), 0.1, window
    )
    assert out.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_cpu_reference_attends_in_fp32_whatever_the_caches_dtype(dtype):
    """On a CPU, half-precision caches are attended in fp32: torch's CPU attention in bf16
    took 1.83 ms a layer on SmolLM2's decode shape against 0.33 ms cast to fp32 (half of a
    bf16 decode step), and rounded its own way: the result is the fp32 one, rounded once."""
    g = torch.Generator().manual_seed(0)
    pages, bs, batch, max_blocks, heads, kv_heads, head_dim = 24, 6, 4, 5, 9, 3, 64
    cache = torch.randn(pages, 2, bs, kv_heads, head_dim, generator=g).to(dtype)
    k, v = cache[:, 0], cache[:, 1]
    tables = torch.stack([torch.randperm(pages, generator=g)[:max_blocks] for _ in range(batch)])
    ctx = torch.tensor([1, 7, 18, 30])
    q = torch.randn(batch, 1, heads, head_dim, generator=g).to(dtype)
    mask = attention_mask(ctx - 1, 1, ctx, max_blocks * bs)
    out = paged_attention(q, k, v, tables, mask, 0.125)
    in_fp32 = paged_attention(q.float(), k.float(), v.float(), tables, mask, 0.125)
    assert out.dtype == dtype
    assert torch.equal(out, in_fp32.to(dtype))


# (heads, kv_heads) of SmolLM2-135M at tp 1 and 3, and Llama-3-8B's at tp 8; windows; groups
# of 8 (Llama-2-70B's) and 16, which the compiled loop leaves to the reference
CPU_DECODE = [
    ((9, 3), None),
    ((3, 1), None),
    ((4, 1), 9),
    ((8, 8), None),
    ((16, 2), 4),
    ((32, 2), None),
]
# fp32: the same sums in another order; bf16: both round one fp32 result (one ulp apart at most)
CPU_DECODE_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {}}
CPU_QUERY_AND_CACHE = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32-bf16kv": (torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("impl", ["torch", "native"])
@pytest.mark.parametrize("dtypes", CPU_QUERY_AND_CACHE.values(), ids=CPU_QUERY_AND_CACHE.keys())
@pytest.mark.parametrize(("heads", "window"), CPU_DECODE)
def test_cpu_decode_attention_matches_reference(heads, window, dtypes, impl, request):
    """The CPU decode paths — torch ops (rows of the pool gathered once a layer into one
    buffer, fp32 matmuls) and the compiled loop (kernels/attention_native.py, keys read in
    place) — against the reference's page gather and SDPA, on every layer of a pool laid
    out as KVCache's (pages with slack at the end, layers interleaved, shuffled pages, the
    pages after other memory of the pool, as adapters' may be): ragged contexts of 1 token,
    a full page, several pages and one key past a page. A cache narrower than the queries
    (kv_cache_dtype bfloat16 under a float32 model) is read widened, as the reference does,
    and the output comes back in the queries' dtype."""
    from loraplex.kernels import attention_native
    from loraplex.kernels.decode_attention import decode_attention, decode_rows

    dtype, kv_dtype = dtypes
    (num_heads, kv_heads), head_dim, bs, layers, pages = heads, 64, 6, 3, 24
    g = torch.Generator().manual_seed(0)
    page_elems = layers * 2 * bs * kv_heads * head_dim + 3 * head_dim  # slack, as a pool's
    arena = torch.randn(pages + 1, page_elems, generator=g).to(kv_dtype)
    kv_cache = arena[1:, : page_elems - 3 * head_dim].view(pages, layers, 2, bs, kv_heads, head_dim)
    pool_rows = arena.view(-1, head_dim)
    ctx = torch.tensor([1, 6, 19, 30, 7], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages, generator=g)[:5] for _ in range(len(ctx))])
    q = torch.randn(len(ctx), num_heads + kv_heads, head_dim, generator=g).to(dtype)
    q = q[:, :num_heads]  # a strided view, as the model passes it
    mask = attention_mask(ctx.long() - 1, 1, ctx.long(), tables.shape[1] * bs, window)
    step = decode_rows(kv_cache, pool_rows, tables, ctx, num_heads, window)
    for layer in range(layers):
        k, v = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
        expected = paged_attention(q[:, None], k, v, tables, mask, 0.125)[:, 0]
        if impl == "native":
            lib = request.getfixturevalue("cpu_loops")
            out = attention_native.decode_attention(lib, q, k, v, tables, ctx, 0.125, window)
        else:
            out = decode_attention(q, pool_rows, step, layer, 0.125)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, **CPU_DECODE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5])
def test_the_reference_reads_a_per_step_bias_as_it_reads_the_bool_mask(window, dtype):
    """Prefill chunks (the extend groups) attend with the mask converted once per step to
    SDPA's float bias: the output is the bool mask's, bit for bit."""
    from loraplex.kernels.attention import attention_bias

    g = torch.Generator().manual_seed(0)
    pages, bs, heads, kv_heads, head_dim, max_blocks = 24, 6, 9, 3, 64, 5
    cache = torch.randn(pages, 2, bs, kv_heads, head_dim, generator=g).to(dtype)
    k, v = cache[:, 0], cache[:, 1]
    q_start, q_lens = torch.tensor([0, 4, 20]), torch.tensor([7, 2, 10])
    tables = torch.stack([torch.randperm(pages, generator=g)[:max_blocks] for _ in q_lens])
    q = torch.randn(len(q_lens), int(q_lens.max()), heads, head_dim, generator=g).to(dtype)
    mask = attention_mask(q_start, q.shape[1], q_start + q_lens, max_blocks * bs, window)
    bias = attention_bias(mask)
    assert bias.dtype == torch.float32 and bool((bias == 0).eq(mask).all())
    out = paged_attention(q, k, v, tables, bias, 0.125)
    assert torch.equal(out, paged_attention(q, k, v, tables, mask, 0.125))


def test_launchers_reject_bad_inputs():
    from loraplex.kernels.triton_bgmv_shrink import bgmv_shrink
    from loraplex.kernels.triton_paged_attention import paged_attention_decode

    x = torch.randn(4, 32)
    arena = torch.zeros(2, 256)
    h = torch.zeros(4, 16)
    slots = torch.zeros(4, dtype=torch.int32)
    ranks = torch.ones(1, dtype=torch.int32)
    rows = torch.zeros(1, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match="arena dtype"):
        bgmv_shrink(h, x, arena.half(), slots, ranks, rows, 1)
    with pytest.raises(ValueError, match="h must be one of"):
        bgmv_shrink(h.half(), x, arena, slots, ranks, rows, 1)
    with pytest.raises(ValueError, match="token_slot has 3 tokens"):
        bgmv_shrink(h, x, arena, slots[:3], ranks, rows, 1)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        bgmv_shrink(h, torch.randn(32, 4).T, arena, slots, ranks, rows, 1)
    with pytest.raises(ValueError, match="token_slot must be one of"):
        bgmv_shrink(h, x, arena, slots.long(), ranks, rows, 1)
    k = torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match="not a multiple of 2 kv heads"):
        paged_attention_decode(
            torch.zeros(1, 3, 8), k, k, torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int32), 1.0,
        )  # fmt: skip


def test_backend_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    on_cpu = "native" if native.library() else "torch"  # tests/test_lora_native.py
    assert resolve_kernels("auto", cpu, {}) == on_cpu
    assert resolve_kernels("auto", cpu, {"LORAPLEX_KERNELS": "torch"}) == "torch"
    assert resolve_kernels("auto", cuda, {}) == "triton"
    assert resolve_kernels("auto", cuda, {"LORAPLEX_KERNELS": "torch"}) == "torch"
    assert resolve_kernels("auto", cpu, {"LORAPLEX_KERNELS": "triton"}) == "triton"
    assert resolve_kernels("torch", cuda, {"LORAPLEX_KERNELS": "triton"}) == "torch"
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_kernels("auto", cpu, {"LORAPLEX_KERNELS": "cuda"})


@pytest.mark.slow
def test_kernels_compile_for_cuda_without_a_gpu():
    """The interpreter does not compile; this lowers every kernel to sm_90 machine code."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_compile.py")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("bytes of sm_90 cubin") == 15


def test_the_triton_backend_checks_a_steps_tables_once_not_per_layer(monkeypatch):
    """Every layer reads views of the same stacked tables: checking them at each launch cost
    ~6 ms of a 38 ms decode step on an H100 (1.1B model, 16 layers). Checked once per step,
    the number of checks does not grow with the layers."""
    from kernel_cases import Resident, to_device

    from loraplex.kernels import triton_check
    from loraplex.kernels.backend import TritonBackend
    from loraplex.kernels.lora_tables import LoraLayout

    fan_in, widths = group_shape("qkv", 1)
    device = torch.device("cuda" if CUDA else "cpu")
    arena, residents = to_device(
        *scattered_adapters(fan_in, widths, TARGET_RANKS[3][:2], torch.float32), device
    )
    calls = []
    real = triton_check.check_tensor
    monkeypatch.setattr(
        triton_check, "check_tensor", lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    )
    ends = [sum(widths[: j + 1]) for j in range(len(widths))]
    cols = tuple(zip([0, *ends[:-1]], ends, strict=True))
    counts = {}
    for layers in (1, 3):
        deep = [Resident(r.groups * layers) for r in residents]
        backend = TritonBackend(LoraLayout(layers, (cols,), 128, 4, 16), arena)
        runs = [(0, 2, deep[0]), (2, 3, deep[1])]
        x, y = torch.randn(3, fan_in, device=device), torch.zeros(3, sum(widths), device=device)
        calls.clear()
        for per_layer in backend.prepare(runs, 3, True):
            backend.expand(y, backend.shrink(x, per_layer[0]), per_layer[0])
        counts[layers] = len(calls)
    assert counts[1] == counts[3] > 0, counts
