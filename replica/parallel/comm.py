"""Collectives between the ranks of one replica (gloo on CPU, NCCL on CUDA), with a
timeout on every operation and a count of the bytes each rank sends, and the forward ops
that use them.

Bytes are counted as a rank sends them under the ring algorithms: an all-reduce of S
bytes sends 2 (N-1)/N * S, an all-gather whose result is S bytes sends (N-1)/N * S.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loraplex.replica.model.llama import ForwardOps
from loraplex.replica.parallel.shard import COLUMN_GROUPS, ShardPlan


@dataclass(slots=True)
class CommBytes:
    base: int = 0  # row-parallel all-reduces, logits all-gather
    lora: int = 0  # all-reduces of the rank-sized shrink outputs


class Communicator:
    def __init__(
        self,
        rank: int,
        world: int,
        addr: str,
        port: int,
        device: torch.device,
        timeout_s: float,
    ):
        self.rank, self.world, self.device = rank, world, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.group_name = f"loraplex-tp-{port}"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        self.sent = CommBytes()

    def _count(self, kind: str, nbytes: float) -> None:
        setattr(self.sent, kind, getattr(self.sent, kind) + int(nbytes))

    def all_reduce_(self, tensors: list[torch.Tensor], kind: str) -> None:
        """Sum each tensor over the ranks, in place; one collective for all of them."""
        if not tensors:
            return
        if len(tensors) == 1 and tensors[0].is_contiguous():
            flat = tensors[0]
        else:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        n = self.world
        self._count(kind, 2 * (n - 1) / n * flat.numel() * flat.element_size())
        dist.all_reduce(flat)
        if flat is not tensors[0]:
            start = 0
            for t in tensors:
                t.copy_(flat[start : start + t.numel()].view_as(t))
                start += t.numel()

    def all_gather_cols(self, part: torch.Tensor, kind: str) -> torch.Tensor:
        """[S, C] on each rank -> [S, N * C], rank p's columns at [p*C, (p+1)*C)."""
        parts = [torch.empty_like(part) for _ in range(self.world)]
        n = self.world
        self._count(kind, (n - 1) * part.numel() * part.element_size())
        dist.all_gather(parts, part.contiguous())
        return torch.cat(parts, dim=1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ParallelOps(ForwardOps):
    """The forward ops of one rank: LoRA shrink, all-reduce of its rank-sized output,
    expand; all-reduce of row-parallel outputs; all-gather of vocab-parallel logits."""

    def __init__(self, kernels, comm: Communicator, plan: ShardPlan):
        super().__init__(kernels)
        self.comm = comm
        self.hidden = plan.hidden_part
        self.vocab = plan.cfg.vocab_size

    def lora(self, y: torch.Tensor, x: torch.Tensor, lora: list, group: int) -> None:
        args = lora[group]
        if group in COLUMN_GROUPS:
            x = x[:, self.hidden]
        hs = self.kernels.shrink(x, args)
        self.comm.all_reduce_(hs, "lora")
        self.kernels.expand(y, hs, args)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        self.comm.all_reduce_([partial], "base")
        return partial

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_cols(logits, "base")[:, : self.vocab]
