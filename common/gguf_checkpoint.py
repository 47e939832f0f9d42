"""A Llama-family GGUF file (llama.cpp's format) read as a checkpoint: its metadata as a
`ModelShape`, its tokenizer and chat template, and its tensors dequantized with the `gguf`
package, under Hugging Face names and layout. Torch-free (numpy only).

Layout differences undone here:
- GGUF stores q and k with the rows of each head interleaved for llama.cpp's rope
  (convert_hf_to_gguf.py, LlamaModel.permute: rows [h, 2, d/2] -> [h, d/2, 2]); reading
  swaps them back, so the engine sees Hugging Face's half-split rope layout.
- A tensor's `shape` in GGUF lists the fastest dimension first; `read` returns numpy
  [out, in] like a safetensors checkpoint.

Quantized rows are dequantized one block-row at a time, and only the rows (and, where the
cut falls on quantization blocks, the columns) asked for: a tensor-parallel rank reads
its share of the bytes and dequantizes only that.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.checkpoint_shape import CheckpointError, ModelShape

# Types whose dequantization is tested against transformers' GGUF loader (tests/test_gguf.py).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizerSpec:
    """What `tokenizer.ggml.*` says: enough to rebuild the byte-level BPE tokenizer."""

    model: str  # "gpt2": byte-level BPE
    pre: str  # the pre-tokenizer's name (llama.cpp's LLAMA_VOCAB_PRE_TYPE_*)
    tokens: list[str]
    merges: list[str]
    token_types: list[int]  # 1 normal, 3 control, 4 user-defined, 6 byte
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """The GGUF file at `path`, parsed once per process while it is unchanged (parsing a
    49k-token vocabulary costs seconds; the engine, its tokenizer and its shape all ask)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        raise CheckpointError(f"{path}: no such GGUF file") from None
    return _open_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    del mtime_ns, size  # part of the key: a rewritten file is parsed again
    return GGUFCheckpoint(path)


class GGUFCheckpoint:
    """A parsed GGUF file (memory-mapped; tensors are read on demand). Prefer `open_gguf`."""

    def __init__(self, path: str | os.PathLike[str]):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises bare ValueError/IndexError/... on bad bytes
            raise CheckpointError(
                f"{self.path}: not a readable GGUF file (truncated or corrupt?): {e}"
            ) from None
        self.architecture = self._string("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: architecture {self.architecture!r} unsupported; "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )
        self._tensors = {}
        for tensor in self._reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                if tensor.name == "rope_freqs.weight":
                    raise CheckpointError(
                        f"{self.path}: has rope_freqs.weight (Llama 3.1 rope scaling baked "
                        "into a tensor), which this engine does not read; use the Hugging "
                        "Face checkpoint instead"
                    )
                raise CheckpointError(
                    f"{self.path}: unexpected tensor {tensor.name!r} for a {self.architecture} model"
                )
            qtype = tensor.tensor_type.name
            if qtype not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {tensor.name} is {qtype}; supported types: "
                    f"{', '.join(SUPPORTED_TYPES)}"
                )
            self._tensors[name] = tensor
        self.shape = self._read_shape()

    # metadata

    def _field(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as e:
            raise CheckpointError(f"{self.path}: metadata {key} unreadable: {e}") from None

    def _string(self, key: str) -> str:
        value = self._field(key)
        if not isinstance(value, str):
            raise CheckpointError(f"{self.path}: metadata {key} missing or not a string")
        return value

    def _arch(self, key: str, default: Any = None, required: bool = False) -> Any:
        value = self._field(f"{self.architecture}.{key}")
        if value is None:
            if required:
                raise CheckpointError(f"{self.path}: metadata {self.architecture}.{key} missing")
            return default
        return value

    def _read_shape(self) -> ModelShape:
        hidden = self._arch("embedding_length", required=True)
        heads = self._arch("attention.head_count", required=True)
        embed = self._tensors.get("embed_tokens.weight")
        if embed is None:
            raise CheckpointError(f"{self.path}: no token_embd.weight tensor")
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._arch("vocab_size") or (
            len(tokens.data) if tokens is not None else int(embed.shape[1])
        )
        scaling = None
        kind = self._arch("rope.scaling.type")
        if kind not in (None, "none"):
            if kind != "linear":
                raise CheckpointError(
                    f"{self.path}: rope scaling {kind!r} unsupported in GGUF; supported: linear"
                )
            scaling = {"rope_type": "linear", "factor": float(self._arch("rope.scaling.factor"))}
        eos = self._field("tokenizer.ggml.eos_token_id")
        try:
            return ModelShape(
                vocab_size=int(vocab),
                hidden_size=int(hidden),
                intermediate_size=int(self._arch("feed_forward_length", required=True)),
                num_layers=int(self._arch("block_count", required=True)),
                num_heads=int(heads),
                num_kv_heads=int(self._arch("attention.head_count_kv", heads)),
                head_dim=int(self._arch("attention.key_length", hidden // heads)),
                max_position_embeddings=int(self._arch("context_length", 4096)),
                rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=float(self._arch("rope.freq_base", 10000.0)),
                rope_scaling=scaling,
                tie_word_embeddings="lm_head.weight" not in self._tensors,
                sliding_window=None,
                bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
                eos_token_ids=() if eos is None else (int(eos),),
                dtype="float32",  # quantized weights are dequantized; fp32 unless asked otherwise
            )
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    @property
    def chat_template(self) -> str | None:
        return self._field("tokenizer.chat_template")

    def tokenizer_spec(self) -> GGUFTokenizerSpec | None:
        """None when the file carries no tokenizer."""
        model = self._field("tokenizer.ggml.model")
        if model is None:
            return None
        return GGUFTokenizerSpec(
            model=model,
            pre=self._field("tokenizer.ggml.pre") or "default",
            tokens=list(self._field("tokenizer.ggml.tokens") or []),
            merges=list(self._field("tokenizer.ggml.merges") or []),
            token_types=list(self._field("tokenizer.ggml.token_type") or []),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(self._field("tokenizer.ggml.add_bos_token")),
        )

    # tensors

    def names(self) -> list[str]:
        """Hugging Face names (without the `model.` prefix) of the tensors in the file."""
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """[out, in] (numpy order) of tensor `name`."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """Tensor `name` (HF name) as float32 [out, in], only rows x cols of it dequantized
        where the quantization blocks allow. q/k rows come back in HF's layout; a row cut
        of q or k must cover whole heads."""
        from gguf.quants import GGML_QUANT_SIZES, dequantize

        tensor = self._tensors[name]
        data = tensor.data
        shape = self.tensor_shape(name)
        if len(shape) == 1:
            return dequantize(data, tensor.tensor_type).astype(np.float32, copy=False).copy()
        if data.shape[0] != shape[0]:
            raise CheckpointError(
                f"{self.path}: tensor {tensor.name} holds {data.shape[0]} rows, its shape says {shape[0]}"
            )
        rows = rows or slice(None)
        cols = cols or slice(None)
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        c0, c1, _ = cols.indices(shape[1])
        part = data[rows]
        if data.dtype == np.uint8 and (c0, c1) != (0, shape[1]) and c0 % block == c1 % block == 0:
            part, cols = part[:, c0 // block * block_bytes : c1 // block * block_bytes], None
        elif data.dtype != np.uint8:
            part, cols = part[:, c0:c1], None
        out = dequantize(np.ascontiguousarray(part), tensor.tensor_type).astype(np.float32)
        if cols is not None:
            out = out[:, c0:c1]
        projection = name.rsplit(".", 2)[-2] if name.startswith("layers.") else ""
        if projection in ("q_proj", "k_proj"):
            out = _unpermute(out, self.shape.head_dim)
        return np.ascontiguousarray(out)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def _unpermute(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved rope order [d/2, 2] back to HF's
    half-split order [2, d/2]."""
    if w.shape[0] % head_dim:
        raise CheckpointError(
            f"a q/k row cut of {w.shape[0]} rows is not whole heads of {head_dim}"
        )
    heads = w.shape[0] // head_dim
    return w.reshape(heads, head_dim // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
