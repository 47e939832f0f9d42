"""Per-step metadata, built once per step from the scheduled sequences; layers only read it.

Sequences are ordered by adapter, so the tokens of one adapter form one contiguous
segment of the batch (the LoRA kernels' segments). Attention runs in two groups: decode
rows (one new token) and extend rows (a prefill chunk), each padded only to its own width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from loraplex.kernels.attention import attention_bias, attention_mask, paged_attention
from loraplex.kernels.attention_native import DecodeAttention, DecodeLayers
from loraplex.kernels.backend import Run
from loraplex.kernels.decode_attention import decode_attention, decode_rows
from loraplex.replica.memory.kv_cache import KVCache
from loraplex.replica.sequence import Sequence


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    token_idx: torch.Tensor  # [B, Q] rows of the step's tokens, padded by repeating a valid row
    out_rows: torch.Tensor  # [N] step rows the group produces
    src_rows: torch.Tensor  # [N] their rows in the flattened [B*Q] output
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, Q, max_blocks * block_size]
    ctx_lens: torch.Tensor  # [B] int32 keys in the cache after this step's writes
    decode: bool  # one query per row (Q == 1)
    every_row: bool  # decode, and its rows are all the step's, in order: no reindexing

    def to(self, device: torch.device) -> AttentionGroup:
        return replace(self, **_moved(self, device))


def _moved(obj, device: torch.device) -> dict:
    """The tensor fields of a dataclass, on `device`."""
    return {
        f.name: getattr(obj, f.name).to(device)
        for f in fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor)
    }


@dataclass(frozen=True, slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    kv_rows: torch.Tensor  # [num_layers, 2, T] pool rows each token's K and V are written to
    groups: tuple[AttentionGroup, ...]
    lora_runs: list[Run]  # contiguous runs of tokens sharing a resident adapter
    decode: bool  # every row computes one token
    sliding_window: int | None
    sample_idx: torch.Tensor  # [S] rows whose logits are needed
    sampled: tuple[Sequence, ...]  # the sequences those rows belong to, in order

    def to(self, device: torch.device) -> StepBatch:
        """This batch with its tensors on `device` (itself when they are there already): it
        is built on the host, and each process of a tensor-parallel group moves it to its own
        device."""
        if self.input_ids.device == device:
            return self
        groups = tuple(g.to(device) for g in self.groups)
        return replace(self, groups=groups, **_moved(self, device))

    def attention(
        self,
        kv_cache: torch.Tensor,
        pool_rows: torch.Tensor,
        num_heads: int,
        scale: float,
        decode_kernel: Callable | None,
    ) -> StepAttention:
        """This step's attention, for every layer; kv_cache [num_pages, num_layers, 2,
        block_size, kv_heads, head_dim] and pool_rows [rows, head_dim] view the pool."""
        return StepAttention(self, kv_cache, pool_rows, num_heads, scale, decode_kernel)


class StepAttention:
    """A step's attention over the paged cache, called once per layer. What the layers
    share is built once, here: without a decode kernel, each decode group's key rows in the
    pool and its mask as a bias (kernels.decode_attention); each other group's mask as the
    bias SDPA adds, which it would otherwise convert from the bool mask in every layer."""

    def __init__(
        self,
        batch: StepBatch,
        kv_cache: torch.Tensor,
        pool_rows: torch.Tensor,
        num_heads: int,
        scale: float,
        decode_kernel: Callable | None,
    ):
        self.batch, self.kv_cache, self.pool_rows = batch, kv_cache, pool_rows
        self.scale, self.decode_kernel = scale, decode_kernel
        self.rows = [
            decode_rows(
                kv_cache, pool_rows, g.block_tables, g.ctx_lens, num_heads, batch.sliding_window
            )
            if g.decode and decode_kernel is None
            else None
            for g in batch.groups
        ]
        self.biases = [
            attention_bias(g.mask) if r is None and not (g.decode and decode_kernel) else None
            for g, r in zip(batch.groups, self.rows, strict=True)
        ]

    def decode_layers(
        self,
        tables: tuple[torch.Tensor, torch.Tensor],
        cache_rows: torch.Tensor,
        num_heads: int,
    ) -> DecodeLayers | None:
        """For a decode step whose backend runs the compiled decode attention: each layer's
        attention with the rotary embedding (RoPE's `tables`) and the KV write before it, in
        one call from its qkv rows (kernels/attention_native.py); else None."""
        g = self.batch.groups[0]
        if not (isinstance(self.decode_kernel, DecodeAttention) and g.every_row):
            return None
        return self.decode_kernel.layers(
            self.kv_cache, g.block_tables, g.ctx_lens, self.scale, self.batch.sliding_window,
            tables, cache_rows, self.batch.kv_rows, num_heads,
        )  # fmt: skip

    def __call__(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] for `layer`."""
        batch, rows = self.batch, self.rows
        every_row = batch.groups[0].every_row
        if every_row and rows[0] is not None:
            # a decode step without a decode kernel: its rows in, its rows out, with no
            # index copies (three a layer)
            return decode_attention(q, self.pool_rows, rows[0], layer, self.scale)
        k_cache, v_cache = self.kv_cache[:, layer, 0], self.kv_cache[:, layer, 1]
        if every_row and self.decode_kernel is not None:  # the same with a decode kernel
            g = batch.groups[0]
            return self.decode_kernel(
                q, k_cache, v_cache, g.block_tables, g.ctx_lens, self.scale, batch.sliding_window
            )
        out = torch.empty_like(q)
        for g, step_rows, bias in zip(batch.groups, rows, self.biases, strict=True):
            if step_rows is not None:
                res = decode_attention(
                    q[g.token_idx[:, 0]], self.pool_rows, step_rows, layer, self.scale
                )
            elif g.decode and self.decode_kernel is not None:
                res = self.decode_kernel(
                    q[g.token_idx[:, 0]], k_cache, v_cache, g.block_tables, g.ctx_lens,
                    self.scale, batch.sliding_window,
                )  # fmt: skip
            else:
                res = paged_attention(
                    q[g.token_idx], k_cache, v_cache, g.block_tables, bias, self.scale
                )
            out[g.out_rows] = res.reshape(-1, *q.shape[1:])[g.src_rows]
        return out


def adapter_order(item: tuple[Sequence, int]) -> tuple[int, str]:
    seq = item[0]
    return (0, "") if seq.adapter is None else (1, seq.adapter)


def build_step_batch(
    scheduled: list[tuple[Sequence, int]], kv: KVCache, sliding_window: int | None
) -> StepBatch:
    scheduled = sorted(scheduled, key=adapter_order)
    ids, positions, pages, offsets, sample_rows, sampled = [], [], [], [], [], []
    starts = []
    for seq, n in scheduled:
        start = seq.num_computed
        starts.append(len(ids))
        ids.extend(seq.token_ids(start, start + n))
        positions.extend(range(start, start + n))
        p, o = kv.slots(seq, start, start + n)
        pages.extend(p)
        offsets.extend(o)
        if start + n == seq.num_tokens:
            sample_rows.append(len(ids) - 1)
            sampled.append(seq)

    decode = [(i, s, n) for i, (s, n) in enumerate(scheduled) if n == 1]
    extend = [(i, s, n) for i, (s, n) in enumerate(scheduled) if n > 1]
    groups = tuple(
        _attention_group(part, starts, len(ids), kv, sliding_window)
        for part in (decode, extend)
        if part
    )
    return StepBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        kv_rows=kv.write_rows(pages, offsets),
        groups=groups,
        lora_runs=_lora_runs(scheduled, starts, len(ids)),
        decode=not extend,
        sliding_window=sliding_window,
        sample_idx=torch.tensor(sample_rows, dtype=torch.int64),
        sampled=tuple(sampled),
    )


def _attention_group(
    part, starts, num_tokens: int, kv: KVCache, sliding_window: int | None
) -> AttentionGroup:
    q_max = max(n for _, _, n in part)
    token_idx, out_rows, src_rows = [], [], []
    for b, (i, _, n) in enumerate(part):
        rows = list(range(starts[i], starts[i] + n))
        token_idx.append(rows + [rows[-1]] * (q_max - n))
        out_rows.extend(rows)
        src_rows.extend(range(b * q_max, b * q_max + n))
    seqs = [s for _, s, _ in part]
    block_tables = kv.block_table_tensor(seqs)
    q_start = torch.tensor([s.num_computed for s in seqs], dtype=torch.int64)
    ctx_lens = q_start + torch.tensor([n for _, _, n in part], dtype=torch.int64)
    mask = attention_mask(
        q_start, q_max, ctx_lens, block_tables.shape[1] * kv.block_size, sliding_window
    )
    return AttentionGroup(
        token_idx=torch.tensor(token_idx, dtype=torch.int64),
        out_rows=torch.tensor(out_rows, dtype=torch.int64),
        src_rows=torch.tensor(src_rows, dtype=torch.int64),
        block_tables=block_tables,
        mask=mask,
        ctx_lens=ctx_lens.to(torch.int32),
        decode=q_max == 1,
        every_row=q_max == 1 and out_rows == list(range(num_tokens)),
    )


def _lora_runs(scheduled, starts, num_tokens: int) -> list[Run]:
    """Contiguous runs of tokens sharing a resident adapter (the kernels' segments)."""
    runs = []  # (start, end, resident)
    for (seq, _), start, end in zip(scheduled, starts, starts[1:] + [num_tokens], strict=True):
        if seq.lora is None:
            continue
        if runs and runs[-1][2] is seq.lora and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, seq.lora)
        else:
            runs.append((start, end, seq.lora))
    return runs
