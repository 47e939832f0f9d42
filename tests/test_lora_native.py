"""LoRA's compiled CPU loops (kernels/lora_native.py) against the torch reference: the
scattered-arena cases the Triton kernels are checked on, layers and groups read through
one step's stacked tables, the engine with them against the engine with torch ops, and a
machine without a compiler."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DECODE,
    TARGET_RANKS,
    Resident,
    group_shape,
    runs_of,
    scattered_adapters,
    segments_of,
    table_builder,
)

from loraplex.kernels import attention_native, lora_native, native
from loraplex.kernels.backend import NativeBackend, TorchBackend, make_backend, resolve_kernels
from loraplex.kernels.lora import LoraGroupWeights, LoraOut, lora_sgmv
from loraplex.kernels.lora_tables import LoraLayout
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

# (tokens, adapter index or None): a prefill's runs (each within MAX_SEGMENT_TOKENS),
# adapter 0 twice, base tokens between
PREFILL = [(3, None), (16, 0), (1, 1), (9, 2), (2, None), (5, 3), (4, 0)]
CASES = [("qkv", 1), ("gate_up", 1), ("o", 1), ("down", 1), ("qkv", 4), ("down", 4)]


@pytest.fixture
def lib(cpu_loops):
    return cpu_loops


def _native_args(builder, runs, num_tokens, arena) -> lora_native.NativeArgs:
    meta = builder.build([r for r in runs if r[2] is not None], num_tokens, decode=False)
    return lora_native.NativeArgs(lora_native.native_step(meta, arena), 0, 0)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize(("kind", "tp"), CASES, ids=[f"{k}-tp{tp}" for k, tp in CASES])
def test_native_loops_match_reference(lib, kind, tp, decode):
    fan_in, widths = group_shape(kind, tp)
    arena, residents = scattered_adapters(fan_in, widths, TARGET_RANKS[len(widths)], torch.float32)
    runs, num_tokens = runs_of(DECODE if decode else PREFILL, residents)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, fan_in, generator=g)
    y0 = torch.randn(num_tokens, sum(widths), generator=g)
    want = y0.clone()
    lora_sgmv(want, x, segments_of(runs))
    builder = table_builder(arena, widths, max_rank=128, max_tokens=64, max_loras=8)
    args = _native_args(builder, runs, num_tokens, arena)
    y = y0.clone()
    h = lora_native.shrink(lib, x, args)
    lora_native.expand(lib, y, h, args)
    base = torch.tensor([r is None for s, e, r in runs for _ in range(e - s)])
    assert torch.equal(y[base], y0[base]), "tokens without an adapter changed"
    assert torch.equal(h[base], torch.zeros_like(h[base])), "h of base tokens is zeros"
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_strided_input_and_a_half_precision_output(lib):
    """Tensor parallelism shrinks a column slice of x; y may be bf16 (computed in float32)."""
    fan_in, widths = group_shape("qkv", 1)
    arena, residents = scattered_adapters(fan_in, widths, TARGET_RANKS[3], torch.float32)
    runs, num_tokens = runs_of(DECODE, residents)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(num_tokens, 2 * fan_in, generator=g)
    x = wide[:, fan_in:]  # rows a stride of 2 x fan_in apart
    y0 = torch.randn(num_tokens, sum(widths), generator=g)
    want = y0.clone()
    lora_sgmv(want, x.contiguous(), segments_of(runs))
    builder = table_builder(arena, widths, max_rank=128, max_tokens=64, max_loras=8)
    args = _native_args(builder, runs, num_tokens, arena)
    h = lora_native.shrink(lib, x, args)
    y = y0.to(torch.bfloat16)
    lora_native.expand(lib, y, h, args)
    torch.testing.assert_close(y.float(), want.to(torch.bfloat16).float(), rtol=2e-2, atol=5e-2)


def _model_like(seed: int) -> tuple[torch.Tensor, LoraLayout, list[Resident]]:
    """Three layers of two groups (q/k/v from 48 features; down from 80 to 48), adapters that
    skip a group in one layer, each adapter's matrices cut from one arena."""
    gen = torch.Generator().manual_seed(seed)
    arena = torch.randn(400_000, generator=gen) * 0.05
    cols = (((0, 48), (48, 64), (64, 80)), ((0, 48),))
    layout = LoraLayout(3, cols, max_rank=32, max_loras=4, max_tokens=64)
    at = 0

    def take(rows: int, width: int) -> torch.Tensor:
        nonlocal at
        v = arena[at : at + rows * width].view(rows, width)
        at += rows * width + 7  # not packed tight: offsets as a pool's pages give them
        return v

    def group(ranks: tuple[int, ...], fan_in: int, widths: tuple[int, ...]):
        present = [(j, r) for j, r in enumerate(ranks) if r]
        a = take(sum(r for _, r in present), fan_in)
        outs, h, start = [], 0, [0, 48, 64]
        for j, r in present:
            outs.append(LoraOut(start[j], start[j] + widths[j], h, h + r, (take(r, widths[j]),)))
            h += r
        return LoraGroupWeights((a,), tuple(outs))

    residents = []
    for ranks in ((8, 8, 8), (32, 0, 4), (1, 2, 3)):
        layers = []
        for layer in range(3):
            qkv = group(ranks, 48, (48, 16, 16))
            down = None if (layer == 1 and ranks[0] == 32) else group(ranks[:1], 80, (48,))
            layers.append([qkv, down])
        residents.append(Resident(layers))
    return arena, layout, residents


def test_every_layer_and_group_reads_its_own_tables(lib):
    """The native backend against the torch backend over a step's every layer and group:
    the loops find each layer's and group's rows in the stacked tables."""
    arena, layout, residents = _model_like(3)
    runs = [(0, 2, residents[0]), (3, 4, residents[1]), (4, 7, residents[2]), (7, 8, residents[0])]
    native, torch_ops = NativeBackend(layout, arena), TorchBackend(layout, arena)
    g = torch.Generator().manual_seed(4)
    # the second step repeats the set of adapters (kept tables, new segments), the third
    # drops one, the fourth holds one that lacks a group in a layer
    moved = [(0, 1, residents[0]), (1, 4, residents[1]), (4, 5, residents[2])]
    steps = ((runs, 9), (moved, 6), (runs[1:3], 7), ([(1, 3, residents[1])], 4))
    for step_runs, tokens in steps:
        args_n = native.prepare(step_runs, tokens, decode=True)
        args_t = torch_ops.prepare(step_runs, tokens, True)
        assert isinstance(args_n[0][0], lora_native.NativeArgs)
        for layer in range(3):
            for group, (fan_in, width) in enumerate(((48, 80), (80, 48))):
                x = torch.randn(tokens, fan_in, generator=g)
                y = torch.randn(tokens, width, generator=g)
                want = y.clone()
                at = args_t[layer][group]
                torch_ops.expand(want, torch_ops.shrink(x, at), at)
                hs = native.shrink(x, args_n[layer][group])
                native.expand(y, hs, args_n[layer][group])
                torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
                # h as wide as the group's largest R in the step (tensor parallelism sends
                # it), none where no adapter of the step has the group
                ranks = [w.rank for _, _, r in step_runs if (w := r.groups[layer][group])]
                assert [h.shape[1] for h in hs] == ([max(ranks)] if ranks else [])


def test_long_segments_take_the_torch_ops(lib):
    arena, layout, residents = _model_like(5)
    native = NativeBackend(layout, arena)
    n = lora_native.MAX_SEGMENT_TOKENS
    assert isinstance(
        native.prepare([(0, n, residents[0])], n, False)[0][0], lora_native.NativeArgs
    )
    long = native.prepare([(0, n + 1, residents[0])], n + 1, False)
    assert not isinstance(long[0][0], lora_native.NativeArgs)


@pytest.mark.slow
def test_engine_with_native_loops_matches_torch_ops(demo_assets, lib, monkeypatch):
    """The same mixed batch (prefill, then decode steps of adapters and the base model)
    through the engine with each backend (native: LoRA, decode attention and the step's
    small ops in the compiled loops, a decode layer's RoPE, KV write and attention in one
    call): the same tokens, logits within float error."""
    layer_calls = []
    real_call = attention_native.DecodeLayers.__call__

    def counted(self, qkv, i):
        out = real_call(self, qkv, i)
        layer_calls.append(out is not None)
        return out

    monkeypatch.setattr(attention_native.DecodeLayers, "__call__", counted)
    layers = []

    def run(kernels: str):
        engine = LLMEngine(
            EngineConfig(model=str(demo_assets.model), pool_bytes=64 << 20, kernels=kernels)
        )
        assert engine.kernels == kernels
        layers.append(engine.model.cfg.num_layers)
        # native: decode attention and the small ops in the loops too; torch: none of them
        ops = engine.model.ops
        assert (ops.loops is not None) == (kernels == "native")
        assert (ops.kernels.decode_attention is not None) == (kernels == "native")
        for name in ("chat-r16", "math-r64", "sql-r8"):
            engine.add_adapter(name, demo_assets.adapters_dir / name)
        logits: list[torch.Tensor] = []
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
        prompts = [[5, 17, 99, 3, 42, 7, 8], [11, 12], [200, 201, 202, 9, 1], [64, 65, 66]]
        adapters = ["chat-r16", None, "math-r64", "sql-r8"]
        outs = engine.generate(
            prompts, [params] * 4, adapters, on_output=lambda o: logits.append(o.logits)
        )
        engine.close()
        return [o.token_ids for o in outs], logits

    tokens_native, logits_native = run("native")
    # each layer of the five decode steps in one call
    assert len(layer_calls) == 5 * layers[0] and all(layer_calls)
    tokens_torch, logits_torch = run("torch")
    assert len(layer_calls) == 5 * layers[0]
    assert tokens_native == tokens_torch
    for a, b in zip(logits_native, logits_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_without_a_compiler_auto_keeps_torch_and_native_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    native.library.cache_clear()
    native._why_not.clear()
    try:
        assert resolve_kernels("auto", torch.device("cpu"), {}) == "torch"
        assert "no-such-cc" in (native.unavailable() or "")
        arena, layout, _ = _model_like(6)
        with pytest.raises(ValueError, match="kernels: native is unavailable here"):
            make_backend("native", layout, arena)
        assert not (tmp_path / "cache" / "native").exists() or not any(
            (tmp_path / "cache" / "native").glob("*.so")
        )
    finally:
        native.library.cache_clear()
        native._why_not.clear()
