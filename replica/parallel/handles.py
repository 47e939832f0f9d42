"""Handles on the ranks 1..N-1 of a tensor-parallel replica: a local process (pipe) or a
Ray actor in the replica's placement group. Both send one message and wait for its answer
with a timeout; a dead, stuck or failing worker raises `WorkerFailed`."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from typing import Protocol

from loraplex.replica.parallel.worker import RayRankWorker, WorkerSpec, serve


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died, timed out or raised; the replica cannot go on."""


class WorkerHandle(Protocol):
    def submit(self, msg: tuple) -> None: ...

    def result(self, timeout_s: float): ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...


class ProcessWorker:
    def __init__(self, spec: WorkerSpec):
        ctx = mp.get_context("spawn")
        self.rank = spec.rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()

    def submit(self, msg: tuple) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(msg))
        except OSError as e:
            raise WorkerFailed(f"tp worker {self.rank} is gone ({e})") from None

    def result(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.05):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise WorkerFailed(f"tp worker {self.rank} exited ({self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"tp worker {self.rank} did not answer in {timeout_s:.0f}s")
        try:
            status, value = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise WorkerFailed(f"tp worker {self.rank} exited ({self.proc.exitcode})") from None
        if status != "ok":
            raise WorkerFailed(f"tp worker {self.rank} failed:\n{value}")
        return value

    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class RayWorker:
    def __init__(self, spec: WorkerSpec, bundle: int):
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.rank = spec.rank
        pg = get_current_placement_group()
        if pg is None or len(pg.bundle_specs) <= bundle:
            raise WorkerFailed(
                f"tp={spec.cfg.tp} with Ray needs a placement group of {spec.cfg.tp} bundles "
                "(the deployment's placement_group_bundles), one per rank"
            )
        resources = pg.bundle_specs[bundle]  # the rank takes its whole bundle
        self.actor = (
            ray.remote(RayRankWorker)
            .options(
                name=f"loraplex-tp-{spec.port}-rank{spec.rank}",  # findable in `ray list actors`
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle
                ),
            )
            .remote(spec)
        )
        self._ref = self.actor.__ray_ready__.remote()
        self._ray = ray
        self._failed = False

    def submit(self, msg: tuple) -> None:
        self._ref = self.actor.handle.remote(pickle.dumps(msg))

    def result(self, timeout_s: float):
        ray = self._ray
        try:
            payload = ray.get(self._ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._failed = True
            raise WorkerFailed(
                f"tp worker {self.rank} did not answer in {timeout_s:.0f}s"
            ) from None
        except ray.exceptions.RayError as e:
            self._failed = True
            raise WorkerFailed(f"tp worker {self.rank} failed: {e}") from None
        if not isinstance(payload, bytes):  # the answer of __ray_ready__
            return None
        status, value = pickle.loads(payload)
        if status != "ok":
            self._failed = True
            raise WorkerFailed(f"tp worker {self.rank} failed:\n{value}")
        return value

    def alive(self) -> bool:
        """False once a call failed; a dead actor otherwise shows at the next step (never
        blocks: health checks call this from the event loop)."""
        return not self._failed

    def close(self) -> None:
        self._ray.kill(self.actor)
