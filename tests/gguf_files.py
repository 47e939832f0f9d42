"""GGUF files written the way llama.cpp's converter writes a Llama checkpoint
(convert_hf_to_gguf.py: LlamaModel's tensor names, q/k rows permuted for its rope,
metadata keys), from a synthetic Hugging Face checkpoint, with the `gguf` package."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

TENSOR_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Block layouts (ggml-common.h): where each block's fp16 scales sit, so random bytes make
# finite weights. Q4_K: d, dmin first; Q6_K: d last.
_K_SCALES = {"Q4_K": ((0, 2), (2, 4)), "Q6_K": ((208, 210),)}
_K_SCALE = {"Q4_K": 0.002, "Q6_K": 0.0002}  # weights of about the synthetic model's size


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rope row order: each head's rows [2, d/2] -> [d/2, 2]."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`w` in `qtype`; the K-quants (which the gguf package cannot quantize) get random
    blocks with small finite scales, of w's shape."""
    import gguf
    from gguf.quants import GGML_QUANT_SIZES, quantize

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in _K_SCALES:
        return quantize(w.astype(np.float32), kind)
    block, size = GGML_QUANT_SIZES[kind]
    rows, cols = w.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(_K_SCALE[qtype]).tobytes(), dtype=np.uint8)
    for lo, hi in _K_SCALES[qtype]:
        raw[:, :, lo:hi] = scale
    return raw.reshape(rows, cols // block * size)


def write_gguf(
    path: Path,
    model_dir: Path,
    qtype: str = "F32",
    *,
    norm_type: str = "F32",
    architecture: str = "llama",
    metadata_override: dict | None = None,
    seed: int = 0,
) -> Path:
    """The checkpoint in `model_dir` (config.json + model.safetensors) as one GGUF file:
    2-D weights in `qtype`, norms in `norm_type`."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    meta = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
        "rope.freq_base": cfg["rope_theta"],
        "vocab_size": cfg["vocab_size"],
        **(metadata_override or {}),
    }
    for key, value in meta.items():
        full = f"{architecture}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    writer.add_file_type(0)
    for name, w in tensors.items():
        w = w.astype(np.float32)
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            target = f"blk.{layer}.{LAYER_NAMES[module]}.weight"
            if module == "self_attn.q_proj":
                w = permute(w, heads)
            elif module == "self_attn.k_proj":
                w = permute(w, kv_heads)
        else:
            target = TENSOR_NAMES[name]
        kind = norm_type if w.ndim == 1 else qtype
        data = encode(w, kind, rng) if kind != "F32" else w
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
