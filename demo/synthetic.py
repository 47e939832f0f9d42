"""The synthetic model: a small Llama checkpoint in Hugging Face layout with random weights
(seeded), and PEFT LoRA adapters whose B matrices are random (not PEFT's zeros), so every
adapter visibly changes greedy output. Fast unit tests and benchmarks use it; the demo
serves a real model (`assets.py`). Same code and library versions -> same bytes."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.checkpoint_shape import ModelShape, Projection, projection_shapes
from loraplex.demo.assets import DemoAssets
from loraplex.demo.synthetic_tokenizer import (
    BOS_TOKEN,
    EOT_TOKEN,
    special_token_ids,
    write_json,
    write_tokenizer,
)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = LORA_TARGETS[:4]
MLP_TARGETS = LORA_TARGETS[4:]

# Each adapter's delta (scale * B @ A @ x) is drawn to be this fraction of the base projection's
# output, whatever its rank, alpha or rsLoRA setting: large enough to move a greedy argmax within
# a few tokens, small enough to keep logits in the same range as the base model's.
LORA_DELTA_RATIO = 0.5

_SAFETENSORS_METADATA = {"format": "pt"}
_SEED = 0


def _llama3_rope_scaling() -> dict:
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a Llama checkpoint, plus how its random weights are drawn.

    Linear weights ~ N(0, weight_gain^2 / fan_in); embeddings ~ N(0, embed_std^2); RMSNorm
    weights ~ 1 + N(0, norm_jitter^2), so a reader that ignores norm weights is caught (a tied
    model's final norm is scaled down, see _checkpoint_params). rope_scaling is left out of the
    hash so the spec stays hashable.
    """

    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default_factory=_llama3_rope_scaling, hash=False)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    embed_std: float = 1.0
    weight_gain: float = 1.0
    norm_jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must divide by num_attention_heads "
                f"({self.num_attention_heads}) unless head_dim is given"
            )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def shape(self) -> ModelShape:
        """The shape of the fp32 checkpoint `write_checkpoint` writes for this spec, read by
        the one reader of config.json. Needs `vocab_size`: without it the vocab is the
        tokenizer's, known once written (read that checkpoint with `read_model_shape`)."""
        if self.vocab_size is None:
            raise ValueError("ModelSpec.shape needs vocab_size (else it is the tokenizer's)")
        vocab = self.vocab_size
        raw = _model_config(self, vocab, special_token_ids(vocab), torch.float32)
        return ModelShape.from_config_dict(raw)

    def projection_shapes(self) -> dict[str, Projection]:
        """Each projection of one decoder layer (whatever the vocab)."""
        return projection_shapes(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.resolved_head_dim,
        )


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"adapter {self.name!r}: rank must be >= 1, got {self.rank}")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown or not self.targets:
            raise ValueError(
                f"adapter {self.name!r}: targets must be a non-empty subset of {LORA_TARGETS}, "
                f"got {self.targets}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


SYNTHETIC_MODEL = ModelSpec()

SYNTHETIC_ADAPTERS = (
    AdapterSpec("sql-r8", rank=8, alpha=16.0, targets=("q_proj", "v_proj"), seed=101),
    AdapterSpec("chat-r16", rank=16, alpha=32.0, targets=LORA_TARGETS, seed=102),
    AdapterSpec("code-r32", rank=32, alpha=16.0, targets=ATTENTION_TARGETS, seed=103),
    AdapterSpec("math-r64", rank=64, alpha=128.0, targets=MLP_TARGETS, seed=104),
    AdapterSpec("legal-r8", rank=8, alpha=8.0, targets=("o_proj", "down_proj"), seed=105),
    AdapterSpec(
        "med-r16-rslora", rank=16, alpha=4.0, targets=LORA_TARGETS, seed=106, use_rslora=True
    ),
    AdapterSpec(
        "poetry-r24", rank=24, alpha=48.0, targets=("q_proj", "v_proj", "up_proj"), seed=107
    ),
    AdapterSpec(
        "support-r12", rank=12, alpha=24.0, targets=("k_proj", "v_proj", "gate_proj"), seed=108
    ),
    AdapterSpec("summary-r48", rank=48, alpha=96.0, targets=MLP_TARGETS, seed=109),
    AdapterSpec("translate-r64", rank=64, alpha=32.0, targets=LORA_TARGETS, seed=110),
)


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    mean: float
    std: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def write_checkpoint(
    out_dir: Path,
    spec: ModelSpec,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 1,
    with_tokenizer: bool = True,
) -> None:
    """Write config.json and safetensors weights (sharded with an index when num_shards > 1),
    and the tokenizer unless with_tokenizer is False. Weights depend only on spec and seed:
    the dtype is a cast of the fp32 draw and sharding only splits the same tensors."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, special_ids = _resolve_vocab(out_dir, spec, with_tokenizer)
    write_json(out_dir / "config.json", _model_config(spec, vocab_size, special_ids, dtype))
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    params = _checkpoint_params(spec, vocab_size)
    generator = torch.Generator().manual_seed(seed)
    shards = _split_shards(params, num_shards)
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        filename = (
            "model.safetensors"
            if num_shards == 1
            else f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        )
        tensors = {p.name: _draw(p, generator).to(dtype) for p in shard}
        save_file(tensors, str(out_dir / filename), metadata=_SAFETENSORS_METADATA)
        weight_map.update(dict.fromkeys(tensors, filename))
    if num_shards > 1:
        total_size = sum(p.numel for p in params) * dtype.itemsize
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        write_json(out_dir / "model.safetensors.index.json", index)


def _resolve_vocab(
    out_dir: Path, spec: ModelSpec, with_tokenizer: bool
) -> tuple[int, dict[str, int]]:
    if not with_tokenizer:
        if spec.vocab_size is None:
            raise ValueError("with_tokenizer=False needs spec.vocab_size to be set")
        return spec.vocab_size, special_token_ids(spec.vocab_size)
    tokenizer_vocab = write_tokenizer(out_dir, model_max_length=spec.max_position_embeddings)
    vocab_size = spec.vocab_size or tokenizer_vocab
    if vocab_size < tokenizer_vocab:
        raise ValueError(
            f"spec.vocab_size ({vocab_size}) is smaller than the tokenizer's vocab "
            f"({tokenizer_vocab}); use None or a value >= {tokenizer_vocab}"
        )
    return vocab_size, special_token_ids(tokenizer_vocab)


def _model_config(
    spec: ModelSpec, vocab_size: int, special_ids: dict[str, int], dtype: torch.dtype
) -> dict:
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.resolved_head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOT_TOKEN],
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def _checkpoint_params(spec: ModelSpec, vocab_size: int) -> list[_Param]:
    """Every tensor in draw order; lm_head comes last so tying does not shift the others.

    A tied lm_head is the embedding (std embed_std, not weight_gain/sqrt(hidden)), so the final
    norm is scaled down to keep the logits of tied and untied models on the same scale.
    """
    h, gain = spec.hidden_size, spec.weight_gain
    norm_scale = gain / (spec.embed_std * math.sqrt(h)) if spec.tie_word_embeddings else 1.0
    params = [_Param("model.embed_tokens.weight", (vocab_size, h), 0.0, spec.embed_std)]
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params.append(_Param(f"{prefix}.{norm}.weight", (h,), 1.0, spec.norm_jitter))
        for module, (out_features, in_features) in spec.projection_shapes().items():
            name = f"{prefix}.{_module_path(module)}.weight"
            params.append(
                _Param(name, (out_features, in_features), 0.0, gain / math.sqrt(in_features))
            )
    params.append(_Param("model.norm.weight", (h,), norm_scale, spec.norm_jitter * norm_scale))
    if not spec.tie_word_embeddings:
        params.append(_Param("lm_head.weight", (vocab_size, h), 0.0, gain / math.sqrt(h)))
    return params


def _module_path(module: str) -> str:
    return f"self_attn.{module}" if module in ATTENTION_TARGETS else f"mlp.{module}"


def _draw(param: _Param, generator: torch.Generator) -> torch.Tensor:
    return param.mean + param.std * torch.randn(param.shape, generator=generator)


def _split_shards(params: list[_Param], num_shards: int) -> list[list[_Param]]:
    """Contiguous, non-empty groups of roughly equal byte size."""
    if not 1 <= num_shards <= len(params):
        raise ValueError(f"num_shards must be in 1..{len(params)}, got {num_shards}")
    ends = list(itertools.accumulate(p.numel for p in params))
    cuts = [0]
    for k in range(1, num_shards):
        balanced = bisect.bisect_left(ends, k * ends[-1] / num_shards) + 1
        cuts.append(min(max(balanced, cuts[-1] + 1), len(params) - (num_shards - k)))
    cuts.append(len(params))
    return [params[start:end] for start, end in itertools.pairwise(cuts)]


def write_adapter(
    out_dir: Path,
    spec: ModelSpec,
    adapter: AdapterSpec,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
) -> None:
    """Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for `spec`.

    A ~ N(0, 1/in); B ~ N(0, sigma^2) with sigma chosen so that scaling * B @ A @ x is about
    LORA_DELTA_RATIO times the base projection's output. vocab_size is accepted for callers
    that pass the resolved vocab along; LoRA on the seven projections never depends on it.
    """
    del vocab_size
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "adapter_config.json", _adapter_config(adapter))
    save_file(
        {name: t.to(dtype) for name, t in _adapter_tensors(spec, adapter)},
        str(out_dir / "adapter_model.safetensors"),
        metadata=_SAFETENSORS_METADATA,
    )


def _adapter_tensors(spec: ModelSpec, adapter: AdapterSpec) -> Iterable[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(adapter.seed)
    b_std = LORA_DELTA_RATIO * spec.weight_gain / (adapter.scaling * math.sqrt(adapter.rank))
    shapes = spec.projection_shapes()
    for layer in range(spec.num_hidden_layers):
        for module in (m for m in LORA_TARGETS if m in adapter.targets):
            out_features, in_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_module_path(module)}"
            a = torch.randn((adapter.rank, in_features), generator=generator)
            b = torch.randn((out_features, adapter.rank), generator=generator)
            yield f"{prefix}.lora_A.weight", a / math.sqrt(in_features)
            yield f"{prefix}.lora_B.weight", b * b_std


def _adapter_config(adapter: AdapterSpec) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "loraplex-demo-llama",
        "revision": None,
        "inference_mode": True,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": [m for m in LORA_TARGETS if m in adapter.targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": adapter.use_rslora,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def make_synthetic_assets(
    dest: Path, *, progress: Callable[[str], None] | None = None
) -> DemoAssets:
    """dest/model/ (checkpoint + tokenizer) and dest/adapters/<name>/ for SYNTHETIC_ADAPTERS,
    overwriting what is there."""
    report = progress or (lambda _message: None)
    model_dir, adapters_dir = dest / "model", dest / "adapters"
    report(f"writing base model to {model_dir}")
    write_checkpoint(model_dir, SYNTHETIC_MODEL, seed=_SEED)
    for adapter in SYNTHETIC_ADAPTERS:
        report(f"writing adapter {adapter.name} (rank {adapter.rank}) to {adapters_dir}")
        write_adapter(adapters_dir / adapter.name, SYNTHETIC_MODEL, adapter)
    return DemoAssets(model_dir, adapters_dir, tuple(a.name for a in SYNTHETIC_ADAPTERS))
