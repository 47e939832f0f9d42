"""Llama-family decoder (Llama 2/3, Mistral): GQA, RoPE, RMSNorm, SwiGLU, tied or untied
embeddings. Weights are plain tensors in the fused layout of `loader.py`; the KV cache is a
view of the unified pool; LoRA goes through the selected kernel backend (`ForwardOps`).
The model holds no parallel code: tensor parallelism shards its weights and supplies
other `ForwardOps` from outside (replica.parallel).

The forward pass reads the per-step metadata in `StepBatch` and does no per-request work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loraplex.kernels import small_ops_native as small_ops
from loraplex.kernels.attention import write_kv
from loraplex.kernels.backend import KernelBackend, TorchBackend
from loraplex.kernels.dense import linear, pack_in_place
from loraplex.kernels.lora_tables import LoraLayout
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.model.lora_groups import DOWN, GATE_UP, LORA_GROUPS, OUT, QKV
from loraplex.replica.model.rope import RotaryEmbedding, rotate

if TYPE_CHECKING:
    from loraplex.replica.batch import StepBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' LlamaRMSNorm. In float32, torch's own rms_norm: the same ops in the
    same order (bit-identical), with fewer intermediate tensors, each a write to memory
    the step's weights have just pushed out of the cache (SmolLM2's decode step, batch 32:
    ~60 us a call in the step against ~25 us on data in cache). In half precision the
    product with the weight rounds differently there, so the reference's ops."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# the largest output of a small op kept for reuse (8 MB in float32): a decode step's are
# well under it; a prefill's larger ones cost little beside their GEMMs
KEPT_OUTPUT_ELEMENTS = 1 << 21


class ForwardOps:
    """The ops the forward pass calls, one process: LoRA through the selected kernel backend,
    the step's small ops (norms, rotary embedding, KV write, SwiGLU's product) in the
    backend's compiled loops where it has them and they take the tensors (float32 rows:
    kernels/small_ops_native.py; else the torch forms here), and the points where tensor
    parallelism (replica.parallel) sums partial outputs of row-parallel layers and gathers
    vocab-parallel logits — nothing to do here."""

    def __init__(self, kernels: KernelBackend):
        self.kernels = kernels
        self.loops = kernels.cpu_loops
        # the loops' outputs, one tensor an op kept for the next call of the same shape: a
        # norm's rows and SwiGLU's product are read by the GEMM and LoRA right after them,
        # and dead by the op's next call. A fresh tensor, the first op after a GEMM, cost
        # ~16 us a call on SmolLM2's decode step (the allocator's code and data out of the
        # cache); kept, the step took ~1.6 ms less (2026-12-07, paired rounds).
        self._outputs: dict[str, torch.Tensor] = {}

    def _output(self, op: str, source: torch.Tensor, cols: int) -> torch.Tensor | None:
        """`op`'s output tensor [rows of `source`, cols] float32, reused while the shape
        repeats; None where the op allocates its own: rows the loops do not take (a bfloat16
        model's), or a prefill's larger ones, which are not kept."""
        if not small_ops.rows_ok(source):
            return None
        rows = source.shape[0]
        out = self._outputs.get(op)
        if out is None or out.shape != (rows, cols):
            if rows * cols > KEPT_OUTPUT_ELEMENTS:
                return None
            out = self._outputs[op] = torch.empty(rows, cols, dtype=torch.float32)
        return out

    def lora(self, y: torch.Tensor, x: torch.Tensor, lora: list, group: int) -> None:
        """y += LoRA(x) for one group of a layer; lora: the layer's `kernels.prepare` args
        (None: no adapter of the step has the group, or none is in it)."""
        args = lora[group]
        if args is not None:
            self.kernels.expand(y, self.kernels.shrink(x, args), args)

    def norm(
        self, h: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """h += residual (in place, where given), then rms_norm(h): in the loops, rows kept
        for the next norm of this shape (read them before it); else new rows."""
        if self.loops is not None:
            buf = self._output("norm", h, h.shape[1])
            out = small_ops.rms_norm(self.loops, h, weight, eps, residual, buf)
            if out is not None:
                return out
        if residual is not None:
            h += residual
        return rms_norm(h, weight, eps)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`rotate`'s result; x (a view of the fused qkv output) may be rotated in place."""
        if self.loops is not None:
            out = small_ops.rotate_(self.loops, x, cos, signed_sin)
            if out is not None:
                return out
        return rotate(x, cos, signed_sin)

    def write_kv(
        self,
        rows: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_rows: torch.Tensor,
        v_rows: torch.Tensor,
    ) -> None:
        if self.loops is None or not small_ops.write_kv(self.loops, rows, k, v, k_rows, v_rows):
            write_kv(rows, k, v, k_rows, v_rows)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, gate and up the two halves of each row (in the loops, kept as the
        norm's output is)."""
        if self.loops is not None:
            buf = self._output("silu", gate_up, gate_up.shape[1] // 2)
            out = small_ops.silu_mul(self.loops, gate_up, buf)
            if out is not None:
                return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # one tensor written, not two

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


DENSE = ("qkv", "o", "gate_up", "down")


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        dense_gemm: str,
    ):
        """dense_gemm: how the projections and the LM head multiply (kernels/dense.py); with
        their weights reordered, `weights` holds the reordered copies in their place."""
        self.cfg = cfg
        self.w = weights
        device = weights["embed"].device
        dense = [f"layers.{i}.{k}" for i in range(cfg.num_layers) for k in DENSE] + ["lm_head"]
        # what the step's GEMMs read, whatever their layout
        self.dense_bytes = sum(weights[k].nbytes for k in dense)
        # a tied LM head, reordered, is a copy apart from the embedding it shares
        pack_in_place(dense_gemm, weights, dense)
        self.rope = RotaryEmbedding(cfg, max_positions, device)
        self.layers = [
            {
                k: weights[f"layers.{i}.{k}"]
                for k in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")
            }
            for i in range(cfg.num_layers)
        ]
        self.scale = cfg.head_dim**-0.5
        self.ops = ForwardOps(TorchBackend(self.lora_layout(1, 1, 1), torch.zeros(1)))

    def lora_layout(self, max_rank: int, max_loras: int, max_tokens: int) -> LoraLayout:
        columns = tuple(tuple(self.output_columns(g).values()) for g in LORA_GROUPS)
        return LoraLayout(self.cfg.num_layers, columns, max_rank, max_loras, max_tokens)

    def output_columns(self, group: int) -> dict[str, tuple[int, int]]:
        """Columns of the fused output that each target of a LoRA group writes."""
        cfg = self.cfg
        widths = {
            QKV: (cfg.q_size, cfg.kv_size, cfg.kv_size),
            OUT: (cfg.hidden_size,),
            GATE_UP: (cfg.intermediate_size, cfg.intermediate_size),
            DOWN: (cfg.hidden_size,),
        }[group]
        cols, start = {}, 0
        for target, width in zip(LORA_GROUPS[group], widths, strict=True):
            cols[target] = (start, start + width)
            start += width
        return cols

    @torch.inference_mode()
    def forward(
        self, batch: StepBatch, kv_cache: torch.Tensor, kv_rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits [len(batch.sample_idx), vocab] in float32.

        kv_cache: [num_pages, num_layers, 2, block_size, kv_heads, head_dim] view of the pool;
        kv_rows: the same memory as [rows, kv_heads * head_dim], where new K/V are written.
        """
        cfg, ops = self.cfg, self.ops
        batch = batch.to(self.w["embed"].device)
        t = batch.input_ids.shape[0]
        loras = ops.kernels.prepare(batch.lora_runs, t, batch.decode)
        h = self.w["embed"][batch.input_ids]
        cos, signed_sin = self.rope.tables(batch.positions)
        attention = batch.attention(
            kv_cache, kv_rows.view(-1, cfg.head_dim), cfg.num_heads, self.scale,
            ops.kernels.decode_attention,
        )  # fmt: skip
        # the config's shape fields read once, not per layer (its __getattr__ costs ~1 us)
        eps, hd, heads, kv_heads = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q_size, qk_size = cfg.q_size, cfg.q_size + cfg.kv_size
        # a decode step on the compiled loops: RoPE, the KV write and attention, one call
        fused = attention.decode_layers((cos, signed_sin), kv_rows, heads) if batch.decode else None
        pending = None  # the last layer's output, added to h by the next norm
        for i, layer in enumerate(self.layers):
            lora = loras[i]
            x = ops.norm(h, layer["input_norm"], eps, pending)
            qkv = linear(x, layer["qkv"])
            ops.lora(qkv, x, lora, QKV)
            attn = None if fused is None else fused(qkv, i)
            if attn is None:
                qk = qkv[:, :qk_size].view(t, -1, hd)
                q, k = ops.rotate(qk, cos, signed_sin).split((heads, kv_heads), dim=1)
                v = qkv[:, qk_size:].view(t, kv_heads, hd)
                ops.write_kv(kv_rows, k, v, batch.kv_rows[i, 0], batch.kv_rows[i, 1])
                attn = attention(q, i).reshape(t, q_size)
            o = linear(attn, layer["o"])
            ops.lora(o, attn, lora, OUT)

            x = ops.norm(h, layer["post_norm"], eps, ops.reduce(o))
            gate_up = linear(x, layer["gate_up"])
            ops.lora(gate_up, x, lora, GATE_UP)
            act = ops.silu_mul(gate_up)
            down = linear(act, layer["down"])
            ops.lora(down, act, lora, DOWN)
            pending = ops.reduce(down)
        if pending is not None:
            h += pending
        h = ops.norm(h[batch.sample_idx], self.w["norm"], eps, None)
        return ops.gather_logits(linear(h, self.w["lm_head"])).float()
