"""The decode step's small ops in compiled loops (kernels/small_ops_native.py) against the
torch forms the forward pass runs without them, the compiled decode attention's shapes
left to the reference and its layer call (RoPE, KV write and attention in one) against
the three apart (kernels/attention_native.py); the attention itself is
checked beside the torch path in test_kernels.py, the whole step in test_lora_native.py
(the engine with `kernels: native` against `torch`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import attention_native
from loraplex.kernels import small_ops_native as small_ops
from loraplex.kernels.attention import attention_mask, paged_attention, write_kv
from loraplex.replica.model.llama import KEPT_OUTPUT_ELEMENTS, ForwardOps
from loraplex.replica.model.rope import rotate
from loraplex.replica.sampling import greedy_tokens

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_adds_the_residual_in_place_then_normalises(cpu_loops, residual):
    g = _gen()
    wide = torch.randn(6, 80, generator=g) * 4
    h = wide[:, :64]  # rows with a stride, as a view's
    tail = wide[:, 64:].clone()
    delta = torch.randn(6, 64, generator=g) if residual else None
    weight = torch.randn(64, generator=g)
    want_h = h + delta if delta is not None else h.clone()
    got = small_ops.rms_norm(cpu_loops, h, weight, 1e-6, delta)
    assert torch.equal(h, want_h)  # the residual add is exact, and written into h
    torch.testing.assert_close(got, F.rms_norm(want_h, (64,), weight, 1e-6), **TOL)
    assert torch.equal(wide[:, 64:], tail)  # nothing past the view written


def test_silu_mul_over_gate_and_up_halves(cpu_loops):
    gate_up = torch.randn(5, 2 * 40, generator=_gen()) * 8  # reaches exp's clamped range
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(small_ops.silu_mul(cpu_loops, gate_up), F.silu(gate) * up, **TOL)


def test_rotate_in_place_matches_the_torch_rotation(cpu_loops):
    g = _gen()
    qkv = torch.randn(4, 11 * 16, generator=g)
    qk = qkv[:, : 9 * 16].view(4, 9, 16)  # q's and k's heads of a fused qkv row, v after
    v_before = qkv[:, 9 * 16 :].clone()
    cos, signed_sin = torch.randn(4, 1, 16, generator=g), torch.randn(4, 1, 16, generator=g)
    want = rotate(qk, cos, signed_sin)
    got = small_ops.rotate_(cpu_loops, qk, cos, signed_sin)
    assert got.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(qkv[:, 9 * 16 :], v_before)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_the_rows_torch_writes(cpu_loops, cache_dtype):
    g = _gen()
    qkv = torch.randn(5, 7, 8, generator=g)
    k, v = qkv[:, 3:5], qkv[:, 5:7]  # views of the fused output, as the model's
    k_rows, v_rows = torch.tensor([0, 4, 6, 13, 2]), torch.tensor([1, 5, 7, 12, 3])
    got = torch.zeros(14, 16, dtype=cache_dtype)
    want = torch.zeros(14, 16, dtype=cache_dtype)
    small_ops.write_kv(cpu_loops, got, k, v, k_rows, v_rows)
    write_kv(want, k, v, k_rows, v_rows)
    assert torch.equal(got, want)  # bfloat16: rounded to nearest even, as torch converts


def test_other_dtypes_take_the_torch_forms(cpu_loops):
    """The loops refuse what they do not take, touching nothing; ForwardOps then runs its
    torch forms (the one copy of each), the same results as without the loops."""
    g = _gen()
    x = torch.randn(3, 32, generator=g).bfloat16()
    res = torch.randn(3, 32, generator=g).bfloat16()
    weight = torch.randn(32, generator=g).bfloat16()
    x_before = x.clone()
    assert small_ops.rms_norm(cpu_loops, x, weight, 1e-5, res) is None
    assert torch.equal(x, x_before)  # the residual was not added
    gate_up = torch.randn(3, 64, generator=g).bfloat16()
    assert small_ops.silu_mul(cpu_loops, gate_up) is None
    qk = torch.randn(3, 2, 32, generator=g).bfloat16()
    cos, signed_sin = torch.randn(3, 1, 32).bfloat16(), torch.randn(3, 1, 32).bfloat16()
    assert small_ops.rotate_(cpu_loops, qk, cos, signed_sin) is None
    assert small_ops.argmax_rows(cpu_loops, gate_up) is None
    cache = torch.zeros(4, 32, dtype=torch.float16)
    rows = torch.tensor([0, 2, 3]), torch.tensor([1, 2, 3])
    assert not small_ops.write_kv(cpu_loops, cache, qk[:, :1], qk[:, 1:], *rows)
    assert not cache.any()

    with_loops = ForwardOps(SimpleNamespace(cpu_loops=cpu_loops))  # only its dispatch is used
    without = ForwardOps(SimpleNamespace(cpu_loops=None))
    h1, h2 = x.clone(), x.clone()
    assert torch.equal(with_loops.norm(h1, weight, 1e-5, res), without.norm(h2, weight, 1e-5, res))
    assert torch.equal(h1, h2) and torch.equal(h1, x + res)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(with_loops.silu_mul(gate_up), F.silu(gate) * up)
    assert torch.equal(with_loops.rotate(qk, cos, signed_sin), rotate(qk, cos, signed_sin))
    want = torch.zeros(4, 32, dtype=torch.float16)
    write_kv(want, qk[:, :1], qk[:, 1:], *rows)
    with_loops.write_kv(cache, qk[:, :1], qk[:, 1:], *rows)
    assert torch.equal(cache, want)
    assert greedy_tokens(gate_up.float(), cpu_loops) == gate_up.float().argmax(-1).tolist()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "cache_dtype"),
    [(4, 2, 48, torch.float32), (32, 2, 64, torch.float32), (4, 2, 64, torch.float16)],
    ids=["head-dim-48", "group-of-16", "float16-cache"],
)
def test_decode_attention_leaves_shapes_it_does_not_take_to_the_reference(
    cpu_loops, heads, kv_heads, head_dim, cache_dtype
):
    assert not attention_native.takes(heads, kv_heads, head_dim, cache_dtype)
    g = _gen()
    cache = torch.randn(10, 2, 4, kv_heads, head_dim, generator=g).to(cache_dtype)
    k, v = cache[:, 0], cache[:, 1]
    tables = torch.randperm(10, generator=g)[:6].view(2, 3).int()  # int32 tables
    ctx = torch.tensor([9, 3], dtype=torch.int32)
    q = torch.randn(2, heads, head_dim, generator=g)
    mask = attention_mask(ctx.long() - 1, 1, ctx.long(), 12)
    want = paged_attention(q[:, None], k, v, tables.long(), mask, 0.3)[:, 0]
    got = attention_native.decode_attention(cpu_loops, q, k, v, tables, ctx, 0.3)
    torch.testing.assert_close(got, want, **TOL)


def test_decode_attention_takes_int32_tables_and_a_batch_of_none(cpu_loops):
    g = _gen()
    cache = torch.randn(10, 2, 4, 1, 32, generator=g)
    k, v = cache[:, 0], cache[:, 1]
    tables = torch.randperm(10, generator=g)[:6].view(2, 3)
    ctx = torch.tensor([12, 1], dtype=torch.int32)
    q = torch.randn(2, 2, 32, generator=g)
    want = attention_native.decode_attention(cpu_loops, q, k, v, tables, ctx, 0.3)
    got = attention_native.decode_attention(cpu_loops, q, k, v, tables.int(), ctx, 0.3)
    assert torch.equal(got, want)
    none = attention_native.decode_attention(cpu_loops, q[:0], k, v, tables[:0], ctx[:0], 0.3)
    assert none.shape == (0, 2, 32)


def test_argmax_rows_gives_torch_argmax_ties_nans_and_all(cpu_loops):
    logits = torch.randn(6, 49_152, generator=_gen())
    logits[1, [100, 40_000]] = 50.0  # a tie: the first
    logits[2, 9] = float("nan")  # a NaN wins, as in torch
    logits[3] = float("-inf")
    logits[4, -1] = 60.0  # the last column
    want = logits.argmax(dim=-1).tolist()
    assert small_ops.argmax_rows(cpu_loops, logits) == want
    assert greedy_tokens(logits, cpu_loops) == greedy_tokens(logits) == want
    wide = torch.randn(3, 80, generator=_gen())
    assert small_ops.argmax_rows(cpu_loops, wide[:, :50]) == wide[:, :50].argmax(-1).tolist()


def _step_pool(g, cache_dtype, layers=2, heads=4, kv_heads=2, d=32, bs=4):
    """A decode step's pool, tables and rows: three sequences (one of a single key), each
    writing its newest key and value in every layer."""
    pool = torch.randn(12, layers, 2, bs, kv_heads, d, generator=g).to(cache_dtype)
    tables = torch.randperm(12, generator=g)[:9].view(3, 3)
    ctx = torch.tensor([9, 1, 12], dtype=torch.int32)  # keys after this step's write
    pos = ctx.long() - 1
    page, slot = tables[torch.arange(3), pos // bs], pos % bs
    kv_rows = torch.stack(
        [torch.stack([((page * layers + i) * 2 + kv) * bs + slot for kv in (0, 1)])
         for i in range(layers)]
    )  # fmt: skip
    cos, signed_sin = torch.randn(3, 1, d, generator=g), torch.randn(3, 1, d, generator=g)
    return pool, tables, ctx, kv_rows, (cos, signed_sin), (heads, kv_heads, d)


@pytest.mark.parametrize(
    ("cache_dtype", "window"), [(torch.float32, None), (torch.float32, 5), (torch.bfloat16, None)]
)
def test_decode_layers_rotate_write_and_attend_as_the_three_ops_apart(
    cpu_loops, cache_dtype, window
):
    """One call a layer (DecodeAttention.layers) against the torch forms run one after
    another: q and k rotated in the qkv rows, v untouched, this step's k and v in each
    layer's own rows of the pool, and the attention over them."""
    g = _gen()
    pool, tables, ctx, kv_rows, tables_rope, (heads, kv_heads, d) = _step_pool(g, cache_dtype)
    want_pool = pool.clone()
    step = attention_native.DecodeAttention(cpu_loops).layers(
        pool, tables, ctx, 0.3, window, tables_rope, pool.view(-1, kv_heads * d), kv_rows, heads
    )
    assert step is not None
    qk_width = (heads + kv_heads) * d
    tol = TOL if cache_dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for i in range(2):
        qkv = torch.randn(3, qk_width + kv_heads * d, generator=g)
        want_qkv = qkv.clone()
        qk = rotate(want_qkv[:, :qk_width].view(3, -1, d), *tables_rope)
        q, k = qk.split((heads, kv_heads), dim=1)
        v = want_qkv[:, qk_width:].view(3, kv_heads, d)
        write_kv(want_pool.view(-1, kv_heads * d), k, v, kv_rows[i, 0], kv_rows[i, 1])
        layer = want_pool[:, i].float()
        want = attention_native._reference(q, layer[:, 0], layer[:, 1], tables, ctx, 0.3, window)

        got = step(qkv, i)
        assert got is not None
        torch.testing.assert_close(got, want.reshape(3, heads * d), **tol)
        torch.testing.assert_close(qkv[:, :qk_width], qk.reshape(3, -1), **TOL)
        assert torch.equal(qkv[:, qk_width:], want_qkv[:, qk_width:])  # v as it was
        torch.testing.assert_close(pool.float(), want_pool.float(), **tol)


def test_decode_layers_refuse_what_they_do_not_take(cpu_loops):
    """A shape the loop does not take: no step (the forward runs the three ops apart);
    rows it does not take: None, and nothing rotated or written."""
    g = _gen()
    pool, tables, ctx, kv_rows, rope, (heads, kv_heads, d) = _step_pool(g, torch.float32, d=48)
    da = attention_native.DecodeAttention(cpu_loops)
    rows = pool.view(-1, kv_heads * d)
    assert da.layers(pool, tables, ctx, 0.3, None, rope, rows, kv_rows, heads) is None
    pool, tables, ctx, kv_rows, rope, (heads, kv_heads, d) = _step_pool(g, torch.float32)
    rows = pool.view(-1, kv_heads * d)
    half_rope = (rope[0].bfloat16(), rope[1])
    assert da.layers(pool, tables, ctx, 0.3, None, half_rope, rows, kv_rows, heads) is None
    step = da.layers(pool, tables, ctx, 0.3, None, rope, rows, kv_rows, heads)
    assert step is not None
    before = pool.clone()
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d, generator=g)
    for refused in (qkv.bfloat16(), qkv[:2], torch.randn(3, 2 * qkv.shape[1])[:, ::2]):
        kept = refused.clone()
        assert step(refused, 0) is None
        assert torch.equal(refused, kept)
    assert torch.equal(pool, before)


def test_forward_ops_keep_their_outputs_while_the_shape_repeats(cpu_loops):
    """A norm's and SwiGLU's outputs are reused while their shape repeats (the next GEMM
    reads them before the op's next call); a new shape gets a new tensor, and one larger
    than KEPT_OUTPUT_ELEMENTS is not kept, nor one for rows the loops refuse."""
    g = _gen()
    ops = ForwardOps(SimpleNamespace(cpu_loops=cpu_loops))
    weight = torch.randn(32, generator=g)
    h = torch.randn(4, 32, generator=g)
    first = ops.norm(h, weight, 1e-5, None)
    torch.testing.assert_close(first, F.rms_norm(h, (32,), weight, 1e-5), **TOL)
    again = ops.norm(h * 2, weight, 1e-5, None)
    assert again.data_ptr() == first.data_ptr()
    other = ops.norm(torch.randn(5, 32, generator=g), weight, 1e-5, None)
    assert other.shape == (5, 32) and other.data_ptr() != first.data_ptr()
    gate_up = torch.randn(4, 64, generator=g)
    act = ops.silu_mul(gate_up)
    assert act.data_ptr() not in (first.data_ptr(), other.data_ptr())
    assert ops.silu_mul(gate_up).data_ptr() == act.data_ptr()
    rows = KEPT_OUTPUT_ELEMENTS // 32 + 1
    big = torch.randn(rows, 32, generator=g)
    a, b = ops.norm(big, weight, 1e-5, None), ops.norm(big, weight, 1e-5, None)
    assert a.data_ptr() != b.data_ptr()
    torch.testing.assert_close(b, F.rms_norm(big, (32,), weight, 1e-5), **TOL)
    # rows the loops do not take (a bfloat16 model's) go to the torch form, nothing kept
    kept = dict(ops._outputs)
    half = ops.norm(h.bfloat16(), weight.bfloat16(), 1e-5, None)
    assert half.dtype == torch.bfloat16 and ops._outputs.keys() == kept.keys()
    assert all(ops._outputs[k] is v for k, v in kept.items())
