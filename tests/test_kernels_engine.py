"""The engine with the Triton backend (interpreted on CPU) against the engine with the torch
references: same checkpoint, a mixed-adapter batch with base-model requests, prefill (SGMV)
and decode (BGMV + paged decode attention) steps. Only the backend choice differs."""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

pytestmark = pytest.mark.slow

ADAPTERS = ("chat-r16", "math-r64", "sql-r8")


def _run(demo_assets, kernels: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(demo_assets.model),
            dtype="float32",
            pool_bytes=16 << 20,
            page_bytes=64 * 1024,
            kernels=kernels,
            device="cuda" if torch.cuda.is_available() else "cpu",  # else: the interpreter
        )
    )
    assert engine.kernels == kernels
    for name in ADAPTERS:
        engine.add_adapter(name, demo_assets.adapters_dir / name)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True)
    prompts = [[5, 17, 99, 3, 42, 7, 8], [11, 12], [200, 201, 202, 9, 1], [64, 65, 66]]
    adapters = ["chat-r16", None, "math-r64", "chat-r16"]
    logits: list[torch.Tensor] = []
    outs = engine.generate(
        prompts,
        [params] * 4,
        adapters,
        on_output=lambda o: logits.append(o.logits),
    )
    return [o.token_ids for o in outs], logits


def test_engine_with_triton_kernels_matches_torch(demo_assets):
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    tokens_torch, logits_torch = _run(demo_assets, "torch")
    tokens_triton, logits_triton = _run(demo_assets, "triton")
    assert tokens_triton == tokens_torch
    assert len(logits_triton) == len(logits_torch) == 16
    for a, b in zip(logits_triton, logits_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
