"""The CPU LoRA ops (kernels/lora_gathered.py, the torch backend) against the torch
reference `lora_sgmv`: Llama-3-8B's projection groups / tp scaled down, ranks 1-128 mixed in
one step, absent targets, adapters over shuffled pages with rows split across pages, tokens
without adapters, an adapter's tokens in two runs, decode and prefill steps; the rest of the
arena NaN, so that a padding row read from outside an adapter would show. And the number of
ops a group costs does not grow with the adapters in the step or their row-chunks."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import group_shape, layout_for, runs_of, scattered_adapters, segments_of
from torch.utils._python_dispatch import TorchDispatchMode

from loraplex.kernels import lora_gathered
from loraplex.kernels.backend import make_backend
from loraplex.kernels.lora import lora_sgmv

RANKS = {
    3: [(128, 0, 64), (1, 1, 1), (8, 16, 0), (0, 32, 5), (16, 16, 16)],
    2: [(128, 64), (1, 0), (16, 16), (0, 7), (9, 9)],
    1: [(128,), (1,), (16,), (33,), (64,)],
}
# (tokens, adapter index or None): adapter 0 in two runs
DECODE = [(1, a) for a in (None, 0, 0, 1, None, 2, 3, 3, 0, 4)]
# batched in place: each adapter's tokens in order, as many each, base-model tokens last
DECODE_IN_ORDER = [(1, a) for a in (0, 0, 1, 1, 2, 2, 3, 3, 4, 4, None)]
PREFILL = [(3, None), (17, 0), (1, 1), (16, 2), (2, None), (5, 3), (4, 0), (1, 4)]
LONG_PREFILL = [(40, 0), (1, 1), (1, 2), (1, 3)]  # padding would quadruple the rows


def _backend(arena, widths):
    return make_backend("torch", layout_for(widths, 128, 256, 8), arena)


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "o", "down"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("plan", ["decode", "decode_in_order", "prefill", "long_prefill"])
@pytest.mark.parametrize("gather", ["kept", "per_step", False, "masked"])
def test_gathered_ops_equal_the_reference(
    kind: str, tp: int, plan: str, gather: str | bool, monkeypatch: pytest.MonkeyPatch
):
    """gather: rows gathered in buckets (kept across steps, or gathered by each), read in
    place (False), or read in place with the set's rows kept for one masked product from
    its second step ("masked")."""
    buckets = gather in ("kept", "per_step")
    monkeypatch.setattr(lora_gathered, "GATHER_BYTES_PER_SAVED_OP", 1 << 40 if buckets else 0)
    monkeypatch.setattr(lora_gathered, "MASKED_FLOPS_PER_SAVED_OP", 1 << 40 if gather else 0)
    monkeypatch.setattr(lora_gathered, "MASKED_KEEP_AFTER_REPEATS", 1)
    if gather == "per_step":
        monkeypatch.setattr(lora_gathered, "GATHERED_KEEP_BYTES", 0)
    fan_in, widths = group_shape(kind, tp)
    arena, residents = scattered_adapters(fan_in, widths, RANKS[len(widths)], torch.float32)
    arena[arena == 0] = float("nan")  # everything outside the adapters
    steps = {
        "decode": DECODE,
        "decode_in_order": DECODE_IN_ORDER,
        "prefill": PREFILL,
        "long_prefill": LONG_PREFILL,
    }
    runs, num_tokens = runs_of(steps[plan], residents)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, fan_in, generator=g)
    y = torch.randn(num_tokens, sum(widths), generator=g)
    expected = y.clone()
    lora_sgmv(expected, x, segments_of(runs))

    backend = _backend(arena, widths)
    adapter_runs = [(s, e, r) for s, e, r in runs if r is not None]
    for step in range(3):  # later steps of the same adapters reuse the row offsets
        args = backend.prepare(adapter_runs, num_tokens, plan.startswith("decode"))[0][0]
        if not buckets or plan == "decode":  # (fewer ops than buckets: read in place)
            assert (args.in_place is None) == buckets
        if not buckets:
            assert (args.masked is not None) == (gather == "masked" and step > 0)
        out = y.clone()
        backend.expand(out, backend.shrink(x, args), args)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_a_step_without_adapters_costs_nothing():
    fan_in, widths = group_shape("o", 1)
    arena, _ = scattered_adapters(fan_in, widths, RANKS[1], torch.float32)
    backend = _backend(arena, widths)
    args = backend.prepare([], 4, True)[0][0]
    y = torch.randn(4, sum(widths))
    before = y.clone()
    backend.expand(y, backend.shrink(torch.randn(4, fan_in), args), args)
    assert torch.equal(y, before)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(num_adapters: int, page_elems: int) -> int:
    fan_in, widths = group_shape("qkv", 1)
    ranks = [(16, 16, 16)] * num_adapters
    arena, residents = scattered_adapters(fan_in, widths, ranks, torch.float32, page_elems)
    runs, num_tokens = runs_of([(1, i % num_adapters) for i in range(32)], residents)
    backend = _backend(arena, widths)
    args = backend.prepare(runs, num_tokens, True)[0][0]
    assert args.in_place is None, "rank-16 q/k/v adapters on 32 tokens are gathered"
    x, y = torch.randn(num_tokens, fan_in), torch.randn(num_tokens, sum(widths))
    with _CountOps() as count:
        backend.expand(y, backend.shrink(x, args), args)
    return count.ops


def test_a_group_costs_the_same_ops_whatever_the_adapters_and_chunks():
    few = _ops_per_step(4, page_elems=1 << 16)  # each matrix in one page
    many = _ops_per_step(8, page_elems=1024)  # 8 adapters, A over 48 row-chunks each
    assert many == few, (few, many)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep", [True, False])
def test_steps_of_the_same_adapters_gather_their_rows_once(
    keep: bool, monkeypatch: pytest.MonkeyPatch
):
    """The rows of a repeating set of adapters are gathered when the set first appears,
    not by every step (the copy was most of LoRA's per-step cost on a CPU); a new set is
    gathered anew, and a set seen before gives the reference's result again."""
    if not keep:
        monkeypatch.setattr(lora_gathered, "GATHERED_KEEP_BYTES", 0)
    fan_in, widths = group_shape("qkv", 1)
    ranks = [(16, 16, 16)] * 4
    arena, residents = scattered_adapters(fan_in, widths, ranks, torch.float32)
    backend = _backend(arena, widths)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, fan_in, generator=g), torch.randn(8, sum(widths), generator=g)
    for step, pair in enumerate(((0, 1), (0, 1), (2, 3), (0, 1))):
        repeat = step == 1
        runs, num_tokens = runs_of([(1, pair[i % 2]) for i in range(8)], residents)
        expected = y.clone()
        lora_sgmv(expected, x, segments_of(runs))
        with _RecordOps() as record:
            args = backend.prepare(runs, num_tokens, True)[0][0]
            out = y.clone()
            backend.expand(out, backend.shrink(x, args), args)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        # tokens alternate between the two adapters: one index_select gathers them; the
        # rows of A and of each target's Bt are 1 + 3 more, unless kept from the last step
        gathers = record.names.count("index_select.default")
        assert gathers == (1 if keep and repeat else 5), (step, record.names)


@pytest.mark.parametrize("gather", [True, False])
def test_a_new_set_builds_gather_plans_only_for_the_groups_it_gathers(
    gather: bool, monkeypatch: pytest.MonkeyPatch
):
    """Whether a group reads in place is decided on its ranks and widths, before any index is
    built: a set of adapters that reads every group in place (small adapters, the router
    bench's replica) builds no gather plan when it first appears, which a churning batch
    pays at most steps (26 ms a new set there, 3 x its base step, before this)."""
    monkeypatch.setattr(lora_gathered, "GATHER_BYTES_PER_SAVED_OP", 1 << 40 if gather else 0)
    fan_in, widths = group_shape("qkv", 1)
    arena, residents = scattered_adapters(fan_in, widths, RANKS[3], torch.float32)
    backend = _backend(arena, widths)
    runs, num_tokens = runs_of(DECODE, residents)
    with _RecordOps() as record:
        args = backend.prepare([(s, e, r) for s, e, r in runs if r is not None], num_tokens, True)
    built = {"gather.default", "where.self"} & set(record.names)
    assert (args[0][0].in_place is None) == gather
    assert bool(built) == gather, record.names


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "o", "down"])
def test_a_groups_shape_gives_the_size_of_the_plan_it_would_build(kind: str):
    """The decision to gather reads each group's shape (`GroupShape.gathered_elems`) where
    it read the built plan's: the two agree for every bucket, layer and group."""
    fan_in, widths = group_shape(kind, 1)
    arena, residents = scattered_adapters(fan_in, widths, RANKS[len(widths)], torch.float32)
    planner = _backend(arena, widths).planner
    planner._plan(residents)
    gather_all = [[False] * len(per_layer) for per_layer in planner._in_place]
    for bucket in planner._buckets:
        tabs = [planner._tables_of(residents[slot]) for slot in bucket]
        shapes = planner._group_shapes(tabs, [residents[slot] for slot in bucket])
        plans = planner._group_plans(tabs, shapes, gather_all)
        for shape_row, plan_row in zip(shapes, plans, strict=True):
            for shape, plan in zip(shape_row, plan_row, strict=True):
                assert (shape is None) == (plan is None)
                if plan is not None:
                    assert shape.gathered_elems == plan.gathered_elems
                    assert shape.cols == plan.cols and shape.rank == plan.rank


@pytest.mark.parametrize("plan", ["decode", "prefill", "long_prefill"])
@pytest.mark.parametrize("gather", ["kept", "per_step", "masked"])
def test_bf16_gathered_ops_equal_the_fp32_reference(
    plan: str, gather: str, monkeypatch: pytest.MonkeyPatch
):
    """A bf16 arena on a CPU: rows kept across steps are kept and multiplied in fp32
    (kept_dtype), rows gathered per step stay bf16; batched and per-run token plans. Both
    are the fp32 reference on the same bf16 values, within bf16's rounding of y; and so
    are masked rows ("masked": read in place, the set's rows kept in fp32)."""
    masked = gather == "masked"
    monkeypatch.setattr(lora_gathered, "GATHER_BYTES_PER_SAVED_OP", 0 if masked else 1 << 40)
    monkeypatch.setattr(lora_gathered, "MASKED_FLOPS_PER_SAVED_OP", 1 << 40)
    monkeypatch.setattr(lora_gathered, "MASKED_KEEP_AFTER_REPEATS", 1)
    if gather == "per_step":
        monkeypatch.setattr(lora_gathered, "GATHERED_KEEP_BYTES", 0)
    fan_in, widths = group_shape("qkv", 1)
    arena, residents = scattered_adapters(fan_in, widths, RANKS[3], torch.bfloat16)
    arena32, residents32 = scattered_adapters(fan_in, widths, RANKS[3], torch.float32)
    arena32.copy_(arena)  # the same values, exactly
    steps = {"decode": DECODE, "prefill": PREFILL, "long_prefill": LONG_PREFILL}
    runs, num_tokens = runs_of(steps[plan], residents)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, fan_in, generator=g).bfloat16()
    y = torch.randn(num_tokens, sum(widths), generator=g).bfloat16()
    expected = y.float()
    lora_sgmv(expected, x.float(), segments_of(runs_of(steps[plan], residents32)[0]))

    backend = _backend(arena, widths)
    adapter_runs = [(s, e, r) for s, e, r in runs if r is not None]
    for _ in range(2):  # the second step reads the kept rows
        args = backend.prepare(adapter_runs, num_tokens, plan == "decode")[0][0]
        out = y.clone()
        backend.expand(out, backend.shrink(x, args), args)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=2e-2)
    if masked:
        assert args.masked is not None and args.masked[0].a.dtype == torch.float32
        return
    kept = [group.a for group, _ in args.parts if group.a is not None]
    assert all(a.dtype == torch.float32 for a in kept) and bool(kept) == (gather == "kept")


@pytest.mark.parametrize("block", [True, False])
def test_a_repeating_decode_step_expands_each_group_with_one_op(
    block: bool, monkeypatch: pytest.MonkeyPatch
):
    """Kept rows of a set of adapters whose tokens come in slot order: from the set's second step,
    the expand is one baddbmm_ of h with the Bts' block-diagonal matrix into y's rows, where
    the zeros cost less than the J bmm, cat and add they replace; where they would cost more
    (`BLOCK_BYTES_PER_SAVED_OP`, which says what it saves on the real model), the expand is
    those ops, and the result is the same. The shrink is one bmm: the kept A's padding rows
    are zeroed, so h needs no rank mask."""
    monkeypatch.setattr(lora_gathered, "GATHER_BYTES_PER_SAVED_OP", 1 << 40)
    if not block:
        monkeypatch.setattr(lora_gathered, "BLOCK_BYTES_PER_SAVED_OP", 0)
    fan_in, widths = group_shape("qkv", 1)
    ranks = [(16, 8, 16), (8, 16, 16), (16, 16, 16), (16, 12, 9)]  # one bucket, padded rows
    arena, residents = scattered_adapters(fan_in, widths, ranks, torch.float32)
    arena[arena == 0] = float("nan")
    backend = _backend(arena, widths)
    runs, num_tokens = runs_of([(1, i // 2) for i in range(8)], residents)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(num_tokens, fan_in, generator=g), torch.randn(num_tokens, sum(widths))
    expected = y.clone()
    lora_sgmv(expected, x, segments_of(runs))
    for _ in range(3):  # the first keeps the rows, the second builds the block, zeroes A
        with _RecordOps() as record:
            args = backend.prepare(runs, num_tokens, True)[0][0]
            out = y.clone()
            backend.expand(out, backend.shrink(x, args), args)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    products = [n for n in record.names if "bmm" in n or n.startswith(("cat", "add", "mul"))]
    if block:
        assert products == ["bmm.default", "baddbmm_.default"], record.names
    else:
        assert products.count("bmm.default") == 1 + len(widths) and "cat.default" in products


def _masked_step(backend, residents, plan, fan_in, widths):
    """One step of `plan` (tokens, adapter index) through the backend, checked against the
    reference; its args."""
    runs, num_tokens = runs_of(plan, residents)
    g = torch.Generator().manual_seed(len(plan))
    x, y = torch.randn(num_tokens, fan_in, generator=g), torch.randn(num_tokens, sum(widths))
    expected = y.clone()
    lora_sgmv(expected, x, segments_of(runs))
    args = backend.prepare([r for r in runs if r[2] is not None], num_tokens, True)[0][0]
    out = y.clone()
    backend.expand(out, backend.shrink(x, args), args)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    return args


def test_a_batch_whose_requests_finish_keeps_its_masked_rows_until_half_are_gone(
    monkeypatch: pytest.MonkeyPatch,
):
    """Rows kept for a set read in place (once it has repeated MASKED_KEEP_AFTER_REPEATS steps)
    serve the steps of any subset holding at least half of its adapters (the others' rows
    meet zeros in the mask): a batch whose requests finish does not copy its adapters again
    at each finish. Below half, the step reads in place, and the new set's rows are kept
    when it repeats."""
    monkeypatch.setattr(lora_gathered, "GATHER_BYTES_PER_SAVED_OP", 0)  # read in place
    fan_in, widths = group_shape("qkv", 1)
    ranks = [(16, 8, 16), (8, 16, 0), (4, 4, 4), (16, 16, 16), (0, 12, 9)]
    arena, residents = scattered_adapters(fan_in, widths, ranks, torch.float32)
    arena[arena == 0] = float("nan")
    backend = _backend(arena, widths)
    full = [(1, a) for a in (0, 1, 1, 2, 3, None, 4, 0)]
    for _ in range(lora_gathered.MASKED_KEEP_AFTER_REPEATS):  # its first step and repeats
        assert _masked_step(backend, residents, full, fan_in, widths).masked is None
    kept = _masked_step(backend, residents, full, fan_in, widths).masked
    assert kept is not None, "the set repeated: its rows are kept"
    three = [(1, a) for a in (3, None, 1, 4, 3)]
    assert _masked_step(backend, residents, three, fan_in, widths).masked[0] is kept[0]
    two = [(1, a) for a in (1, 3, 3)]
    for _ in range(lora_gathered.MASKED_KEEP_AFTER_REPEATS):
        assert _masked_step(backend, residents, two, fan_in, widths).masked is None
    again = _masked_step(backend, residents, two, fan_in, widths).masked
    assert again is not None and again[0].a.shape[0] < kept[0].a.shape[0]


def test_a_masked_step_costs_the_same_ops_whatever_the_adapters_and_a_long_one_reads_in_place(
    monkeypatch: pytest.MonkeyPatch,
):
    """A masked step of a group is one product, its mask and one addmm_ per target, whatever
    the adapters; a step of many tokens, whose product would multiply each by every
    adapter's rows, reads in place instead (MASKED_FLOPS_PER_SAVED_OP)."""
    monkeypatch.setattr(lora_gathered, "GATHER_BYTES_PER_SAVED_OP", 0)  # read in place
    fan_in, widths = group_shape("qkv", 1)
    arena, residents = scattered_adapters(fan_in, widths, RANKS[3], torch.float32)
    backend = _backend(arena, widths)
    decode = [(1, i % 5) for i in range(10)]
    for _ in range(lora_gathered.MASKED_KEEP_AFTER_REPEATS + 1):
        args = _masked_step(backend, residents, decode, fan_in, widths)
    with _RecordOps() as record:
        runs, num_tokens = runs_of(decode, residents)
        x, y = torch.randn(num_tokens, fan_in), torch.randn(num_tokens, sum(widths))
        backend.expand(y, backend.shrink(x, args), args)
    products = [n for n in record.names if n.startswith(("mm", "addmm", "mul", "add", "bmm"))]
    assert products == ["mm.default", "mul_.Tensor"] + ["addmm_.default"] * len(widths)
    long = [(200, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert _masked_step(backend, residents, long, fan_in, widths).masked is None
