"""Cost models for the simulator: how long an engine step takes, and what the device holds.

`RooflineProfile` is a stated GPU: a step costs a fixed overhead plus the larger of its
memory time (base weights, the KV the decode rows read, the adapters' weights) and its
base compute time, plus the LoRA compute, which S-LoRA-style kernels run far below peak.
`LinearProfile` is fitted to steps of the real engine on this machine (least squares).
Both answer `step_time(StepLoad)`; adapter loads cost setup + bytes / link bandwidth, the
link shared by concurrent loads (benchmarks/sim/replica.py `SimLink`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loraplex.replica.model.config import ModelConfig

LLAMA_7B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class StepLoad:
    tokens: int  # computed this step (prefill chunks + one per decode row)
    context: int  # KV tokens the step's rows attend over
    token_rank: int  # sum over the step's tokens of their adapter's rank
    adapter_bytes: int  # weight bytes of the distinct adapters in the step
    adapters: int = 0  # distinct adapters in the step: a LoRA segment each
    rows: int = 0  # sequences in the step (a prefill chunk or a decode row each)


@dataclass(frozen=True, slots=True)
class RooflineProfile:
    name: str
    source: str
    model: dict
    pool_bytes: int  # the unified pool: device memory less weights and workspace
    page_bytes: int
    link_bytes_per_s: float
    load_setup_s: float
    step_overhead_s: float
    weight_bytes: float
    mem_bytes_per_s: float
    flops_per_s: float
    lora_flops_per_s: float
    adapter_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    _kv_token_bytes: int = field(init=False, default=0)
    _lora_flops_per_rank: int = field(init=False, default=0)

    def __post_init__(self):
        # step_time runs once per simulated step: derive the per-token constants once
        object.__setattr__(self, "_kv_token_bytes", self.kv_bytes_per_token())
        # LoRA flops per token and unit of rank: 2 per weight element = its fp16 bytes
        object.__setattr__(self, "_lora_flops_per_rank", self.adapter_bytes(1))

    def kv_bytes_per_token(self) -> int:
        return ModelConfig.from_dict(self.model).kv_elems_per_token() * 2

    def adapter_bytes(self, rank: int) -> int:
        """fp16 A [r, in] and B [out, r] for every target of every layer."""
        cfg = ModelConfig.from_dict(self.model)
        shapes = cfg.projection_shapes()
        per_layer = sum(rank * sum(shapes[t]) for t in self.adapter_targets)
        return 2 * cfg.num_layers * per_layer

    def step_time(self, load: StepLoad) -> float:
        params = self.weight_bytes / 2
        memory = (
            self.weight_bytes + load.context * self._kv_token_bytes + load.adapter_bytes
        ) / self.mem_bytes_per_s
        compute = 2 * params * load.tokens / self.flops_per_s
        lora = load.token_rank * self._lora_flops_per_rank / self.lora_flops_per_s
        return self.step_overhead_s + max(memory, compute) + lora


def a40_llama7b() -> RooflineProfile:
    """The paper's testbed (seed 004 §5.1): NVIDIA A40 48 GB, Llama-7B fp16, adapters on
    q/k/v/o (rank 32 = 64 MiB, as the paper states). Numbers and where they come from:
    - memory 696 GB/s and fp16 tensor 149.7 TFLOPS dense: the A40 datasheet; we assume
      80% of the bandwidth and 50% of the FLOPS are achieved in the base model's GEMMs.
    - LoRA compute at 1% of peak: fitted to the paper's Figure 2 breakdown (rank 128:
      loading 17.5% and adapter load + compute ~60% of an unloaded request's TTFT), which
      reflects S-LoRA's MBGMM kernels; loraplex's own kernels are not modelled here.
    - link 25 GB/s with 0.5 ms per load: PCIe 4.0 x16 (32 GB/s) at ~80% from pinned memory;
      rank 128 (256 MiB) then loads in ~11 ms, rank 8 in ~1.2 ms (the paper's Figure 14:
      up to 30 ms under contention, 6 ms with its cache).
    - pool: 48 GiB − 13.5 GB of weights − 2.5 GiB workspace; 2 MiB pages (seed 002)."""
    weights = 6.74e9 * 2
    return RooflineProfile(
        name="a40-llama7b",
        source="A40 datasheet (696 GB/s, 149.7 TFLOPS fp16) at 80%/50%; LoRA kernels at 1% "
        "of peak fitted to seed 004 Fig. 2; PCIe 4.0 x16 at 25 GB/s + 0.5 ms per load",
        model=LLAMA_7B,
        pool_bytes=int(48 * GiB - weights - 2.5 * GiB),
        page_bytes=2 * MiB,
        link_bytes_per_s=25e9,
        load_setup_s=0.5e-3,
        step_overhead_s=2e-3,
        weight_bytes=weights,
        mem_bytes_per_s=0.8 * 696e9,
        flops_per_s=0.5 * 149.7e12,
        lora_flops_per_s=0.01 * 149.7e12,
    )


LLAMA_13B = {
    **LLAMA_7B,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
}
# Parameters: Llama 2 paper (Touvron et al. 2023, Table 1 and the model cards): 6.74e9 and
# 13.0e9; shapes from the Hugging Face configs of meta-llama/Llama-2-{7b,13b}-hf.
LLAMA_MODELS = {"llama2-7b": (LLAMA_7B, 6.74e9), "llama2-13b": (LLAMA_13B, 13.0e9)}


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    memory_bytes: float
    mem_bytes_per_s: float  # HBM, datasheet
    fp16_flops_per_s: float  # dense tensor-core FP16, datasheet (no sparsity)
    host_link_bytes_per_s: float  # pinned host -> device, achieved
    source: str


GPUS = {
    "h100": GPU(
        "H100 SXM5 80GB",
        80 * GiB,
        3.35e12,
        989.4e12,
        50e9,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3 at 3.35 TB/s, 989.4 TFLOPS "
        "FP16 dense); host link PCIe Gen5 x16 (64 GB/s) at ~80% for pinned copies",
    ),
    "a100": GPU(
        "A100 SXM4 80GB",
        80 * GiB,
        2.039e12,
        312e12,
        25e9,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: HBM2e at 2,039 GB/s, 312 TFLOPS "
        "FP16 dense); host link PCIe Gen4 x16 (32 GB/s) at ~80% for pinned copies",
    ),
}


def gpu_profile(gpu: str, model: str) -> RooflineProfile:
    """A Llama 2 model on a data-centre GPU, fp16, adapters on q/k/v/o. The same method as
    `a40_llama7b` (whose constants are fitted to seed 004): 80% of the HBM bandwidth and
    50% of the dense FP16 tensor FLOPS achieved in the base GEMMs; LoRA compute at 1% of
    peak (S-LoRA-class kernels, seed 004 Fig. 2); 0.5 ms set-up per adapter copy; 2 ms of
    per-step overhead; the pool is the memory less the weights and 4 GiB of activations
    and workspace; 2 MiB pages. `gpu`: h100 or a100 (GPUS has each source); `model`:
    llama2-7b or llama2-13b."""
    card = GPUS[gpu]
    config, params = LLAMA_MODELS[model]
    weights = params * 2
    return RooflineProfile(
        name=f"{gpu}-{model}",
        source=f"{card.source}; {model}: {params / 1e9:.2f}B parameters (Llama 2 paper); "
        "80%/50% of bandwidth/FLOPS, LoRA at 1% of peak as the A40 profile (seed 004 Fig. 2)",
        model=config,
        pool_bytes=int(card.memory_bytes - weights - 4 * GiB),
        page_bytes=2 * MiB,
        link_bytes_per_s=card.host_link_bytes_per_s,
        load_setup_s=0.5e-3,
        step_overhead_s=2e-3,
        weight_bytes=weights,
        mem_bytes_per_s=0.8 * card.mem_bytes_per_s,
        flops_per_s=0.5 * card.fp16_flops_per_s,
        lora_flops_per_s=0.01 * card.fp16_flops_per_s,
    )


@dataclass(frozen=True, slots=True)
class LinearProfile:
    """step = c0 + c_tokens·tokens + c_context·context + c_lora·token_rank
    + c_adapter·adapters + c_row·rows, fitted."""

    name: str
    source: str
    model: dict
    pool_bytes: int
    page_bytes: int
    link_bytes_per_s: float
    load_setup_s: float
    coef: tuple[float, float, float, float, float, float]
    adapter_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    fit_r2: float = field(default=0.0)

    def kv_bytes_per_token(self) -> int:
        cfg = ModelConfig.from_dict(self.model)
        return cfg.kv_elems_per_token() * (4 if self.model.get("torch_dtype") == "float32" else 2)

    def step_time(self, load: StepLoad) -> float:
        c0, ct, cc, cl, ca, cr = self.coef
        varying = ct * load.tokens + cc * load.context + cl * load.token_rank
        varying += ca * load.adapters + cr * load.rows
        return max(c0, c0 + varying)


def fit_linear(
    samples: list[tuple[StepLoad, float]],
) -> tuple[tuple[float, float, float, float, float, float], float]:
    """Least squares of step seconds on (1, tokens, context, token_rank, adapters, rows):
    a decode row costs more than a prompt token of a prefill chunk (sampling, its own
    attention), and each adapter in the step adds a segment to every LoRA op. Negative
    coefficients (noise) are dropped and the rest refitted; steps slowed by other
    processes (residual above 3x the median absolute residual) are trimmed once. Returns
    the coefficients and R² on the kept steps."""
    x = np.array([[1.0, s.tokens, s.context, s.token_rank, s.adapters, s.rows] for s, _ in samples])
    y = np.array([t for _, t in samples])
    full = _fit(x, y)
    resid = y - x @ full
    keep = resid <= 3 * np.median(np.abs(resid)) + 1e-12
    x, y = x[keep], y[keep]
    full = _fit(x, y)
    pred = x @ full
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-30)
    c0, ct, cc, cl, ca, cr = (float(c) for c in full)
    return (c0, ct, cc, cl, ca, cr), r2


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    cols = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        negative = [k for k, c in zip(cols, coef, strict=True) if c < 0 and k != 0]
        if not negative:
            break
        cols = [k for k in cols if k not in negative]
    full = np.zeros(x.shape[1])
    full[cols] = coef
    return full
