"""The engine's settings (one replica), each declared here once: slotted pydantic
dataclasses, validated on construction, with every field's bounds and one-line doc.

The engine, its scheduler and its adapter cache read them directly. Operators set them
through `EngineSettings` (replica/settings.py: the YAML config's `engine:` section and the
CLI flags), which copies these fields under its names and units; what crosses Ray is
`EngineConfig` as plain values (`plain_engine_config` / `build_engine_config`). Torch-free: the YAML config
and the CLI import this module."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, TypeAdapter, model_validator
from pydantic.dataclasses import dataclass

from loraplex.adapter_format import AdapterLimits
from loraplex.replica.memory.store_reads import ReadModel
from loraplex.settings import FORBID_EXTRA, KiB, setting

# The context window when max_model_len is unset: the model's positions, capped here.
MAX_MODEL_LEN_CAP = 8192

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
KvCacheDtype = Literal["auto", "bfloat16"]
Kernels = Literal["auto", "torch", "native", "triton"]
DenseGemm = Literal["auto", "onednn", "torch"]  # kernels/dense.py
SchedulerPolicy = Literal["fifo", "sjf", "chameleon"]
Eviction = Literal["chameleon", "lru", "gdsf", "equal"]
AdapterLoading = Literal["sync", "thread"]


@dataclass(frozen=True, slots=True, config=FORBID_EXTRA)
class ChameleonParams:
    """Chameleon's parameters (seed 004 §4.3; the paper's values)."""

    a: float = Field(0.4, ge=0, description="Weight of the input in a request's WRS.")
    b: float = Field(0.6, ge=0, description="Weight of the output in a request's WRS.")
    k_max: int = Field(4, ge=1, le=8, description="Most queues.")
    refresh_s: float = Field(300.0, gt=0, description="T_refresh: seconds between clusterings.")
    min_samples: int = Field(32, ge=1, description="Arrivals seen before the first clustering.")
    window: int = Field(
        4096, ge=1, description="Arrivals (and finished requests) a refresh looks at."
    )
    slo_s: float = Field(5.0, gt=0, description="The TTFT SLO the token quotas are set for.")
    max_bypass: int = Field(
        8, ge=0, description="A request no fit for its adapter is overtaken at most this often."
    )
    # Off by default, as in the paper. At the SLO it narrows the largest queue's tail to
    # about FIFO's: bench sched's engine target (loraplex's P99 TTFT against its
    # own FIFO, at 1.0 x FIFO's capacity) pooled -1.18 off and about -0.06 at the SLO
    # (0.350 s against FIFO's 0.331); on 2026-12-06, 15 draws in three runs, ahead of FIFO
    # in 13 by 0.9-7.8% and 0.6-2.7% behind in two (docs/scheduling.md); in the simulator,
    # Chameleon's P99 reduction against S-LoRA at the paper's high load -0.13 off, 0.15 at
    # the SLO (target 0.6), for 7% of its capacity, and loraplex's capacity against S-LoRA
    # 2.44 -> 2.17 (3 seeds; on 2026-12-06's tree 25.66 -> 22.76 req/s, FIFO's 23.05).
    starve_s: float | None = Field(
        None,
        gt=0,
        description="Waited this long: admitted first, over quota (a starvation guard not "
        "in the paper; it trades capacity and median TTFT for the tail); unset (default, "
        "as the paper): no guard.",
    )
    # A departure for the tail, off by default (bench sched reports it apart as
    # chameleon_p99): scaled with the others, the largest queue's quota falls below two of
    # its requests, it runs one at a time and its M/M/1 P99 sets Chameleon's.
    quota_percentile: float | None = Field(
        None,
        ge=0.5,
        lt=1.0,
        description="Size each queue's minimum quota for this percentile of its time in "
        "system (M/M/1), granting the minimums largest queue first when they exceed the "
        "pool (not in the paper); unset (default, as the paper): for the mean, scaled "
        "alike when over the pool.",
    )
    # A departure for the tail (queue_math._with_floors), off by default. At two, on bench
    # sched's engine at 1.0x FIFO's capacity (seeds 3, 4, one profile) loraplex's P99 TTFT
    # was 0.725 s against 0.731 s without it (FIFO 0.332 s): where the largest queue had a
    # request waiting, the batch's 16 sequence slots were full at 94% of the steps and its
    # quota bound at 6%. In the simulator it cut Chameleon's capacity against S-LoRA from
    # 1.116 to 0.981 (5 seeds; P99 reduction at the high load -0.13 -> 0.05).
    quota_floor_requests: int | None = Field(
        None,
        ge=1,
        le=16,
        description="Each queue's token quota holds at least this many of its largest "
        "requests, taken from the other queues in proportion to what they hold above "
        "theirs (not in the paper); unset: the paper's quotas.",
    )
    squash: bool = Field(
        True,
        description="Squash a bypasser (preempt it, to run right behind the request it "
        "overtook) once its leaving would let that blocked request run (seed 004 §4.3.3).",
    )
    # The paper charges each request its adapter's tokens; on S-LoRA's engine that charge
    # held Chameleon behind S-LoRA's FIFO (bench sched): running requests of one adapter
    # share its memory.
    share_adapter_tokens: bool = Field(
        True,
        description="Charge an adapter's tokens to a queue's quota once while any of its "
        "running requests use it, not once per request.",
    )


@dataclass(frozen=True, slots=True, config=FORBID_EXTRA)
class SchedulerConfig:
    """Batching and admission (each setting declared here once: the YAML config and the CLI
    show it through replica/settings.py)."""

    max_num_seqs: int = Field(32, ge=1, le=4096, description="Requests in one batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, le=1 << 20, description="Tokens computed in one engine step."
    )
    max_loras_per_batch: int = Field(
        32, ge=1, le=4096, description="Distinct adapters in one batch."
    )
    policy: SchedulerPolicy = Field(
        "fifo",
        description="Admission order: fifo; sjf (shortest predicted output first, aged); "
        "chameleon (multi-level queues with token quotas, seed 004).",
    )
    tenant_fairness: bool = Field(
        True,
        description="Share admission among tenants by the tokens each was served (a "
        "virtual token counter per tenant), the policy's order within each tenant: one "
        "tenant's queued flood does not delay another's requests.",
    )
    sjf_aging_tokens_per_s: float = Field(
        10.0, ge=0, description="SJF: a waiting request's priority improves this fast."
    )
    predictor_quantile: float = Field(
        0.5, gt=0, lt=1, description="Output lengths are predicted as this quantile."
    )
    chameleon: ChameleonParams = Field(
        default_factory=ChameleonParams, description="Chameleon's parameters."
    )


@dataclass(frozen=True, slots=True, config=FORBID_EXTRA)
class CacheConfig:
    """The adapter cache's settings (each declared here once: the YAML config and the CLI show
    them through replica/settings.py)."""

    eviction: Eviction = Field(
        "chameleon",
        description="Which idle adapter leaves the device pool first: Chameleon's score "
        "(frequency, recency, size), lru, gdsf or equal weights.",
    )
    loading: AdapterLoading = Field(
        "thread",
        description="thread: adapter copies into the pool overlap the forward (a copy "
        "stream on CUDA); sync: copied on the engine thread.",
    )
    keep_idle: bool = Field(
        True,
        description="Idle adapters stay in free pages; False: an adapter leaves the device "
        "with its last request (S-LoRA).",
    )
    low_watermark: float = Field(
        0.0, ge=0, le=1, description="Share of the pool a KV reclaim frees beyond its need."
    )
    high_watermark: float = Field(
        0.0, ge=0, le=1, description="Share of the pool prefetching leaves free."
    )
    prefetch: int = Field(
        0, ge=0, le=4096, description="Queued requests whose adapters are loaded ahead."
    )
    host_bytes: int | None = Field(
        None,
        ge=0,
        le=1 << 50,
        description="Host-tier budget for adapter weights; unset: every registered adapter "
        "stays in host memory (others are read again from the artifact store).",
    )
    half_life_s: float = Field(
        60.0, gt=0, description="An adapter's use count halves after this long unused."
    )

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> CacheConfig:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"watermarks out of order: low_watermark ({self.low_watermark:g}) must not "
                f"exceed high_watermark ({self.high_watermark:g})"
            )
        return self


@dataclass(frozen=True, slots=True, config=FORBID_EXTRA)
class ArtifactReadConfig:
    """How a replica's reads of adapters from the artifact store are paced
    (replica/memory/store_reads.py). Unset, reads take what the storage gives; set, they
    take at least latency + size / bandwidth, one read at a time per replica, as from a
    network store: for benchmarks and capacity planning on a machine whose local disk is
    far faster than the store the cluster will use."""

    read_bandwidth_mib_s: float | None = Field(
        None, gt=0, le=1e7, description="Store bandwidth one replica gets, MiB/s; unset: unpaced."
    )
    read_latency_ms: float = Field(
        0.0, ge=0, le=600_000, description="Latency of one read from the store, ms."
    )

    def read_model(self) -> ReadModel | None:
        """The read model, or None when reads are not paced."""
        if self.read_bandwidth_mib_s is None and self.read_latency_ms == 0:
            return None
        bandwidth = float("inf") if self.read_bandwidth_mib_s is None else self.read_bandwidth_mib_s
        return ReadModel(bandwidth * (1 << 20), self.read_latency_ms / 1e3)


@dataclass(frozen=True, slots=True, config=FORBID_EXTRA)
class EngineConfig:
    """One replica's engine."""

    model: str = Field(description="Hugging Face checkpoint folder or Llama-family .gguf file.")
    dtype: Dtype = Field(
        "auto", description="Weights and activations; auto keeps the checkpoint's dtype."
    )
    device: str = Field("cpu", min_length=1, description="torch device of rank 0.")
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="What the KV cache stores keys and values in: auto (the model's dtype) "
        "or bfloat16: under a float32 model half the bytes a token's KV takes, so the pool "
        "holds twice the context (docs/concepts.md); scores and softmax stay in float32, "
        "and outputs differ from a float32 cache's by bfloat16's rounding of K and V (8 "
        "bits of mantissa). A capacity option: on a CPU the step takes about as long.",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        le=1 << 20,
        description="Context window in tokens (prompt + output); unset: the model's "
        f"max_position_embeddings, capped at {MAX_MODEL_LEN_CAP}.",
    )
    pool_bytes: int | None = Field(
        None,
        ge=KiB,
        le=1 << 41,
        description="Unified paged pool (KV cache + adapters) per device; unset: 512 MiB on "
        "CPU, 90% of free memory on CUDA.",
    )
    page_bytes: int | None = Field(
        None,
        ge=KiB,
        le=1 << 26,
        description="Pool page size; unset: the smallest power of two holding 16 tokens of "
        "KV (at least 64 KiB). 2 MiB suits GPUs.",
    )
    max_lora_rank: int = setting(AdapterLimits, "max_lora_rank")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="Batching and admission."
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="The adapter cache.")
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="Seeds the sampling of requests that set no seed."
    )
    stream_events_per_s: float = Field(
        500.0,
        ge=0,
        description="Streamed chunks per second this replica sends, all streams together "
        "(0: one per step per stream). Past it, each stream's chunks are spaced by running "
        "streams / this and carry the tokens made meanwhile; a stream's first text and its end are "
        "never held. Every chunk costs CPU in the replica, the ingress and the HTTP proxy (~1.6 ms "
        "together on the demo's 2 cores), so an unbounded flood of streams takes the CPU "
        "another tenant's first token needs.",
    )
    stream_events_per_s_per_stream: float = Field(
        20.0,
        ge=0,
        description="Streamed chunks per second one stream gets at most (0: no cap), within "
        "stream_events_per_s: a chunk carries the tokens made since the last one, so a fast "
        "stream sends a few tokens every 50 ms instead of one per step. A reader sees no "
        "difference, and the relay's CPU no longer grows with a stream's speed.",
    )
    kernels: Kernels = Field(
        "auto",
        description="LoRA and attention kernels: auto (Triton on CUDA; on a CPU, LoRA's "
        "decode steps as compiled loops built on first use with the C compiler at hand, "
        "torch ops where none is; $LORAPLEX_KERNELS overrides), torch (torch ops only), "
        "native (the compiled loops; an error where they cannot be built) or triton.",
    )
    dense_gemm: DenseGemm = Field(
        "auto",
        description="The base model's GEMMs: auto (on a CPU, float32 or bfloat16 weights "
        "of at least 512 x 512 elements reordered once at load into oneDNN's layout, about "
        "twice F.linear's speed on a decode batch of an AMD EPYC; F.linear for smaller "
        "weights, elsewhere, or where this torch lacks the op), onednn (reorder every "
        "weight) or torch (F.linear). A tied LM head, reordered, is a copy beside the "
        "embedding: vocab x hidden more bytes.",
    )
    tp: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel degree: the ranks one replica's model spans (Ray actors "
        "in the replica's placement group, one bundle per rank packed on one node; local "
        "processes for `loraplex generate`).",
    )
    tp_launcher: Literal["auto", "process", "ray"] = Field(
        "auto",
        description="How tp workers start: Ray actors in the replica's placement group, or "
        "local processes; auto: Ray when running inside a placement group.",
    )
    artifacts: ArtifactReadConfig = Field(
        default_factory=ArtifactReadConfig,
        description="Reads of adapters from the artifact store (a read model; off by default).",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Keep full KV blocks after their requests end and start later requests "
        "with the same prefix (tokens, adapter version, tenant, cache salt) from them.",
    )
    share_base_prefix: bool = Field(
        False,
        description="Share cached base-model blocks across tenants (adapter blocks never "
        "are); off, a tenant's cached blocks serve only that tenant.",
    )
    prefix_cache_share: float | None = Field(
        None,
        ge=0,
        le=1,
        description="A static share of the pool for idle cached blocks instead of one "
        "eviction decision over cached blocks and idle adapters (a baseline: bench engine).",
    )


_PLAIN = TypeAdapter(EngineConfig)


def plain_engine_config(cfg: EngineConfig) -> dict[str, Any]:
    """EngineConfig as plain values (`scheduler` and `cache` as dicts): what crosses Ray."""
    return _PLAIN.dump_python(cfg)


def build_engine_config(values: dict[str, Any]) -> EngineConfig:
    """EngineConfig from `plain_engine_config`'s values; ValueError (a pydantic
    ValidationError) names each bad or unknown field."""
    return _PLAIN.validate_python(values)


def context_window(max_model_len: int | None, max_positions: int) -> int:
    """The context window of an engine: max_model_len if set, else the model's
    max_position_embeddings capped at MAX_MODEL_LEN_CAP."""
    return max_model_len if max_model_len is not None else min(max_positions, MAX_MODEL_LEN_CAP)


def checkpoint_max_positions(model: str | Path) -> int:
    """The max_position_embeddings of checkpoint `model` (a Hugging Face folder or a .gguf
    file), read without torch through the one shape reader."""
    from loraplex.model_shape import read_model_shape

    return read_model_shape(model).max_position_embeddings
