"""A rank other than 0: holds its share of the model and of the adapters and its own pool,
and runs each step rank 0 sends it. The pool's pages are allocated by rank 0 (the same
page ids on every rank: KV blocks and adapter placements are rank 0's decisions); this rank
only fills them.

Messages (pickled, rank 0 -> worker; the worker answers each with ("ok", value) or
("error", text) and stops after an error):
    ("pool", PoolSpec)                       build the pool and the forward ops
    ("step", StepMessage)                    host-tier changes, placements, then a forward
    ("state",)                               {adapter: (pages, {(layer, target): (A, Bt)})}
    ("stop",)
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loraplex.kernels.backend import make_backend
from loraplex.replica.batch import StepBatch
from loraplex.replica.config import EngineConfig
from loraplex.replica.memory.adapters import AdapterWeights, ResidentAdapter, plan_layout
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.memory.pool import UnifiedPool, chunk_views
from loraplex.replica.model.config import DTYPES, ModelConfig
from loraplex.replica.model.loader import load_weights
from loraplex.replica.parallel.comm import Communicator, ParallelOps
from loraplex.replica.parallel.shard import RankModel, ShardPlan


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    cfg: EngineConfig
    rank: int
    addr: str
    port: int
    max_model_len: int
    timeout_s: float
    threads: int = 1


@dataclass(frozen=True, slots=True)
class PoolSpec:
    num_pages: int
    page_elems: int
    kv_dtype: torch.dtype
    kernels: str
    lora_layout: tuple[int, int, int]  # max_rank, max_loras, max_tokens


@dataclass(frozen=True, slots=True)
class StepMessage:
    # host-tier changes in order: this rank's shard of an adapter (registered or
    # replaced), or the name of one removed
    events: tuple[AdapterWeights | str, ...]
    placements: dict[int, tuple[str, tuple[int, ...]]] | None  # None: unchanged
    batch: StepBatch  # lora_runs hold placement ids; sampled is empty


def model_config(cfg: EngineConfig) -> ModelConfig:
    return ModelConfig.from_pretrained(
        Path(cfg.model), None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    )


def load_rank(
    cfg: EngineConfig, rank: int, max_model_len: int, device: torch.device, cls=RankModel, **kw
):
    """(plan, model) of one rank: only its share of each matrix is read from disk."""
    plan = ShardPlan(model_config(cfg), rank, cfg.tp)
    weights = load_weights(Path(cfg.model), plan.cfg, device, plan.checkpoint_part)
    return plan, cls(plan, plan.pad_head(weights), max_model_len, cfg.dense_gemm, **kw)


class RankWorker:
    def __init__(self, spec: WorkerSpec):
        torch.set_num_threads(spec.threads)
        self.device = torch.device(spec.cfg.device)
        if self.device.type == "cuda" and self.device.index is None:
            # a Ray actor sees only its own GPU; local processes take GPU `rank`
            self.device = torch.device("cuda", spec.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.comm = Communicator(
            spec.rank, spec.cfg.tp, spec.addr, spec.port, self.device, spec.timeout_s
        )
        self.plan, self.model = load_rank(spec.cfg, spec.rank, spec.max_model_len, self.device)
        self.rank_config = self.plan.rank_config
        self.host: dict[str, AdapterWeights] = {}
        self.placed: dict[int, ResidentAdapter] = {}

    def handle(self, msg: tuple):
        kind = msg[0]
        if kind == "pool":
            return self._build_pool(msg[1])
        if kind == "step":
            return self._step(msg[1])
        if kind == "state":
            return self._state()
        raise ValueError(f"unknown message {kind!r}")

    def _build_pool(self, spec: PoolSpec) -> None:
        mc = self.rank_config
        self.pool = UnifiedPool(spec.num_pages, spec.page_elems, mc.dtype, self.device)
        self.kv = KVCache(self.pool, mc, spec.kv_dtype)
        layout = self.model.lora_layout(*spec.lora_layout)
        backend = make_backend(spec.kernels, layout, self.pool.arena)
        self.model.ops = ParallelOps(backend, self.comm, self.plan)

    def _step(self, m: StepMessage) -> None:
        for event in m.events:
            if isinstance(event, str):
                self.host.pop(event, None)
            else:
                self.host[event.name] = event
        if m.placements is not None:
            for pid in set(self.placed) - set(m.placements):
                del self.placed[pid]
            for pid, (name, pages) in m.placements.items():
                if pid not in self.placed:
                    self.placed[pid] = ResidentAdapter(
                        self.host[name], self.pool, self.rank_config, self.model.output_columns,
                        pages=list(pages),
                    )  # fmt: skip
        runs = [(s, e, self.placed[pid]) for s, e, pid in m.batch.lora_runs]
        self.model.forward(replace(m.batch, lora_runs=runs), self.kv.view, self.kv.rows)

    def _state(self) -> dict:
        """Each placed adapter's pages and what its pages hold, per (layer, target)."""
        out = {}
        for r in self.placed.values():
            out[r.name] = (tuple(r.pages), read_back(self.host[r.name], r, self.pool))
        return out


def read_back(weights: AdapterWeights, resident: ResidentAdapter, pool: UnifiedPool) -> dict:
    """{(layer, target): (A, Bt)} as read from the pool pages a placement occupies."""
    packer, plan = plan_layout(weights, pool.page_elems, len(resident.groups))
    got = {}
    for layer, _group, a_index, outs in plan:
        a = torch.cat(chunk_views(pool.arena, packer.placements[a_index], resident.pages))
        h = 0
        for target, bt_index, rows in outs:
            bt = torch.cat(chunk_views(pool.arena, packer.placements[bt_index], resident.pages))
            got[(layer, target)] = (a[h : h + rows].clone(), bt.clone())
            h += rows
    return got


def serve(conn, spec: WorkerSpec) -> None:
    """A local worker process: answer rank 0's messages until told to stop or rank 0 goes."""
    try:
        worker = RankWorker(spec)
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # rank 0 is gone
        if msg[0] == "stop":
            break
        try:
            reply = ("ok", worker.handle(msg))
        except BaseException:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
            break
        conn.send_bytes(pickle.dumps(reply))
    worker.comm.close()


class RayRankWorker:
    """The same worker as a Ray actor (wrapped with ray.remote by the group)."""

    def __init__(self, spec: WorkerSpec):
        self.worker = RankWorker(spec)

    def handle(self, payload: bytes) -> bytes:
        try:
            return pickle.dumps(("ok", self.worker.handle(pickle.loads(payload))))
        except BaseException:
            return pickle.dumps(("error", traceback.format_exc()))

    def stop(self) -> None:
        self.worker.comm.close()
