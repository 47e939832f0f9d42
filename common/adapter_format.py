"""The adapter format, shared by the registry (which accepts adapters) and the engine (which
loads them): a PEFT LoRA adapter folder's file names, its safetensors header reader (never
pickle), the checks of adapter_config.json and of tensor names and shapes against the base
model, the limits (`AdapterLimits`), and an artifact's digest. (Archives and registration
paths: registry/archives.py and registry/paths.py.)

Every rejection is an `AdapterRejected` (common/errors.py) whose message names what was
wrong and what is accepted: `Invalid` for input that cannot be read (bad JSON, a corrupt
header), `TooLarge` for input over a size limit, `Unacceptable` for a well-formed adapter the
server does not accept (unsupported options, rank, dtype, shapes against the base model).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from loraplex import strict_json
from loraplex.checkpoint_shape import ModelShape
from loraplex.errors import Invalid, TooLarge, Unacceptable

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_WEIGHTS_FILE = "adapter_model.bin"

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# Exponent field of each float format: all ones marks NaN or infinity.
_EXPONENT_MASKS = {
    "F32": (np.uint32, 0x7F800000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
}

MAX_HEADER_BYTES = 1 << 20  # a LoRA header lists 2 * layers * 7 tensors: ~100 B each
MAX_CONFIG_BYTES = 64 << 10
_FINITE_CHUNK_BYTES = 4 << 20

TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(0|[1-9]\d*)\."
    r"(?:self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
    r"\.lora_([AB])\.weight$"
)
_TENSOR_NAME_FORMS = (
    "base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight or "
    "base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight"
)
# Options PEFT writes that change what the tensors mean; loraplex serves plain LoRA only.
_UNSUPPORTED_WHEN_SET = (
    "use_dora",
    "modules_to_save",
    "fan_in_fan_out",
    "lora_bias",
    "rank_pattern",
    "alpha_pattern",
)


SHOWN_CHARS = 100


def shown(value: object) -> str:
    """`repr(value)` for a message, cut to SHOWN_CHARS: a name or value from an upload may be
    megabytes long, and a refusal must not echo it back."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset of the data from the end of the header
    end: int


@dataclass(frozen=True, slots=True)
class AdapterSummary:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # modules that have tensors, in TARGET_MODULES order
    use_rslora: bool
    dtype: str  # safetensors dtype name: F32, F16 or BF16
    size_bytes: int  # adapter_config.json + adapter_model.safetensors
    weights_bytes: int  # adapter_model.safetensors alone


class AdapterLimits(BaseModel):
    """Which adapters are accepted: by the tenant API at registration, and again by every
    engine that loads one."""

    model_config = ConfigDict(extra="forbid")

    max_lora_rank: int = Field(
        128,
        ge=1,
        le=1024,
        description="Largest LoRA rank accepted; the engine sizes its LoRA buffers for it.",
    )


def contents_digest(contents: dict[str, bytes]) -> str:
    """An artifact's digest (`frame_digest`) of adapter file contents already read: what was
    read is what is hashed."""
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        frame_digest(digest, name, len(contents[name]))
        digest.update(contents[name])
    return digest.hexdigest()


def frame_digest(digest: hashlib._Hash, name: str, size: int) -> None:
    """An artifact's digest is a sha256 over its files in canonical (sorted) order, each
    framed as `name NUL size(8 bytes, little-endian) content`, so no two file sets share it."""
    digest.update(name.encode() + b"\0" + size.to_bytes(8, "little"))


# ---------------------------------------------------------------- safetensors header


def read_safetensors_header(
    path: Path, *, max_header_bytes: int = MAX_HEADER_BYTES
) -> tuple[int, dict[str, TensorInfo]]:
    """Parse and check the header of a safetensors file without reading its data.

    Returns (data start offset, tensors). The data must be exactly the tensors' bytes,
    contiguous in offset order, and the file must end where the data ends."""
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise Invalid(
                f"{path.name} is not a safetensors file: {file_size} bytes, shorter than the 8-byte header length"
            )
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > max_header_bytes or 8 + header_len > file_size:
            _refuse_pickle(path.name, prefix)
        # The file bounds the header first: a forged length (2**60) costs nothing to refuse.
        if 8 + header_len > file_size:
            raise Invalid(
                f"{path.name} is not a safetensors file: its header length field says {header_len} bytes but only {file_size - 8} follow"
            )
        if header_len > max_header_bytes:
            raise TooLarge(
                f"{path.name}: safetensors header of {header_len} bytes exceeds the limit of {max_header_bytes}"
            )
        raw = f.read(header_len)
    try:
        header = strict_json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _refuse_pickle(path.name, prefix)
        raise Invalid(
            f"{path.name}: safetensors header is not valid JSON: {_json_problem(e)}"
        ) from None
    if not isinstance(header, dict):
        raise Invalid(f"{path.name}: safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise Invalid(f"{path.name}: safetensors __metadata__ must map strings to strings")
    tensors = {name: _tensor_info(path.name, name, entry) for name, entry in header.items()}
    data_len = _check_layout(path.name, tensors)
    if file_size != 8 + header_len + data_len:
        raise Invalid(
            f"{path.name}: file is {file_size} bytes but the header accounts for "
            f"{8 + header_len + data_len} (8 + {header_len} header + {data_len} data)"
        )
    return 8 + header_len, tensors


def _refuse_pickle(file: str, prefix: bytes) -> None:
    """torch.save writes a zip (PK\\x03\\x04) or a raw pickle (\\x80, protocol 2..5). Checked only
    once the prefix failed as a safetensors header length, which it may legitimately resemble."""
    if prefix.startswith(b"PK\x03\x04") or (prefix[0] == 0x80 and 2 <= prefix[1] <= 5):
        raise Unacceptable(
            f"{file} looks like a PyTorch pickle (torch.save / .bin); only safetensors is accepted"
        )


def _json_problem(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return str(error)[:200]


def _tensor_info(file: str, name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise Invalid(
            f"{file}: tensor {shown(name)} must have exactly dtype, shape and data_offsets"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise Unacceptable(
            f"{file}: tensor {shown(name)} has dtype {shown(dtype)}; accepted: {', '.join(DTYPE_BYTES)}"
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise Invalid(
            f"{file}: tensor {shown(name)} shape must be a list of non-negative integers, found {shown(shape)}"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise Invalid(
            f"{file}: tensor {shown(name)} data_offsets must be [begin, end] with 0 <= begin <= end, found {shown(offsets)}"
        )
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise Invalid(
            f"{file}: tensor {shown(name)} spans {end - begin} bytes but {dtype} {shown(shape)} needs {expected}"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def _check_layout(file: str, tensors: dict[str, TensorInfo]) -> int:
    """Tensors must tile the data region exactly: no gaps, no overlaps (aliasing)."""
    position = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != position:
            problem = "overlaps the previous tensor" if info.begin < position else "leaves a gap"
            raise Invalid(
                f"{file}: tensor {shown(name)} data_offsets {[info.begin, info.end]} {problem} (expected to start at {position})"
            )
        position = info.end
    return position


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_finite(path: Path, data_start: int, tensors: dict[str, TensorInfo]) -> None:
    """Refuse NaN or infinite weights, reading the data as raw integers (no deserializer)."""
    with path.open("rb") as f:
        for name, info in tensors.items():
            int_type, mask = _EXPONENT_MASKS[info.dtype]
            f.seek(data_start + info.begin)
            remaining = info.end - info.begin
            while remaining:
                chunk = f.read(min(remaining, _FINITE_CHUNK_BYTES))
                if not chunk:
                    raise Invalid(f"{path.name}: file ends inside tensor {shown(name)}")
                remaining -= len(chunk)
                words = np.frombuffer(chunk, dtype=np.dtype(int_type).newbyteorder("<"))
                if np.any((words & mask) == mask):
                    raise Unacceptable(
                        f"{path.name}: tensor {shown(name)} holds NaN or infinite values"
                    )


# ---------------------------------------------------------------- adapter_config.json


def read_adapter_config(path: Path, *, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    size = path.stat().st_size
    if size > max_bytes:
        raise TooLarge(f"{CONFIG_FILE} is {size} bytes; the limit is {max_bytes}")
    try:
        cfg = strict_json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Invalid(f"{CONFIG_FILE} is not valid JSON: {_json_problem(e)}") from None
    if not isinstance(cfg, dict):
        raise Invalid(f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def check_adapter_config(
    cfg: dict[str, Any], max_rank: int
) -> tuple[int, float, tuple[str, ...], bool]:
    """(r, lora_alpha, target_modules, use_rslora) of a plain-LoRA PEFT config."""
    if cfg.get("peft_type") != "LORA":
        raise Unacceptable(
            f"{CONFIG_FILE}: peft_type must be 'LORA', found {shown(cfg.get('peft_type'))}"
        )
    set_options = [key for key in _UNSUPPORTED_WHEN_SET if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        set_options.append(f"bias={shown(cfg['bias'])}")
    if set_options:
        raise Unacceptable(
            f"{CONFIG_FILE} sets unsupported options: {', '.join(set_options)}; loraplex serves plain "
            "LoRA (no DoRA, modules_to_save, fan_in_fan_out, lora_bias, rank/alpha patterns; bias 'none')"
        )
    r = cfg.get("r")
    if not _is_int(r) or not 1 <= r <= max_rank:
        raise Unacceptable(
            f"{CONFIG_FILE}: r must be an integer in 1..{max_rank} (the server's max_lora_rank), found {shown(r)}"
        )
    alpha = cfg.get("lora_alpha")
    if (
        not isinstance(alpha, int | float)
        or isinstance(alpha, bool)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise Unacceptable(
            f"{CONFIG_FILE}: lora_alpha must be a positive finite number, found {shown(alpha)}"
        )
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise Unacceptable(
            f"{CONFIG_FILE}: target_modules must be a non-empty list of module names "
            f"(a subset of {list(TARGET_MODULES)}), found {shown(targets)}"
        )
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise Unacceptable(
            f"{CONFIG_FILE}: unsupported target_modules {shown(unknown)}; accepted: {list(TARGET_MODULES)}"
        )
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise Unacceptable(
            f"{CONFIG_FILE}: use_rslora must be true or false, found {shown(rslora)}"
        )
    return r, float(alpha), tuple(t for t in TARGET_MODULES if t in targets), rslora


# ---------------------------------------------------------------- the adapter folder


def validate_adapter_dir(
    path: Path, base: ModelShape, max_rank: int, max_bytes: int
) -> AdapterSummary:
    """Check a PEFT adapter folder against the base model. Reads the config, the safetensors
    header and the raw weight bits (for NaN/inf); never unpickles anything."""
    path = Path(path)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file():
        raise Invalid(
            f"missing {CONFIG_FILE}; a PEFT LoRA adapter has {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    if not weights_path.is_file():
        if (path / PICKLE_WEIGHTS_FILE).exists():
            raise Unacceptable(
                f"{PICKLE_WEIGHTS_FILE} (pickle) is refused; save the adapter with safetensors ({WEIGHTS_FILE})"
            )
        raise Invalid(
            f"missing {WEIGHTS_FILE}; a PEFT LoRA adapter has {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    size = config_path.stat().st_size + weights_path.stat().st_size
    if size > max_bytes:
        raise TooLarge(f"adapter is {size} bytes; the limit is {max_bytes} (max_adapter_bytes)")

    rank, alpha, declared, rslora = check_adapter_config(read_adapter_config(config_path), max_rank)
    data_start, tensors = read_safetensors_header(weights_path)
    targets = _check_tensors(tensors, base, rank, declared)
    dtypes = sorted({info.dtype for info in tensors.values()})
    if len(dtypes) > 1:
        raise Unacceptable(
            f"{WEIGHTS_FILE} mixes dtypes {dtypes}; an adapter must use one of {list(DTYPE_BYTES)} throughout"
        )
    check_finite(weights_path, data_start, tensors)
    weights_bytes = weights_path.stat().st_size
    return AdapterSummary(rank, alpha, targets, rslora, dtypes[0], size, weights_bytes)


def _check_tensors(
    tensors: dict[str, TensorInfo], base: ModelShape, rank: int, declared: tuple[str, ...]
) -> tuple[str, ...]:
    if not tensors:
        raise Unacceptable(f"{WEIGHTS_FILE} holds no tensors")
    shapes = base.projection_shapes()
    pairs: dict[tuple[int, str], set[str]] = {}
    for name, info in tensors.items():
        m = TENSOR_NAME.match(name)
        if m is None:
            raise Unacceptable(
                f"tensor {shown(name)} is not a LoRA weight of a Llama projection; expected {_TENSOR_NAME_FORMS}"
            )
        layer, target, which = int(m[1]), m[2] or m[3], m[4]
        if layer >= base.num_layers:
            raise Unacceptable(
                f"tensor {shown(name)}: layer {layer} but the base model has {base.num_layers} layers (0..{base.num_layers - 1})"
            )
        if target not in declared:
            raise Unacceptable(
                f"tensor {shown(name)}: {target} is not in {CONFIG_FILE} target_modules {list(declared)}"
            )
        out_features, in_features = shapes[target]
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if info.shape != expected:
            raise Unacceptable(
                f"tensor {shown(name)} has shape {list(info.shape)}; expected {list(expected)} "
                f"(r = {rank} from {CONFIG_FILE}, {target} is [{out_features}, {in_features}] in the base model)"
            )
        pairs.setdefault((layer, target), set()).add(which)
    for (layer, target), present in sorted(pairs.items()):
        if present != {"A", "B"}:
            missing = "lora_B" if "A" in present else "lora_A"
            raise Unacceptable(
                f"layer {layer} {target}: {missing} is missing; every lora_A needs its lora_B"
            )
    found = {target for _, target in pairs}
    return tuple(t for t in TARGET_MODULES if t in found)
