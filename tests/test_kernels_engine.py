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
    device = "cuda" if torch.cuda.is_available() else "cpu"  # else: the interpreter
    engine = _engine(demo_assets, device, kernels)
    assert engine.kernels == kernels
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


def _engine(demo_assets, device: str, kernels: str) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(demo_assets.model),
            dtype="float32",
            pool_bytes=16 << 20,
            page_bytes=64 * 1024,
            kernels=kernels,
            device=device,
        )
    )
    for name in ADAPTERS:
        engine.add_adapter(name, demo_assets.adapters_dir / name)
    return engine


def _mixed_run(engine: LLMEngine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy and seeded sampled requests, with and without adapters, then a second wave
    that reuses the first wave's cached prefix blocks."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    prefix = list(range(40, 80))  # longer than a KV block: the second wave hits the cache
    prompts = [prefix + [5, 17], [11, 12], prefix + [200, 9], [64, 65, 66]]
    adapters = ["chat-r16", None, "math-r64", "sql-r8"]
    logits: list[torch.Tensor] = []
    tokens = []
    for wave in range(2):
        params = [greedy, sampled, sampled, greedy] if wave == 0 else [sampled, greedy] * 2
        outs = engine.generate(
            prompts,
            params,
            adapters,
            on_output=lambda o: o.logits is None or logits.append(o.logits),
        )
        tokens += [o.token_ids for o in outs]
    return tokens, logits


def test_engine_on_cuda_matches_the_engine_on_cpu(demo_assets):
    """The engine on a GPU (Triton kernels, the batch moved to the device, sampling on the
    host) gives the CPU engine's tokens and logits."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tokens_cpu, logits_cpu = _mixed_run(_engine(demo_assets, "cpu", "torch"))
    tokens_cuda, logits_cuda = _mixed_run(_engine(demo_assets, "cuda", "triton"))
    assert tokens_cuda == tokens_cpu
    assert len(logits_cuda) == len(logits_cpu) > 0
    for a, b in zip(logits_cuda, logits_cpu, strict=True):
        assert a.device.type == "cpu"  # logits leave the replica on the host
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
