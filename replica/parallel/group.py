"""Rank 0's side of a tensor-parallel replica: start the other ranks, keep them in step.

Workers are local processes (spawned; `generate --tp`, tests) or Ray actors placed in the
replica's placement group (a Serve deployment with `placement_group_bundles`); both
answer the same messages (worker.py). Every step rank 0 sends each worker the step's
metadata, the host-tier changes since the last step and — when it changed — the map of
adapter placements (pages), then runs its own share of the forward; the collectives inside
the forward keep the ranks together. Every wait has a timeout: a dead or stuck worker
fails the step with an error instead of hanging the replica.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import replace
from typing import Literal

import torch

from loraplex.net import free_port
from loraplex.replica.batch import StepBatch
from loraplex.replica.config import EngineConfig
from loraplex.replica.memory.adapter_cache import AdapterCache
from loraplex.replica.memory.adapters import AdapterWeights, ResidentAdapter
from loraplex.replica.memory.pool import UnifiedPool
from loraplex.replica.parallel.comm import Communicator, ParallelOps
from loraplex.replica.parallel.handles import ProcessWorker, RayWorker, WorkerFailed, WorkerHandle
from loraplex.replica.parallel.shard import RankModel, ShardPlan
from loraplex.replica.parallel.worker import (
    PoolSpec,
    StepMessage,
    WorkerSpec,
    load_rank,
    model_config,
)

Launcher = Literal["auto", "process", "ray"]


def _try(fn):
    try:
        return fn()
    except BaseException as e:
        return e


def _use_ray(launcher: Launcher) -> bool:
    if launcher != "auto":
        return launcher == "ray"
    try:
        import ray
        from ray.util import get_current_placement_group
    except ImportError:
        return False
    return ray.is_initialized() and get_current_placement_group() is not None


class DriverModel(RankModel):
    """Rank 0's model: sends each step to the workers, then runs its own share."""

    def __init__(
        self, plan, weights, max_positions: int, dense_gemm: str, group: TensorParallelGroup
    ):
        super().__init__(plan, weights, max_positions, dense_gemm)
        self.group = group

    def forward(self, batch: StepBatch, kv_cache, kv_rows) -> torch.Tensor:
        self.group.send_step(batch)
        logits = super().forward(batch, kv_cache, kv_rows)
        self.group.finish_step()
        return logits


class TensorParallelGroup:
    """Rank 0: its model shard, the communicator, and handles on ranks 1..N-1."""

    def __init__(
        self,
        cfg: EngineConfig,
        max_model_len: int,
        launcher: Launcher = "auto",
        timeout_s: float = 120.0,
    ):
        self.cfg, self.timeout_s = cfg, timeout_s
        device = torch.device(cfg.device)
        ShardPlan(model_config(cfg), 0, cfg.tp)  # a tp that does not divide the model: fail now
        use_ray = _use_ray(launcher)
        addr = "127.0.0.1"
        if use_ray:
            import ray

            addr = ray.util.get_node_ip_address()
        port = free_port(addr)
        threads = 1
        if device.type == "cpu":
            # the ranks share this machine's cores: each takes 1/N of the threads (more
            # would spin at OpenMP barriers while another rank holds the core)
            threads = max(1, torch.get_num_threads() // cfg.tp)
            torch.set_num_threads(threads)
        self.workers: list[WorkerHandle] = []
        try:
            for rank in range(1, cfg.tp):
                spec = WorkerSpec(cfg, rank, addr, port, max_model_len, timeout_s, threads)
                self.workers.append(RayWorker(spec, rank) if use_ray else ProcessWorker(spec))
            self.comm = self._join(addr, port, device)
            self._wait_all()
            plan, model = load_rank(cfg, 0, max_model_len, device, DriverModel, group=self)
        except BaseException:
            self.close()
            raise
        self.plan: ShardPlan = plan
        self.model: DriverModel = model
        # host-tier changes per worker, in order: an AdapterWeights shard (add or replace)
        # or a name (remove)
        self._events: list[list[AdapterWeights | str]] = [[] for _ in self.workers]
        self._ids: weakref.WeakKeyDictionary[ResidentAdapter, int] = weakref.WeakKeyDictionary()
        self._next_id = 0
        self._sent_placements: dict[int, tuple[str, tuple[int, ...]]] | None = None
        self.adapters: AdapterCache | None = None
        self.launcher = "ray" if use_ray else "process"

    def _join(self, addr: str, port: int, device: torch.device) -> Communicator:
        """Rendezvous with the workers, failing as soon as one of them dies."""
        joined: list = []
        thread = threading.Thread(
            target=lambda: joined.append(
                _try(lambda: Communicator(0, self.cfg.tp, addr, port, device, self.timeout_s))
            ),
            daemon=True,  # left blocked until the store times out if a worker never joins
        )
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(0.1)
            for w in self.workers:
                if not w.alive():
                    w.result(0)  # raises WorkerFailed with the worker's own error
                    raise WorkerFailed("a tp worker exited before joining the group")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"the tp workers did not join in {self.timeout_s:.0f}s")
        (result,) = joined
        if isinstance(result, BaseException):
            raise result
        return result

    def _wait_all(self, timeout_s: float | None = None) -> list:
        return [w.result(timeout_s or self.timeout_s) for w in self.workers]

    def _broadcast(self, msg: tuple) -> list:
        for w in self.workers:
            w.submit(msg)
        return self._wait_all()

    def connect(
        self, backend, pool: UnifiedPool, kv_dtype: torch.dtype, adapters: AdapterCache, layout_args
    ) -> ParallelOps:
        """Give every worker a pool and KV cache like rank 0's; return rank 0's forward ops."""
        self.adapters = adapters
        spec = PoolSpec(pool.num_pages, pool.page_elems, kv_dtype, backend.name, layout_args)
        self._broadcast(("pool", spec))
        return ParallelOps(backend, self.comm, self.plan)

    # adapters

    def shard(self, weights: AdapterWeights, rank: int = 0) -> AdapterWeights:
        return replace(self.plan, rank=rank).shard_adapter(weights)

    def add_adapter(self, weights: AdapterWeights) -> AdapterWeights:
        """Queue each worker's shard for the next step; return rank 0's."""
        for i, events in enumerate(self._events):
            events.append(self.shard(weights, i + 1))
        return self.shard(weights, 0)

    def remove_adapter(self, name: str) -> None:
        for events in self._events:
            events.append(name)

    def _placement_id(self, resident: ResidentAdapter) -> int:
        pid = self._ids.get(resident)
        if pid is None:
            pid = self._ids[resident] = self._next_id
            self._next_id += 1
        return pid

    def _placements(self, batch: StepBatch) -> dict[int, tuple[str, tuple[int, ...]]]:
        live = list(self.adapters.resident.values()) if self.adapters is not None else []
        live += [r for _, _, r in batch.lora_runs]
        return {self._placement_id(r): (r.name, tuple(r.pages)) for r in live}

    # steps

    def send_step(self, batch: StepBatch) -> None:
        placements = self._placements(batch)
        changed = placements != self._sent_placements
        wire = replace(
            batch,
            lora_runs=[(s, e, self._placement_id(r)) for s, e, r in batch.lora_runs],
            sampled=(),
        )
        for w, events in zip(self.workers, self._events, strict=True):
            msg = StepMessage(tuple(events), placements if changed else None, wire)
            w.submit(("step", msg))
            events.clear()
        self._sent_placements = placements

    def finish_step(self) -> None:
        self._wait_all()

    def worker_state(self) -> list[dict]:
        """Each worker's placed adapters: {name: (pages, {(layer, target): (A, Bt)})}."""
        return self._broadcast(("state",))

    def failure(self) -> str | None:
        dead = [i + 1 for i, w in enumerate(self.workers) if not w.alive()]
        return f"tp workers {dead} are not running" if dead else None

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.close()
