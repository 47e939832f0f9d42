"""The decode step's fused CPU ops against what they replace: the rotation of q's and k's
heads in one call (`rope.rotate`) against HF's `apply_rotary_pos_emb` per tensor, at the
head counts of one rank of a tensor-parallel group too, the RMS norm against HF's
`LlamaRMSNorm`, and a decode step's attention without its index copies against the general
path."""

from dataclasses import replace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from loraplex.checkpoint_shape import ModelShape
from loraplex.demo.assets import DemoAssets
from loraplex.replica.batch import build_step_batch
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.model.llama import rms_norm
from loraplex.replica.model.rope import RotaryEmbedding, apply_rotary, rotate
from loraplex.replica.sampling import SamplingParams

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def model_config(heads: int, kv_heads: int, dtype: torch.dtype, scaling: dict | None):
    shape = ModelShape.from_config_dict(
        {
            "model_type": "llama",
            "vocab_size": 100,
            "hidden_size": heads * 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 512,
            "rope_theta": 100000.0,
            "rope_scaling": scaling,
        }
    )
    return ModelConfig.from_shape(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize(
    "heads,kv_heads", [(9, 3), (3, 1), (4, 4)], ids=["smollm2", "smollm2-tp3-rank", "mha"]
)
def test_q_and_k_rotated_in_one_call_equal_hf_per_tensor(dtype, scaling, heads, kv_heads):
    """rotate() on q's and k's heads side by side, as the model views its fused qkv output
    (a strided view: v's columns follow), equals HF's rotation of q and of k, bit for bit."""
    cfg = model_config(heads, kv_heads, dtype, scaling)
    rope = RotaryEmbedding(cfg, 512, torch.device("cpu"))
    t, d = 7, cfg.head_dim
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 511])
    cos, signed_sin = rope.tables(positions)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, -1, d)
    q, k = rotate(qk, cos, signed_sin).split((heads, kv_heads), dim=1)

    q_ref, k_ref = qkv[:, : heads * d], qkv[:, heads * d : (heads + kv_heads) * d]
    hf_q, hf_k = apply_rotary_pos_emb(
        q_ref.view(1, t, heads, d).transpose(1, 2),
        k_ref.view(1, t, kv_heads, d).transpose(1, 2),
        rope.cos[positions][None],
        rope.sin[positions][None],
    )
    assert torch.equal(q, hf_q.transpose(1, 2)[0])
    assert torch.equal(k, hf_k.transpose(1, 2)[0])
    sin = rope.sin[positions][:, None]
    assert torch.equal(q, apply_rotary(q_ref.view(t, heads, d), cos, sin))


def test_decode_step_attention_without_index_copies_equals_the_general_path(
    assets: DemoAssets,
):
    """A decode step's attention returns the reference's output as it comes; it equals the
    general path (gather q's rows, scatter the output's), and a step that also prefills
    takes the general path."""
    engine = LLMEngine(EngineConfig(model=str(assets.model)))
    for prompt in ([5, 17, 99, 3], [11], list(range(30, 52))):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    engine.step()
    batch = build_step_batch(engine.scheduler.schedule(), engine.kv, None)
    (group,) = batch.groups
    assert group.decode and group.every_row
    cfg, t = engine.model.cfg, batch.input_ids.shape[0]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, generator=gen)
    q = q.to(cfg.dtype)[:, : cfg.num_heads]  # a strided view, as the model passes it
    pool = (engine.kv.view, engine.kv.rows.view(-1, cfg.head_dim), cfg.num_heads)
    fast = batch.attention(*pool, engine.model.scale, None)(q, 0)
    general = replace(batch, groups=(replace(group, every_row=False),))
    assert torch.equal(fast, general.attention(*pool, engine.model.scale, None)(q, 0))

    engine.add_request(list(range(60, 70)), SamplingParams(max_tokens=2))
    mixed = build_step_batch(engine.scheduler.schedule(), engine.kv, None)
    assert len(mixed.groups) == 2 and not any(g.every_row for g in mixed.groups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 64), (32, 576), (33, 960), (5, 4096)])
def test_rms_norm_is_hf_llama_rms_norm_bit_for_bit(dtype, rows, width):
    """torch's rms_norm in float32 (fewer intermediate tensors), the reference's ops in
    half precision: both equal to transformers' LlamaRMSNorm bit for bit, at scales from
    small to large."""
    gen = torch.Generator().manual_seed(rows * width)
    hf = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width, generator=gen))
        for scale in (1e-3, 1.0, 100.0):
            x = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
            assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))
