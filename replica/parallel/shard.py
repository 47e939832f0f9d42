"""How a model and its adapters are cut across `world` ranks (Megatron for the base model,
S-LoRA's scheme for the adapters).

Base model, rank p of N:
- q/k/v and gate/up are column-parallel: rank p holds heads [p*H/N, (p+1)*H/N) (and the
  matching KV heads) and intermediate columns [p*I/N, (p+1)*I/N). No communication.
- o and down are row-parallel: rank p holds the matching input columns; its output is a
  partial sum that the ranks all-reduce.
- the LM head is vocab-parallel: rank p holds vocab rows [p*V'/N, (p+1)*V'/N) of the head
  padded to V' = N * ceil(V/N); the ranks all-gather the logits. The embedding is
  replicated (a lookup: no compute to split, and no all-reduce of [T, hidden] per step).

Adapters, matching the base partition so each rank holds ~1/N of every matrix:
- A [r, in] is cut along `in`: rank p computes a partial shrink x_p @ A_p.T, and the ranks
  all-reduce it — the only LoRA communication, T x r elements per group. For the
  column-parallel groups x is replicated and rank p reads x[:, p*h/N:(p+1)*h/N].
- Bt [r, out] is cut along `out` like the base output: for q/k/v/gate/up the rank's own
  output columns; for o/down the rank's slice of the hidden columns, added to the rank's
  partial output before the base all-reduce (which thus assembles the LoRA delta too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loraplex.checkpoint_shape import CheckpointError
from loraplex.replica.memory.adapters import AdapterWeights
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.model.llama import LlamaModel
from loraplex.replica.model.lora_groups import DOWN, GATE_UP, LORA_GROUPS, OUT, QKV

COLUMN_GROUPS = (QKV, GATE_UP)  # the LoRA input is replicated; its A is cut along `in`


@dataclass(frozen=True, slots=True)
class ShardPlan:
    cfg: ModelConfig  # the whole model
    rank: int
    world: int

    def __post_init__(self):
        cfg, n = self.cfg, self.world
        for what, value in (
            ("num_key_value_heads", cfg.num_kv_heads),
            ("intermediate_size", cfg.intermediate_size),
            ("hidden_size", cfg.hidden_size),
        ):
            if value % n:
                raise CheckpointError(
                    f"tp={n} must divide {what} ({value}); choose tp among its divisors"
                )

    @property
    def rank_config(self) -> ModelConfig:
        """The shape one rank computes: 1/N of the heads and of the MLP."""
        c, n = self.cfg, self.world
        part = replace(
            c.shape,
            num_heads=c.num_heads // n,
            num_kv_heads=c.num_kv_heads // n,
            intermediate_size=c.intermediate_size // n,
        )
        return replace(c, shape=part)

    def _part(self, size: int) -> slice:
        step = size // self.world
        return slice(self.rank * step, (self.rank + 1) * step)

    @property
    def vocab_rows(self) -> int:
        return -(-self.cfg.vocab_size // self.world)

    @property
    def hidden_part(self) -> slice:
        return self._part(self.cfg.hidden_size)

    def checkpoint_part(self, name: str) -> tuple[slice, slice]:
        """(rows, cols) of checkpoint tensor `name` ([out, in], HF naming) this rank reads."""
        c, whole = self.cfg, slice(None)
        if name == "lm_head.weight":
            v0 = self.rank * self.vocab_rows
            return slice(v0, min(v0 + self.vocab_rows, c.vocab_size)), whole
        projection = name.rsplit(".", 2)[-2] if name.startswith("layers.") else ""
        if projection in ("o_proj", "down_proj"):
            return whole, self._in_part(projection)
        if projection in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            return self._out_part(projection), whole
        return whole, whole  # embedding (replicated)

    def pad_head(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The last rank's LM head rows past the vocab are zeros (all ranks gather V' rows)."""
        head = weights["lm_head"]
        if head.shape[0] < self.vocab_rows:
            pad = head.new_zeros(self.vocab_rows - head.shape[0], head.shape[1])
            weights["lm_head"] = torch.cat([head, pad])
        return weights

    def _out_part(self, target: str) -> slice:
        c = self.cfg
        return {
            "q_proj": self._part(c.q_size),
            "k_proj": self._part(c.kv_size),
            "v_proj": self._part(c.kv_size),
            "gate_proj": self._part(c.intermediate_size),
            "up_proj": self._part(c.intermediate_size),
        }.get(target, self.hidden_part)

    def _in_part(self, target: str) -> slice:
        c = self.cfg
        return {"o_proj": self._part(c.q_size), "down_proj": self._part(c.intermediate_size)}.get(
            target, self.hidden_part
        )

    def shard_adapter(self, weights: AdapterWeights) -> AdapterWeights:
        modules = {
            (layer, t): (
                a[:, self._in_part(t)].contiguous(),
                bt[:, self._out_part(t)].contiguous(),
            )
            for (layer, t), (a, bt) in weights.modules.items()
        }
        return replace(weights, modules=modules)


class RankModel(LlamaModel):
    """One rank's share of the model (`weights` read with `plan.checkpoint_part`). The
    LoRA of o and down writes the rank's slice of the hidden columns of the partial output."""

    def __init__(
        self,
        plan: ShardPlan,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        dense_gemm: str,
    ):
        self.plan = plan
        super().__init__(plan.rank_config, weights, max_positions, dense_gemm)

    def output_columns(self, group: int) -> dict[str, tuple[int, int]]:
        if group in (OUT, DOWN):
            part = self.plan.hidden_part
            return {LORA_GROUPS[group][0]: (part.start, part.stop)}
        return super().output_columns(group)
