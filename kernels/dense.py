"""The base model's dense projections, y = x Wᵀ, on a CPU: the weights reordered once at
load into oneDNN's blocked layout, then each step's GEMMs read them as they lie.

torch's `F.linear` runs fp32 through MKL. On this project's 2-core AMD EPYC, SmolLM2's
decode GEMMs (its 30 layers and LM head, batch 16) took 67 ms a step that way and 31 ms
through oneDNN with the weights reordered (batch 32: 98 against 54 ms; bf16, where
`F.linear` already calls oneDNN but reorders the weight at every call: 33 against 18 ms).
vLLM's CPU backend does the same at load (`dispatch_cpu_unquantized_gemm` in
vllm/model_executor/layers/utils.py). On a 2-core Intel Xeon (AVX-512; 2026-12-07, every
GEMM of SmolLM2's shapes once, 2 threads, two microbenchmarks) the reordered weights win at
4-8 rows (34-36 against 44-46 ms at 4, 42-44 against 54-57 at 8), about tie at 16-32
(47-57 against 54-58 at 16), and lose at 1-3 rows (33-36 against 23-31 ms: there MKL reads
the weights at ~23 GB/s, what a sum over them reads); no other reorder hint (1, 4 or 64
rows) did better at 1-3 rows. Observed, not promised: on SmolLM2's gate/up shape a
row came out bit-identical at every batch size tried (1-300) through the reordered weight,
and not through MKL's fp32 GEMM.

The op is a private one of torch (`torch.ops.mkldnn`, used by its compiler), and torch is
not pinned above: `packed_gemm_works` checks it against `F.linear` once per dtype, and where
it is missing or disagrees the model keeps `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The batch the reordered layout is chosen for: decode batches of 8-32 measured fastest
# with it (a prefill of 300 tokens still gained 1.2x).
PACK_BATCH = 16

# `auto` leaves smaller weights plain: oneDNN's call costs ~15 us more than MKL's, which a
# small GEMM does not win back. Per call on the 2-core EPYC (2 threads; F.linear /
# reordered, us): 256x128 at 1 row 5.7 / 21.3, at 32 rows 26 / 44; 384x384 at 8 rows
# 52 / 52; 512x512 at 8 rows 85 / 65 (at 1 row 36 / 49); 960x576 at 8 rows 152 / 98;
# 3072x576 at 8 rows 520 / 201. SmolLM2's weights are all above it; the router bench's
# 128-wide model's layers all below.
MIN_PACKED_ELEMENTS = 512 * 512


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ, W plain ([out, in]) or reordered by `pack`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    return F.linear(x, weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] reordered for `linear` (a copy; shape and dtype kept)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH)


@functools.cache
def packed_gemm_works(dtype: torch.dtype) -> bool:
    """Whether this torch reorders and multiplies `dtype` weights on this CPU, agreeing with
    F.linear on a small product."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        got = linear(x, pack(w)).float()
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        return False
    want = F.linear(x.float(), w.float())
    return got.shape == want.shape and torch.allclose(got, want, rtol=2e-2, atol=2e-2)


def pack_in_place(choice: str, weights: dict[str, torch.Tensor], keys: list[str]) -> None:
    """Reorders `weights[k]` in place for each key `choice` reorders (`engine.dense_gemm`):
    auto, those of at least MIN_PACKED_ELEMENTS on a CPU where it works; onednn, every
    one (a clear error where it cannot); torch, none."""
    first = weights[keys[0]]
    if not use_packed(choice, first.device, first.dtype):
        return
    for k in keys:
        if choice == "onednn" or weights[k].numel() >= MIN_PACKED_ELEMENTS:
            weights[k] = pack(weights[k])


def use_packed(choice: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `choice` reorders weights of this device and dtype at all: auto, on a CPU
    where it works; onednn insists (a clear error where it cannot); torch never."""
    if choice == "torch":
        return False
    works = device.type == "cpu" and packed_gemm_works(dtype)
    if choice == "onednn" and not works:
        raise ValueError(
            f"dense_gemm: onednn needs a CPU and float32 or bfloat16 weights that this torch "
            f"can reorder; here: {device.type}, {str(dtype).removeprefix('torch.')}"
        )
    return works
