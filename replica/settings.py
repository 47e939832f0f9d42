"""The engine as operators set it: the YAML config's `engine:` section and the flags of
`loraplex generate`.

Every field but `device` is an engine setting of replica/config.py, copied (default, bounds,
doc) under the name and unit operators use: sizes in MiB (`pool_mib`, `host_mib`) and KiB
(`page_kib`) where the engine counts bytes. `engine_config` is the one conversion.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loraplex.replica.config import (
    AdapterLoading,
    CacheConfig,
    DenseGemm,
    Dtype,
    EngineConfig,
    Eviction,
    Kernels,
    KvCacheDtype,
    SchedulerConfig,
    SchedulerPolicy,
)
from loraplex.settings import KiB, MiB, describe, setting


class EngineSettings(BaseModel):
    """One replica's engine (replica/config.py EngineConfig, scheduler and cache included)."""

    model_config = ConfigDict(extra="forbid")

    dtype: Dtype = setting(EngineConfig, "dtype")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="auto: cuda when the replica holds a GPU (replicas.num_gpus > 0; for "
        "`loraplex generate`, when torch sees one), else cpu.",
    )
    kv_cache_dtype: KvCacheDtype = setting(EngineConfig, "kv_cache_dtype")
    max_model_len: int | None = setting(EngineConfig, "max_model_len")
    pool_mib: int | None = setting(EngineConfig, "pool_bytes", unit=MiB)
    page_kib: int | None = setting(EngineConfig, "page_bytes", unit=KiB)
    max_lora_rank: int = setting(EngineConfig, "max_lora_rank")
    max_num_seqs: int = setting(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = setting(SchedulerConfig, "max_num_batched_tokens")
    max_loras_per_batch: int = setting(SchedulerConfig, "max_loras_per_batch")
    seed: int = setting(EngineConfig, "seed")
    scheduler_policy: SchedulerPolicy = setting(SchedulerConfig, "policy")
    tenant_fairness: bool = setting(SchedulerConfig, "tenant_fairness")
    eviction: Eviction = setting(CacheConfig, "eviction")
    adapter_loading: AdapterLoading = setting(CacheConfig, "loading")
    prefetch: int = setting(CacheConfig, "prefetch")
    low_watermark: float = setting(CacheConfig, "low_watermark")
    high_watermark: float = setting(CacheConfig, "high_watermark")
    host_mib: int | None = setting(CacheConfig, "host_bytes", unit=MiB)
    kernels: Kernels = setting(EngineConfig, "kernels")
    dense_gemm: DenseGemm = setting(EngineConfig, "dense_gemm")
    stream_events_per_s: float = setting(EngineConfig, "stream_events_per_s")
    stream_events_per_s_per_stream: float = setting(EngineConfig, "stream_events_per_s_per_stream")
    enable_prefix_caching: bool = setting(EngineConfig, "enable_prefix_caching")
    share_base_prefix: bool = setting(EngineConfig, "share_base_prefix")

    @model_validator(mode="after")
    def _cache_accepts(self) -> EngineSettings:
        try:
            self.cache_config()
        except ValidationError as e:  # the cache's checks across fields (watermarks)
            raise ValueError(describe(e).removeprefix("config: ")) from None
        return self

    def engine_config(self, model: str, *, device: str, **more: Any) -> EngineConfig:
        """The EngineConfig these settings make, for checkpoint folder `model` on `device`
        (`resolve_device` turns `auto` into one), with `more` EngineConfig fields (`tp`)."""
        return EngineConfig(
            model=model,
            dtype=self.dtype,
            device=device,
            kv_cache_dtype=self.kv_cache_dtype,
            max_model_len=self.max_model_len,
            pool_bytes=None if self.pool_mib is None else self.pool_mib * MiB,
            page_bytes=None if self.page_kib is None else self.page_kib * KiB,
            max_lora_rank=self.max_lora_rank,
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_loras_per_batch=self.max_loras_per_batch,
                policy=self.scheduler_policy,
                tenant_fairness=self.tenant_fairness,
            ),
            cache=self.cache_config(),
            seed=self.seed,
            kernels=self.kernels,
            dense_gemm=self.dense_gemm,
            enable_prefix_caching=self.enable_prefix_caching,
            share_base_prefix=self.share_base_prefix,
            stream_events_per_s=self.stream_events_per_s,
            stream_events_per_s_per_stream=self.stream_events_per_s_per_stream,
            **more,
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            eviction=self.eviction,
            loading=self.adapter_loading,
            prefetch=self.prefetch,
            low_watermark=self.low_watermark,
            high_watermark=self.high_watermark,
            host_bytes=None if self.host_mib is None else self.host_mib * MiB,
        )

    def resolve_device(self, has_gpu: bool) -> str:
        """The torch device: `device`, with auto decided by whether a GPU is at hand."""
        if self.device != "auto":
            return self.device
        return "cuda" if has_gpu else "cpu"
