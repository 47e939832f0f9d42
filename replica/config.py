"""Engine settings (one replica). Operator-facing YAML configuration lives in cluster/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.memory.store_reads import ReadModel
from loraplex.replica.scheduling.scheduler import SchedulerConfig

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str  # Hugging Face checkpoint folder
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"  # auto: the checkpoint's
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    pool_bytes: int | None = (
        None  # the unified arena; None: 512 MiB on CPU, 90% of free memory on CUDA
    )
    page_bytes: int | None = None  # None: the smallest power of two >= 16 tokens of KV (>= 64 KiB)
    max_lora_rank: int = 128
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Adapter loads overlap the forward on a copy thread; eviction by Chameleon's score.
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(loading="thread"))
    seed: int = 0  # seeds requests that set no seed of their own
    kernels: Literal["auto", "torch", "triton"] = "auto"  # auto: $LORAPLEX_KERNELS, else by device
    tp: int = 1  # tensor-parallel degree: ranks (processes) this replica's model spans
    # tp workers: Ray actors in the replica's placement group, or local processes; auto:
    # Ray when running inside a placement group
    tp_launcher: Literal["auto", "process", "ray"] = "auto"
    # The artifact tier's read model (replica/memory/store_reads.py): reads of adapters
    # take at least latency + bytes / bandwidth. None: reads take what they take.
    artifact_read_bytes_per_s: float | None = None
    artifact_read_latency_s: float = 0.0

    def read_model(self) -> ReadModel | None:
        """The artifact read model, or None when reads are not paced."""
        if self.artifact_read_bytes_per_s is None and self.artifact_read_latency_s == 0:
            return None
        bandwidth = self.artifact_read_bytes_per_s or float("inf")
        return ReadModel(bandwidth, self.artifact_read_latency_s)

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be auto, torch or triton, got {self.kernels!r}")
        if self.tp_launcher not in ("auto", "process", "ray"):
            raise ValueError(f"tp_launcher must be auto, process or ray, got {self.tp_launcher!r}")
        if not 1 <= self.tp <= 64:
            raise ValueError(f"tp must be in [1, 64], got {self.tp}")
        if not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank must be in [1, 1024], got {self.max_lora_rank}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.artifact_read_bytes_per_s is not None and not self.artifact_read_bytes_per_s > 0:
            raise ValueError(
                f"artifact_read_bytes_per_s must be > 0, got {self.artifact_read_bytes_per_s}"
            )
        if not self.artifact_read_latency_s >= 0:
            raise ValueError(
                f"artifact_read_latency_s must be >= 0, got {self.artifact_read_latency_s}"
            )
        for name in ("pool_bytes", "page_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1024:
                raise ValueError(f"{name} must be >= 1024 bytes, got {value}")
