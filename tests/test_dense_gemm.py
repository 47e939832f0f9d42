"""The base model's GEMMs on reordered weights (kernels/dense.py): the product against
F.linear, which weights each choice reorders, and the demo model's greedy tokens with and
without the reordering (the oracle tests check the default against transformers + peft)."""

import pytest
import torch
import torch.nn.functional as F

from loraplex.demo.assets import DemoAssets
from loraplex.kernels.dense import (
    MIN_PACKED_ELEMENTS,
    linear,
    pack,
    pack_in_place,
    packed_gemm_works,
    use_packed,
)
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not packed_gemm_works(torch.float32), reason="this torch cannot reorder weights for oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 300])
def test_a_reordered_weight_multiplies_as_f_linear(dtype, rows):
    if not packed_gemm_works(dtype):
        pytest.skip(f"this torch cannot reorder {dtype} weights")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=gen).to(dtype)
    x = torch.randn(rows, 576, generator=gen).to(dtype)
    packed = pack(w)
    assert packed.is_mkldnn and packed.shape == w.shape and packed.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), rtol=tol, atol=tol)
    # a strided input (the model's attention output is one) is multiplied as it reads
    wide = torch.randn(rows, 2 * 576, generator=gen).to(dtype)[:, ::2]
    torch.testing.assert_close(linear(wide, packed), F.linear(wide, w), rtol=tol, atol=tol)
    assert linear(x, w) is not None and torch.equal(linear(x, w), F.linear(x, w))


@needs_onednn
def test_each_choice_reorders_where_it_should_and_onednn_says_why_it_cannot():
    assert use_packed("auto", CPU, torch.float32)
    assert not use_packed("torch", CPU, torch.float32)
    assert use_packed("onednn", CPU, torch.float32)
    assert not use_packed("auto", CPU, torch.float16)
    assert not use_packed("auto", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="onednn needs a CPU.*here: cuda, float32"):
        use_packed("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="here: cpu, float16"):
        use_packed("onednn", CPU, torch.float16)


@needs_onednn
def test_auto_leaves_a_small_weight_plain_and_onednn_reorders_every_one():
    """A small GEMM loses on the reordered layout (oneDNN's call costs more than MKL's):
    auto keeps the router bench's 128-wide layers plain and reorders SmolLM2's."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"small": (256, 128), "narrow": (128, 352), "edge": (512, 512), "big": (960, 576)}
    assert 128 * 352 < 512 * 512 == MIN_PACKED_ELEMENTS
    plain = {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}
    for choice, want in (
        ("auto", {"edge", "big"}),
        ("onednn", set(shapes)),
        ("torch", set()),
    ):
        weights = dict(plain)
        pack_in_place(choice, weights, list(shapes))
        assert {k for k, w in weights.items() if w.is_mkldnn} == want, choice
        x = torch.randn(8, 576, generator=gen)
        for k, w in weights.items():
            xk = x[:, : w.shape[1]]
            torch.testing.assert_close(linear(xk, w), F.linear(xk, plain[k]), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_the_demo_model_gives_the_same_greedy_tokens_with_its_weights_reordered(
    demo_assets: DemoAssets,
):
    """A tied LM head is reordered apart from the embedding it shares, which stays plain."""
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time there was"]
    adapters = [None, demo_assets.adapter_names[0], demo_assets.adapter_names[1]]
    params = [SamplingParams(max_tokens=12, temperature=0.0) for _ in prompts]
    tokens, engines = {}, {}
    for choice in ("onednn", "torch"):
        eng = LLMEngine(EngineConfig(model=str(demo_assets.model), dense_gemm=choice))
        for name in adapters[1:]:
            eng.add_adapter(name, demo_assets.adapters_dir / name)
        tokens[choice] = [o.token_ids for o in eng.generate(prompts, params, adapters)]
        engines[choice] = eng
    try:
        packed, plain = engines["onednn"].model, engines["torch"].model
        assert all(w.is_mkldnn for layer in packed.layers for w in _dense(layer))
        assert packed.w["lm_head"].is_mkldnn and not packed.w["embed"].is_mkldnn
        assert not any(w.is_mkldnn for layer in plain.layers for w in _dense(layer))
        assert packed.dense_bytes == plain.dense_bytes > 0
        assert tokens["onednn"] == tokens["torch"]
    finally:
        for eng in engines.values():
            eng.close()


def _dense(layer: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [layer[k] for k in ("qkv", "o", "gate_up", "down")]
