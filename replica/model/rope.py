"""Rotary position embeddings: default, linear and llama3 frequency scaling (as in HF)."""

from __future__ import annotations

import math

import torch

from loraplex.replica.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos and signed sin tables [max_positions, head_dim] computed once; a step indexes
    them once for every layer (`rotate`'s form of the rotation)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device):
        inv_freq = inverse_frequencies(cfg).to(device)
        t = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(cfg.dtype)
        self.sin = emb.sin().to(cfg.dtype)
        half = inv_freq.shape[0]
        self.signed_sin = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and signed sin for the step's positions (`rotate`'s)."""
        return self.cos[positions][:, None, :], self.signed_sin[positions][:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in four ops (it takes ten on q and k, two calls): the halves swapped
    by one flip and the sign folded into the sin table. Bit-identical to it: negating is
    exact, and the products and the sum round as it does. x [T, heads, head_dim] may be
    q's and k's heads side by side (a view of the fused qkv output)."""
    t, heads, dim = x.shape
    swapped = x.unflatten(-1, (2, dim // 2)).flip(-2).view(t, heads, dim)  # flip copies
    # the same products and sum, written into two new tensors, not four
    return (x * cos).add_(swapped.mul_(signed_sin))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the (non-interleaved) HF convention: the
    reference `rotate` is tested against."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
