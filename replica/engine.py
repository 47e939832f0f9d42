"""The engine of one replica: `LLMEngine`, the synchronous core. Add requests; `step()` runs
one iteration (schedule → forward → sample) and returns what each request produced.
replica/async_engine.py's `Engine` runs that loop on its own thread for servers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loraplex.kernels.backend import make_backend, resolve_kernels
from loraplex.replica.batch import build_step_batch
from loraplex.replica.config import EngineConfig, context_window
from loraplex.replica.detokenizer import IncrementalDetokenizer, find_stop, streamable_end
from loraplex.replica.memory.adapter_cache import AdapterCache, UnknownAdapter
from loraplex.replica.memory.adapters import (
    AdapterError,
    AdapterWeights,
    load_adapter,
    plan_layout,
    tensors_digest,
)
from loraplex.replica.memory.eviction import RestoreCosts
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.memory.pool import UnifiedPool
from loraplex.replica.memory.prefix_cache import PrefixCache
from loraplex.replica.memory.store_reads import ReadPacer
from loraplex.replica.model.config import DTYPES, ModelConfig
from loraplex.replica.model.llama import ForwardOps, LlamaModel
from loraplex.replica.model.loader import load_weights
from loraplex.replica.sampling import SamplingParams, greedy_tokens, sample_token
from loraplex.replica.scheduling.scheduler import Scheduler
from loraplex.replica.sequence import Continuation, RequestOutput, Sequence, TokensSoFar
from loraplex.replica.step_costs import StepCostEstimator, step_rows
from loraplex.replica.tokenizer import Tokenizer
from loraplex.settings import MiB

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as given; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    rank: int
    targets: tuple[str, ...]
    host_bytes: int
    pool_pages: int
    version: str | None  # the weights' content digest: cached KV blocks are keyed by it


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        device = torch.device(cfg.device)
        dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
        self.model_config = mc = ModelConfig.from_pretrained(Path(cfg.model), dtype)
        self.max_model_len = context_window(cfg.max_model_len, mc.max_position_embeddings)
        self.tp = None
        if cfg.tp > 1:  # this process is rank 0: its model, pool and KV hold its share
            from loraplex.replica.parallel.group import TensorParallelGroup

            self.tp = TensorParallelGroup(cfg, self.max_model_len, cfg.tp_launcher)
            self.model, mc = self.tp.model, self.tp.plan.rank_config
        else:
            self.model = LlamaModel(
                mc, load_weights(Path(cfg.model), mc, device), self.max_model_len, cfg.dense_gemm
            )
        self.tokenizer = Tokenizer(cfg.model) if Tokenizer.exists(cfg.model) else None
        elem = mc.dtype.itemsize
        kv_dtype = mc.dtype if cfg.kv_cache_dtype == "auto" else DTYPES[cfg.kv_cache_dtype]
        kv_elem = kv_dtype.itemsize
        page_bytes = cfg.page_bytes or _auto_page_bytes(
            mc.kv_elems_per_token() * kv_elem, mc.kv_size * kv_elem, elem
        )
        pool_bytes = cfg.pool_bytes or _auto_pool_bytes(device)
        self.pool = UnifiedPool(pool_bytes // page_bytes, page_bytes // elem, mc.dtype, device)
        self.kv = KVCache(self.pool, mc, kv_dtype)
        self.step_costs = StepCostEstimator()  # what the router and the eviction weigh
        if cfg.enable_prefix_caching:
            self.kv.prefix = PrefixCache(
                self.pool,
                self.kv.block_size,
                half_life_s=cfg.cache.half_life_s,
                share_base=cfg.share_base_prefix,
                share=cfg.prefix_cache_share,
            )
        self.adapters = AdapterCache(
            self.pool,
            mc,
            self.model.output_columns,
            config=cfg.cache,
            blocks=self.kv.prefix,
            restore_costs=self.restore_costs if self.kv.prefix is not None else None,
        )
        self.kernels = resolve_kernels(cfg.kernels, device)
        sched = cfg.scheduler
        layout_args = (cfg.max_lora_rank, sched.max_num_seqs, sched.max_num_batched_tokens)
        backend = make_backend(self.kernels, self.model.lora_layout(*layout_args), self.pool.arena)
        self.model.ops = (
            ForwardOps(backend)
            if self.tp is None
            else self.tp.connect(backend, self.pool, self.kv.dtype, self.adapters, layout_args)
        )
        self.scheduler = Scheduler(cfg.scheduler, self.kv, self.adapters, self.max_model_len)
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._seeds = random.Random(cfg.seed)  # for requests that bring no seed
        model = cfg.artifacts.read_model()
        self.read_pacer = None if model is None else ReadPacer(model)
        self.prompt_tokens = 0  # of the requests added
        self.prompt_tokens_computed = 0  # prompt positions computed (cache hits are not)
        self.steps = 0  # forward passes run, and the seconds they took (an engine's busy time)
        self.step_seconds = 0.0

    # adapters

    def add_adapter(self, name: str, path: Path, version: str | None = None) -> AdapterInfo:
        return self.register_adapter(self.read_adapter(name, path), path, version)

    def read_adapter(self, name: str, path: Path) -> AdapterWeights:
        """Read and validate; touches no engine state (safe off the engine thread). Its
        version is the digest of its files as read. With an artifact read model the read
        lasts at least what the model says."""
        started = time.monotonic()
        weights = load_adapter(Path(path), name, self.model_config, self.cfg.max_lora_rank)
        if self.read_pacer is not None:
            self.read_pacer.pace(weights.nbytes, started)
        pages = self._pages_for(weights if self.tp is None else self.tp.shard(weights))
        if pages > self.pool.num_pages // 2:
            raise AdapterError(
                f"adapter {name!r} needs {pages} pages; at most half the pool "
                f"({self.pool.num_pages // 2} pages) may hold one adapter"
            )
        return weights.pin_memory() if self.pool.arena.is_cuda else weights

    def register_adapter(
        self, weights: AdapterWeights, path: Path | None = None, version: str | None = None
    ) -> AdapterInfo:
        """`path`: where to read it again if the host-tier budget drops its host copy.
        `version` (a content digest; the registry's) identifies the weights for the prefix
        cache; by default the one `read_adapter` computed, or a digest of the tensors."""
        digest = weights.version  # of the files as read, when read from files
        version = version or digest or tensors_digest(weights)
        weights = dataclasses.replace(weights, version=version)
        read = None
        if path is not None:
            read = functools.partial(self._reread, weights.name, path, version, digest)
        if self.tp is not None:  # every rank keeps its shard in its host tier
            weights = self.tp.add_adapter(weights)
        self.adapters.add(weights, read)
        return AdapterInfo(
            weights.name,
            weights.rank,
            weights.targets,
            weights.nbytes,
            self._pages_for(weights),
            version,
        )

    def _reread(self, name: str, path: Path, version: str, digest: str | None) -> AdapterWeights:
        """The host copy the cache dropped, read again: rank 0's shard under tp. Other
        content found there is refused: cached KV blocks are keyed by the version
        registered, so the weights must be the ones registered."""
        weights = self.read_adapter(name, path)
        if digest is not None and weights.version != digest:
            raise AdapterError(
                f"adapter {name!r} changed at {path} since it was registered; register it again"
            )
        weights = dataclasses.replace(weights, version=version)
        return weights if self.tp is None else self.tp.shard(weights)

    def _pages_for(self, weights: AdapterWeights) -> int:
        return plan_layout(weights, self.pool.page_elems, self.model_config.num_layers)[0].num_pages

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter. Running requests that hold it finish; queued ones are
        aborted (their final output, reason "abort", comes with the next step)."""
        self.adapters.remove(name)
        if self.tp is not None:
            self.tp.remove_adapter(name)
        for seq in [s for s in self.scheduler.waiting if s.adapter == name]:
            self.scheduler.finish(seq, "abort")
            self.requests.pop(seq.request_id, None)
            self._pending.append(_final(seq))

    # requests

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
        arrival: float = 0.0,
        continuation: Continuation | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Queue a request; `continuation`: it resumes after output it produced elsewhere.
        `tenant`: the scheduler shares admission fairly among tenants (None is one of its
        own). `tenant` and `cache_salt` also salt the request's cached KV blocks: only
        requests of the same tenant (or, with share_base_prefix, any tenant's base-model
        requests) and the same cache_salt share them."""
        ids = self.encode(prompt)
        self._check(ids, params, adapter)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(request_id, ids, params, adapter, arrival, torch.Generator(), seed=seed)
        seq.tenant, seq.cache_salt = tenant, cache_salt
        if continuation is not None:
            self._check_continuation(continuation, params)
            seq.output_ids, seq.text = list(continuation.token_ids), continuation.text
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer.of(self.tokenizer, seq.output_ids)
        self.requests[request_id] = seq
        self.prompt_tokens += len(ids)
        self.scheduler.add(seq)
        return seq

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; send prompt_token_ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _check(self, ids: list[int], params: SamplingParams, adapter: str | None) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt of {len(ids)} tokens plus max_tokens {params.max_tokens} exceeds the "
                f"context window of {self.max_model_len} tokens"
            )
        if adapter is not None and adapter not in self.adapters:
            raise UnknownAdapter(adapter)
        kv_pages = self.kv.blocks_for(len(ids) + params.max_tokens)
        adapter_pages = self.adapters.pages_of(adapter) if adapter is not None else 0
        if kv_pages + adapter_pages > self.pool.num_pages:
            raise RequestError(
                f"the request needs {kv_pages} KV pages + {adapter_pages} adapter pages; "
                f"the pool has {self.pool.num_pages}"
            )

    def _check_continuation(self, continuation: Continuation, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        done = continuation.token_ids
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in done):
            raise RequestError(f"output token ids to resume after must be integers in [0, {vocab})")
        if len(done) >= params.max_tokens:
            raise RequestError(
                f"nothing to resume: {len(done)} output tokens already, max_tokens "
                f"{params.max_tokens}"
            )

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages now."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """One iteration. A fault of one request (sampling, stop handling, detokenizing, its
        adapter's load) ends that request with finish_reason "error" and the others go on;
        only a fault of the step itself (the forward, a dead tensor-parallel worker)
        raises."""
        scheduled = self.scheduler.schedule()
        if not scheduled and self.adapters.loading:  # nothing else can run: wait for the copies
            # (copies are joined by the next schedule; a read from the store is waited for
            # a little, so an idle engine neither spins nor holds off new requests for long)
            self.adapters.wait_for_loads(0.005)
            scheduled = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        for seq in self.scheduler.take_failed():
            self.requests.pop(seq.request_id, None)
            outputs.append(_final(seq))
        if not scheduled:
            return outputs
        prompt_tokens, decode_rows = step_rows(scheduled)
        started = time.perf_counter()
        batch = build_step_batch(scheduled, self.kv, self.model_config.sliding_window)
        logits = self.model.forward(batch, self.kv.view, self.kv.rows)
        for seq, n in scheduled:
            self.prompt_tokens_computed += max(0, min(n, len(seq.prompt_ids) - seq.num_computed))
            seq.num_computed += n
            self.kv.commit(seq)
        greedy = greedy_tokens(logits, self.model.ops.loops)
        if logits.device.type != "cpu" and any(
            not s.params.greedy or s.params.return_logits for s in batch.sampled
        ):  # sampled with each request's own generator (on the host, so a stream resumed on
            # another replica draws the same tokens), and logits leave the replica on the host
            logits = logits.cpu()
        seconds = time.perf_counter() - started
        self.steps += 1
        self.step_seconds += seconds
        self.step_costs.record_step(
            prompt_tokens,
            decode_rows,
            len({seq.adapter for seq, _ in scheduled if seq.adapter is not None}),
            seconds,
        )
        for i, seq in enumerate(batch.sampled):
            try:
                p = seq.params
                token = greedy[i] if p.greedy else sample_token(logits[i], p, seq.next_draw())
                outputs.append(self._append(seq, token, logits[i] if p.return_logits else None))
            except Exception as e:  # this request's fault: it ends, the batch goes on
                outputs.append(self._fail(seq, e))
        return outputs

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        log.error("request %s failed", seq.request_id, exc_info=error)
        if not seq.finished:  # the cause stays in the log: callers see what they can act on
            self.scheduler.finish(seq, "error", "generation failed for this request")
        self.requests.pop(seq.request_id, None)
        return _final(seq)

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor | None) -> RequestOutput:
        p = seq.params
        seq.output_ids.append(token)
        reason = None
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            reason = "stop"
        ends = reason is not None or (
            len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len
        )
        detok = seq.detok
        if self.tokenizer is not None:
            searched = len(detok.text)
            end = len(seq.output_ids) - (reason is not None)  # a stop token is not text
            if ends:
                detok.flush(self.tokenizer, seq.output_ids, end)
            else:
                detok.add(self.tokenizer, seq.output_ids, end)
            if p.stop and reason is None and len(detok.text) > searched:
                cut = find_stop(detok.text, p.stop, searched)
                if cut is not None:
                    detok.cut(cut)
                    reason = "stop"
        if reason is None and ends:
            reason = "length"
        shown = len(detok.text) if reason else streamable_end(detok.text, p.stop)
        new_text = detok.text[len(seq.text) : shown] if shown > len(seq.text) else ""
        seq.text += new_text
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
            self.step_costs.record_finished(len(seq.output_ids))
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            new_text=new_text,
            token_ids=(
                TokensSoFar(seq.output_ids, len(seq.output_ids))
                if reason is None
                else list(seq.output_ids)
            ),
            text=seq.text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_cached_tokens=seq.num_cached_tokens,
            logits=logits,
        )

    def generate(
        self,
        prompts: list[str | list[int]],
        params: list[SamplingParams],
        adapters: list[str | None],
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Offline: run every request to completion; final outputs in input order."""
        ids = [
            self.add_request(p, sp, a).request_id
            for p, sp, a in zip(prompts, params, adapters, strict=True)
        ]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def restore_costs(self) -> RestoreCosts:
        """What losing an idle page costs, as this engine measures it: its steps' cost per
        prompt token (recomputing a cached block) and its adapter loads' seconds per byte. Until
        it has measured them: priors for the device (dense FLOPs at 100 TFLOP/s on CUDA,
        100 GFLOP/s on CPU; loads over 25 GB/s PCIe, or 5 GB/s host copies)."""
        cuda = self.pool.arena.is_cuda
        est = self.step_costs.estimate()
        if est is not None and est.per_prompt_token_s > 0:
            per_token = est.per_prompt_token_s
        else:
            per_token = 2 * self._dense_parameters() / (1e14 if cuda else 1e11)
        s = self.adapters.stats
        if s.bytes_loaded and s.load_seconds > 0:
            per_byte = s.load_seconds / s.bytes_loaded
        else:
            per_byte = 1 / (25e9 if cuda else 5e9)
        return RestoreCosts(per_token, per_byte)

    def _dense_parameters(self) -> int:
        """Weights one token multiplies through (the projections of every layer)."""
        mc = self.model_config
        return mc.num_layers * sum(
            p.out_features * p.in_features for p in mc.projection_shapes().values()
        )

    def reset_prefix_cache(self) -> int:
        """Drop every cached block (those running requests hold stay theirs); the pages
        freed."""
        return 0 if self.kv.prefix is None else self.kv.prefix.clear()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if self.tp is not None:
            self.tp.close()

    def _prefix_stats(self) -> dict:
        """Prompt tokens requested and computed (a hit's tokens are not), and the cache's
        counters: lookups, hit and missed blocks, evictions of idle cached blocks; and
        `share_base`, which a router keying prompts as this cache does must know."""
        prefix = self.kv.prefix
        out = {
            "enabled": prefix is not None,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
        }
        if prefix is not None:
            out["share_base"] = prefix.share_base
            out.update(asdict(prefix.stats))
            out["cached_blocks"] = len(prefix.blocks)
            out["idle_blocks"] = prefix.num_idle
        return out

    def stats(self) -> dict:
        pool = self.pool.stats()
        return {
            "pool": {f: getattr(pool, f) for f in pool.__slots__},
            "adapters": {
                "registered": len(self.adapters.entries),
                "resident": sorted(self.adapters.resident),
                "loading": sorted(self.adapters.loading),
                "host": sorted(self.adapters.host),
                "held_bytes": self.adapters.held_bytes(),
                **{f: getattr(self.adapters.stats, f) for f in self.adapters.stats.__slots__},
            },
            "waiting": len(self.scheduler.policy),
            "queued_prefill_tokens": queued_prefill_tokens(self.scheduler),
            "policy": self.scheduler.policy.name,
            "running": len(self.scheduler.running),
            "waiting_for_pages": self.scheduler.waiting_for_pages,
            "step_token_budget": self.scheduler.cfg.max_num_batched_tokens,
            "batch_adapters": batch_adapters(self.scheduler),
            "max_loras_per_batch": self.scheduler.cfg.max_loras_per_batch,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.steps,
            "step_seconds": self.step_seconds,
            "kv_block_size": self.kv.block_size,
            "prefix_cache": self._prefix_stats(),
            "step_costs": None if (c := self.step_costs.estimate()) is None else asdict(c),
            "kernels": self.kernels,
            "tp": {"size": 1}
            if self.tp is None
            else {
                "size": self.cfg.tp,
                "launcher": self.tp.launcher,
                "bytes_sent_rank0": {
                    "base": self.tp.comm.sent.base,
                    "lora": self.tp.comm.sent.lora,
                },
            },
        }


def queued_prefill_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens the scheduler has yet to prefill: the waiting requests' and what is left
    of the running ones' (a prefill in chunks). A new request's prefill queues behind them
    under FIFO (the router prices them, router/policy.py `wait`)."""
    return sum(
        max(0, len(seq.prompt_ids) - seq.num_computed)
        for seq in (*scheduler.policy.waiting(), *scheduler.running)
    )


def batch_adapters(scheduler: Scheduler) -> list[str]:
    """The distinct adapters of the running batch. At `max_loras_per_batch` of them, a
    request of any other adapter waits until one of theirs leaves the batch, however many
    batch slots are free (the router prices that: router/policy.py `batch_slots`)."""
    return sorted({seq.adapter for seq in scheduler.running if seq.adapter is not None})


def _final(seq: Sequence) -> RequestOutput:
    """A finished request's last output, with no new token (aborted, or failed)."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=[],
        new_text="",
        token_ids=list(seq.output_ids),
        text=seq.text,
        finished=True,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=len(seq.prompt_ids),
        num_cached_tokens=seq.num_cached_tokens,
        error=seq.error,
    )


def _auto_page_bytes(kv_bytes_per_token: int, kv_row_bytes: int, elem: int) -> int:
    """The smallest power of two >= 64 KiB holding 16 tokens of KV, made a multiple of one
    KV row (kv_heads * head_dim) and of the pool's element when that row is not a power of
    two."""
    page = 64 * 1024
    while page < 16 * kv_bytes_per_token:
        page *= 2
    unit = math.lcm(kv_row_bytes, elem)
    return -(-page // unit) * unit


def _auto_pool_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return 512 * MiB
