"""Registry validation without etcd: safetensors headers, adapter_config.json, tensor names
and shapes against the base model, tar.gz extraction, and registration paths.

Every refusal must carry the right 4xx and a message naming the problem, and must write
nothing (extraction leaves its destination empty)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import struct
import tarfile
import time
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_model import BASE, SPEC

from loraplex.adapter_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    read_safetensors_header,
    validate_adapter_dir,
)
from loraplex.checkpoint_shape import ModelShape
from loraplex.demo.synthetic import AdapterSpec, ModelSpec, write_adapter, write_checkpoint
from loraplex.errors import AdapterRejected
from loraplex.model_shape import read_model_shape
from loraplex.registry.api_errors import status_code
from loraplex.registry.archives import ArchiveLimits, safe_extract_tar_gz
from loraplex.registry.paths import copy_from_path

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_RANK = 64
MAX_BYTES = 1 << 20


def make_adapter(path: Path, *, rank=8, alpha=16.0, targets=ALL, spec=SPEC, **kwargs) -> Path:
    write_adapter(path, spec, AdapterSpec(path.name, rank, alpha, targets, seed=7), **kwargs)
    return path


def validate(path: Path, *, max_rank=MAX_RANK, max_bytes=MAX_BYTES):
    return validate_adapter_dir(path, BASE, max_rank, max_bytes)


def rejected(path: Path, status: int, match: str, **kwargs) -> AdapterRejected:
    with pytest.raises(AdapterRejected, match=match) as info:
        validate(path, **kwargs)
    assert status_code(info.value) == status, info.value.message
    return info.value


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(config))
    return path


def edit_tensors(path: Path, edit) -> Path:
    from safetensors.torch import load_file

    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE)
    return path


def raw_safetensors(path: Path, header: object, data: bytes = b"", *, length: int | None = None):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


# ---------------------------------------------------------------- accepted adapters


def test_base_shape_from_checkpoint_matches_the_checkpoint_spec(tmp_path):
    spec = ModelSpec(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
    )
    write_checkpoint(tmp_path, spec, with_tokenizer=False)
    shape = read_model_shape(tmp_path)
    assert shape.num_layers == 3 and shape.head_dim == 8
    assert shape.projection_shapes() == spec.projection_shapes()
    # head_dim and num_key_value_heads are optional in older configs
    legacy = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    assert (
        ModelShape.from_config_dict(legacy).projection_shapes()
        == ModelSpec(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
        ).projection_shapes()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_valid_adapter_is_summarized(tmp_path, dtype):
    path = make_adapter(
        tmp_path / "a", rank=12, alpha=24.0, targets=("v_proj", "q_proj", "down_proj"), dtype=dtype
    )
    summary = validate(path)
    assert summary.rank == 12 and summary.alpha == 24.0 and not summary.use_rslora
    assert summary.target_modules == ("q_proj", "v_proj", "down_proj")
    assert (
        summary.dtype == {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    )
    assert summary.size_bytes == sum(p.stat().st_size for p in path.iterdir())
    assert summary.weights_bytes == (path / WEIGHTS_FILE).stat().st_size


def test_rslora_flag_and_pickle_beside_safetensors_is_ignored(tmp_path):
    path = make_adapter(tmp_path / "a")
    edit_config(path, use_rslora=True)
    (path / "adapter_model.bin").write_bytes(b"\x80\x04never opened")
    assert validate(path).use_rslora


# ---------------------------------------------------------------- safetensors header


def test_header_size_bomb_is_refused_without_reading_it(tmp_path):
    path = make_adapter(tmp_path / "a")
    raw_safetensors(path / WEIGHTS_FILE, b"{}", length=1 << 60)
    started = time.perf_counter()
    rejected(path, 400, "header length field says 1152921504606846976 bytes but only 2 follow")
    assert time.perf_counter() - started < 0.5


def test_header_over_the_limit_is_refused(tmp_path):
    path = make_adapter(tmp_path / "a")
    header = b"{" + b" " * (1 << 20) + b"}"
    raw_safetensors(path / WEIGHTS_FILE, header)
    rejected(
        path,
        413,
        "safetensors header of 1048578 bytes exceeds the limit of 1048576",
        max_bytes=4 << 20,
    )


@pytest.mark.parametrize(
    ("header", "data", "status", "match"),
    [
        (b"not json at all", b"", 400, "header is not valid JSON"),
        (b'{"a": 1, "a": 2}', b"", 400, "duplicate key 'a'"),
        ([1, 2], b"", 400, "header must be a JSON object"),
        ({"__metadata__": {"format": 3}}, b"", 400, "__metadata__ must map strings to strings"),
        (
            {"t": {"dtype": "F32", "shape": [2]}},
            b"",
            400,
            "must have exactly dtype, shape and data_offsets",
        ),
        (
            {"t": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}},
            bytes(8),
            422,
            "dtype 'F64'; accepted: F32, F16, BF16",
        ),
        (
            {"t": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}},
            bytes(4),
            422,
            "dtype 'I32'",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}},
            bytes(8),
            400,
            "shape must be a list of non-negative integers",
        ),
        (
            {"t": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
            bytes(4),
            400,
            "shape must be a list",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
            bytes(8),
            400,
            r"data_offsets must be \[begin, end\]",
        ),
        (
            {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            bytes(8),
            400,
            r"spans 8 bytes but F32 \[3\] needs 12",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            400,
            "overlaps the previous tensor",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            bytes(12),
            400,
            "leaves a gap",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            bytes(12),
            400,
            "file is .* bytes but the header accounts for",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            bytes(4),
            400,
            "file is .* bytes but the header accounts for",
        ),
    ],
)
def test_malformed_headers_are_refused(tmp_path, header, data, status, match):
    path = make_adapter(tmp_path / "a")
    raw_safetensors(path / WEIGHTS_FILE, header, data)
    rejected(path, status, match)


def test_header_longer_than_the_file_and_short_files(tmp_path):
    path = make_adapter(tmp_path / "a")
    raw_safetensors(path / WEIGHTS_FILE, b"{}", length=4096)
    rejected(
        path,
        400,
        "is not a safetensors file: its header length field says 4096 bytes but only 2 follow",
    )
    (path / WEIGHTS_FILE).write_bytes(b"\x01\x02")
    rejected(path, 400, "shorter than the 8-byte header length")


def test_header_parser_agrees_with_safetensors(tmp_path):
    make_adapter(tmp_path / "a", dtype=torch.bfloat16)
    from safetensors import safe_open

    start, tensors = read_safetensors_header(tmp_path / "a" / WEIGHTS_FILE)
    with safe_open(str(tmp_path / "a" / WEIGHTS_FILE), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for key in f.keys():
            assert list(f.get_slice(key).get_shape()) == list(tensors[key].shape)
            assert tensors[key].dtype == "BF16"
    assert start > 8


@pytest.mark.parametrize("form", ["zip", "legacy"])
def test_pickled_weights_are_refused(tmp_path, form):
    path = make_adapter(tmp_path / "a")
    tensors = {"w": torch.zeros(2)}
    torch.save(tensors, path / WEIGHTS_FILE, _use_new_zipfile_serialization=form == "zip")
    rejected(path, 422, "looks like a PyTorch pickle")


def test_bin_only_adapter_is_refused(tmp_path):
    path = make_adapter(tmp_path / "a")
    (path / WEIGHTS_FILE).rename(path / "adapter_model.bin")
    rejected(path, 422, r"adapter_model.bin \(pickle\) is refused")


def test_missing_files(tmp_path):
    path = make_adapter(tmp_path / "a")
    (path / WEIGHTS_FILE).unlink()
    rejected(path, 400, f"missing {WEIGHTS_FILE}")
    (path / CONFIG_FILE).unlink()
    rejected(path, 400, f"missing {CONFIG_FILE}")


def test_nan_and_inf_weights_are_refused(tmp_path):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        path = make_adapter(tmp_path / str(dtype), dtype=dtype)

        def poison(tensors, dtype=dtype):
            key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
            tensors[key][3, 1] = math.inf if dtype == torch.float16 else math.nan

        edit_tensors(path, poison)
        rejected(path, 422, "up_proj.lora_B.weight' holds NaN or infinite values")


def test_mixed_dtypes_are_refused(tmp_path):
    path = make_adapter(tmp_path / "a")

    def mix(tensors):
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        tensors[key] = tensors[key].half()

    edit_tensors(path, mix)
    rejected(path, 422, r"mixes dtypes \['F16', 'F32'\]")


def test_size_limit(tmp_path):
    path = make_adapter(tmp_path / "a")
    size = sum(p.stat().st_size for p in path.iterdir())
    assert validate(path, max_bytes=size).size_bytes == size
    rejected(path, 413, f"adapter is {size} bytes; the limit is {size - 1}", max_bytes=size - 1)


# ---------------------------------------------------------------- adapter_config.json


@pytest.mark.parametrize(
    ("changes", "status", "match"),
    [
        ({"peft_type": "IA3"}, 422, "peft_type must be 'LORA', found 'IA3'"),
        ({"peft_type": None}, 422, "peft_type must be 'LORA'"),
        ({"r": True}, 422, "r must be an integer in 1..64 .*found True"),
        ({"r": 8.0}, 422, "r must be an integer in 1..64 .*found 8.0"),
        ({"r": 0}, 422, "r must be an integer in 1..64"),
        (
            {"r": 128},
            422,
            r"r must be an integer in 1..64 \(the server's max_lora_rank\), found 128",
        ),
        ({"lora_alpha": "16"}, 422, "lora_alpha must be a positive finite number, found '16'"),
        ({"lora_alpha": False}, 422, "lora_alpha must be a positive finite number"),
        ({"lora_alpha": 0}, 422, "lora_alpha must be a positive finite number, found 0"),
        ({"target_modules": "q_proj|v_proj"}, 422, "target_modules must be a non-empty list"),
        ({"target_modules": []}, 422, "target_modules must be a non-empty list"),
        (
            {"target_modules": ["q_proj", "embed_tokens", "lm_head"]},
            422,
            r"unsupported target_modules \['embed_tokens', 'lm_head'\]",
        ),
        ({"use_dora": True}, 422, "unsupported options: use_dora"),
        ({"modules_to_save": ["lm_head"]}, 422, "unsupported options: modules_to_save"),
        ({"fan_in_fan_out": True}, 422, "unsupported options: fan_in_fan_out"),
        ({"lora_bias": True}, 422, "unsupported options: lora_bias"),
        ({"bias": "all"}, 422, "unsupported options: bias='all'"),
        ({"rank_pattern": {"q_proj": 4}}, 422, "unsupported options: rank_pattern"),
        ({"alpha_pattern": {"q_proj": 4}}, 422, "unsupported options: alpha_pattern"),
        ({"use_rslora": "yes"}, 422, "use_rslora must be true or false"),
    ],
)
def test_config_refusals(tmp_path, changes, status, match):
    rejected(edit_config(make_adapter(tmp_path / "a"), **changes), status, match)


def test_config_that_is_not_a_json_object(tmp_path):
    path = make_adapter(tmp_path / "a")
    (path / CONFIG_FILE).write_text("{not json")
    rejected(path, 400, f"{CONFIG_FILE} is not valid JSON")
    (path / CONFIG_FILE).write_text("[1]")
    rejected(path, 400, "must hold a JSON object")
    (path / CONFIG_FILE).write_text(" " * (65 << 10))
    rejected(path, 413, f"{CONFIG_FILE} is 66560 bytes; the limit is 65536")


# ---------------------------------------------------------------- tensors against the base model


def test_tensor_shapes_against_a_different_base(tmp_path):
    wider = ModelSpec(
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    path = make_adapter(tmp_path / "a", spec=wider, targets=("q_proj",))
    rejected(
        path,
        422,
        r"q_proj.lora_A.weight' has shape \[8, 96\]; expected \[8, 64\].*q_proj is \[64, 64\]",
    )
    more_heads = ModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    path = make_adapter(tmp_path / "b", spec=more_heads, targets=("k_proj",))
    rejected(path, 422, r"k_proj.lora_B.weight' has shape \[64, 8\]; expected \[32, 8\]")


def test_layer_beyond_the_base_model(tmp_path):
    deeper = ModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = make_adapter(tmp_path / "a", spec=deeper)
    rejected(path, 422, r"layer 2 but the base model has 2 layers \(0..1\)")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.pop("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
            "layer 1 down_proj: lora_B is missing; every lora_A needs its lora_B",
        ),
        (
            lambda t: t.pop("base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"),
            "layer 0 o_proj: lora_A is missing",
        ),
        (
            lambda t: t.update(
                {
                    "base_model.model.model.layers.01.self_attn.q_proj.lora_A.weight": torch.zeros(
                        8, 64
                    )
                }
            ),
            "layers.01.self_attn.q_proj.lora_A.weight' is not a LoRA weight of a Llama projection",
        ),
        (
            lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}),
            "lm_head.lora_A.weight' is not a LoRA weight",
        ),
        (
            lambda t: t.update(
                {"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(8, 64)}
            ),
            "is not a LoRA weight",
        ),
        (
            lambda t: t.update(
                {
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(
                        4, 64
                    )
                }
            ),
            r"has shape \[4, 64\]; expected \[8, 64\] \(r = 8 from adapter_config.json",
        ),
        (
            lambda t: t.update(
                {
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(
                        8, 64, 1
                    )
                }
            ),
            r"has shape \[8, 64, 1\]",
        ),
        (lambda t: t.clear(), "holds no tensors"),
    ],
)
def test_tensor_refusals(tmp_path, edit, match):
    path = make_adapter(tmp_path / "a")
    if match == "holds no tensors":
        raw_safetensors(path / WEIGHTS_FILE, {})
    else:
        edit_tensors(path, edit)
    rejected(path, 422, match)


def test_tensors_must_match_declared_targets_and_rank(tmp_path):
    path = edit_config(
        make_adapter(tmp_path / "a", targets=("q_proj", "v_proj")), target_modules=["q_proj"]
    )
    rejected(path, 422, r"v_proj is not in adapter_config.json target_modules \['q_proj'\]")
    path = edit_config(make_adapter(tmp_path / "b", rank=8), r=16)
    rejected(path, 422, r"has shape \[8, \d+\]; expected \[16, \d+\] \(r = 16")


# ---------------------------------------------------------------- tar.gz archives


def tar_gz(members: list[tuple[tarfile.TarInfo, bytes | None]], *, level: int = 6) -> io.BytesIO:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return io.BytesIO(gzip.compress(raw.getvalue(), compresslevel=level))


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special_member(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info, None


def adapter_members(path: Path, folder: str = "") -> list[tuple[tarfile.TarInfo, bytes]]:
    prefix = f"{folder}/" if folder else ""
    return [
        file_member(prefix + name, (path / name).read_bytes())
        for name in (CONFIG_FILE, WEIGHTS_FILE)
    ]


@pytest.mark.parametrize("folder", ["", "my-adapter", "./nested-dot"])
def test_archive_round_trip(tmp_path, folder):
    src = make_adapter(tmp_path / "src")
    members = adapter_members(src, folder)
    if folder:
        info = tarfile.TarInfo(folder)
        info.type = tarfile.DIRTYPE
        members.insert(0, (info, None))
    dest = tmp_path / "out"
    dest.mkdir()
    safe_extract_tar_gz(tar_gz(members), dest, ArchiveLimits())
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert validate(dest).rank == 8


def archive_refusal_cases(src: Path) -> list[tuple[str, list, int, str]]:
    config, weights = adapter_members(src)
    return [
        (
            "absolute",
            [file_member("/etc/adapter_config.json", b"{}"), weights],
            400,
            "has an absolute path",
        ),
        (
            "dotdot",
            [config, file_member("../adapter_model.safetensors", b"x")],
            400,
            r"contains '\.\.'; path traversal is refused",
        ),
        (
            "dotdot-deep",
            [file_member("a/../../adapter_config.json", b"{}")],
            400,
            "path traversal is refused",
        ),
        ("backslash", [file_member("..\\adapter_config.json", b"{}")], 400, "contains a backslash"),
        (
            "symlink",
            [config, special_member(WEIGHTS_FILE, tarfile.SYMTYPE, "/etc/passwd")],
            400,
            "is a symlink; only regular files",
        ),
        (
            "hardlink",
            [config, special_member(WEIGHTS_FILE, tarfile.LNKTYPE, CONFIG_FILE)],
            400,
            "is a hard link",
        ),
        ("device", [special_member(CONFIG_FILE, tarfile.CHRTYPE)], 400, "is a device or fifo"),
        ("fifo", [special_member(CONFIG_FILE, tarfile.FIFOTYPE)], 400, "is a device or fifo"),
        (
            "extra-file",
            [config, weights, file_member("README.md", b"hi")],
            400,
            "'README.md' is not accepted; an archive holds only",
        ),
        (
            "pickle",
            [config, file_member("adapter_model.bin", b"\x80\x04")],
            422,
            "pickle weights are refused",
        ),
        ("nested", [file_member("a/b/adapter_config.json", b"{}")], 400, "is not accepted"),
        (
            "two-folders",
            [file_member("a/" + CONFIG_FILE, b"{}"), file_member("b/" + WEIGHTS_FILE, b"x")],
            400,
            "files must sit together",
        ),
        (
            "duplicate",
            [config, file_member("./" + CONFIG_FILE, b"{}")],
            400,
            f"holds {CONFIG_FILE} twice",
        ),
        ("missing-weights", [config], 400, f"archive lacks {WEIGHTS_FILE}"),
        (
            "too-many",
            [special_member(".", tarfile.DIRTYPE) for _ in range(9)],
            413,
            "more than 8 members",
        ),
    ]


def test_archive_refusals_write_nothing(tmp_path):
    src = make_adapter(tmp_path / "src")
    for case, members, status, match in archive_refusal_cases(src):
        dest = tmp_path / f"out-{case}"
        dest.mkdir()
        with pytest.raises(AdapterRejected, match=match) as info:
            safe_extract_tar_gz(tar_gz(members), dest, ArchiveLimits())
        assert status_code(info.value) == status, (case, info.value.message)
        assert list(dest.iterdir()) == [], case
    assert not (tmp_path / "adapter_model.safetensors").exists()


class CountingReader(io.RawIOBase):
    def __init__(self, data: bytes):
        self._data, self.consumed = io.BytesIO(data), 0

    def read(self, size=-1):
        chunk = self._data.read(size)
        self.consumed += len(chunk)
        return chunk


def test_gzip_bomb_stops_at_the_limit(tmp_path):
    # 256 MiB of zeros: ~250 KiB of gzip. The extractor must stop after ~1 MiB of output.
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        info = tarfile.TarInfo(WEIGHTS_FILE)
        info.size = 256 << 20
        tf.addfile(info)  # header only; the zeros are streamed below
    header = raw.getvalue()[:512]
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [deflate.compress(header)]
    zeros = bytes(1 << 20)
    for _ in range(256):
        parts.append(deflate.compress(zeros))
    parts.append(deflate.flush())
    bomb = b"".join(parts)
    source = CountingReader(bomb)
    dest = tmp_path / "out"
    dest.mkdir()
    started = time.perf_counter()
    with pytest.raises(AdapterRejected) as info:
        safe_extract_tar_gz(source, dest, ArchiveLimits(max_total_bytes=1 << 20))
    assert status_code(info.value) == 413
    assert "exceed" in info.value.message or "expands past" in info.value.message
    assert list(dest.iterdir()) == []
    assert source.consumed < len(bomb) // 2, (source.consumed, len(bomb))
    assert time.perf_counter() - started < 2


def test_declared_member_size_over_the_limit_is_refused_before_reading(tmp_path):
    info = tarfile.TarInfo(WEIGHTS_FILE)
    info.size = 2 << 20  # claimed; the data never follows
    dest = tmp_path / "out"
    dest.mkdir()
    archive = io.BytesIO(gzip.compress(info.tobuf(tarfile.USTAR_FORMAT)))
    with pytest.raises(AdapterRejected, match="archive contents exceed 1048576 bytes") as err:
        safe_extract_tar_gz(archive, dest, ArchiveLimits(max_total_bytes=1 << 20))
    assert status_code(err.value) == 413
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"definitely not gzip", "not a valid tar.gz"),
        # mtime=0: the header's timestamp is part of the test's id, which every
        # pytest-xdist worker must collect alike
        (gzip.compress(b"x" * 700, mtime=0), "not a valid tar.gz"),
    ],
    ids=["not-gzip", "gzip-of-no-tar"],
)
def test_corrupt_archives(tmp_path, data, match):
    with pytest.raises(AdapterRejected, match=match) as info:
        safe_extract_tar_gz(io.BytesIO(data), tmp_path, ArchiveLimits())
    assert status_code(info.value) == 400


def test_truncated_archive(tmp_path):
    src = make_adapter(tmp_path / "src")
    whole = tar_gz(adapter_members(src)).getvalue()
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(AdapterRejected) as info:
        safe_extract_tar_gz(io.BytesIO(whole[: len(whole) // 2]), dest, ArchiveLimits())
    assert status_code(info.value) == 400
    assert list(dest.iterdir()) == []


# ---------------------------------------------------------------- registration paths


def _copied(path: str, roots: list[str], tenant: str, dest: Path) -> dict[str, bytes]:
    copy_from_path(path, roots, tenant, dest, 1 << 20)
    return {p.name: p.read_bytes() for p in dest.iterdir()}


def test_paths_in_the_tenants_subtree_are_copied(tmp_path):
    root = tmp_path / "root"
    adapter = make_adapter(root / "acme" / "team" / "a")
    expected = {name: (adapter / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}
    assert _copied(str(adapter), [str(root)], "acme", tmp_path / "d1") == expected
    # A Hugging Face cache: snapshot files link to blobs elsewhere in the same subtree.
    blobs, snapshot = root / "acme" / "blobs", root / "acme" / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        blob = blobs / hashlib.sha256(name.encode()).hexdigest()
        blob.write_bytes((adapter / name).read_bytes())
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    roots = [str(tmp_path / "elsewhere"), str(root)]
    assert _copied(str(snapshot), roots, "acme", tmp_path / "d2") == expected
    # An absolute link inside the subtree, and the root named through a link of its own.
    linked = root / "acme" / "linked"
    linked.symlink_to(adapter)
    (tmp_path / "root-link").symlink_to(root)
    assert _copied(str(linked), [str(tmp_path / "root-link")], "acme", tmp_path / "d3") == expected


def test_path_refusals(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    mine = root / "acme"
    make_adapter(mine / "ok")
    theirs = make_adapter(root / "globex" / "theirs")
    secret = make_adapter(outside / "secret")
    (mine / "escape").symlink_to(secret)
    (mine / "to-theirs").symlink_to(os.path.relpath(theirs, mine))
    (mine / "file.txt").write_text("x")
    leaky = mine / "leaky"
    leaky.mkdir()
    (leaky / CONFIG_FILE).write_text("{}")
    (leaky / WEIGHTS_FILE).symlink_to(secret / WEIGHTS_FILE)
    fifo = mine / "fifo"
    fifo.mkdir()
    (fifo / CONFIG_FILE).write_text("{}")
    os.mkfifo(fifo / WEIGHTS_FILE)  # opening it blocking would hang the reader
    loop = mine / "loop"
    loop.mkdir()
    (loop / WEIGHTS_FILE).symlink_to(WEIGHTS_FILE)
    outside_roots = "is not in your folder of an allowed root"
    cases = [
        (str(secret), outside_roots),
        (str(theirs), outside_roots),  # another tenant's subtree
        (str(mine / "escape"), "leads outside the tenant's folder"),
        (str(mine / "to-theirs"), "leads outside the tenant's folder"),
        (f"{mine}/../globex/theirs", "leads outside the tenant's folder"),
        (f"{mine}/ok/../../globex/theirs", "leads outside the tenant's folder"),
        ("relative/path", "must be an absolute path"),
        ("", "must be an absolute path"),
        (str(mine / "missing"), "is not a folder"),
        (str(mine / "file.txt"), "is not a folder"),
        (str(leaky), f"{WEIGHTS_FILE} in .* cannot be opened"),
        (str(fifo), f"{WEIGHTS_FILE} in .* is not a regular file"),
        (str(loop), f"{WEIGHTS_FILE} in .* cannot be opened"),
        (str(tmp_path / "root-sibling" / "acme"), outside_roots),
    ]
    (tmp_path / "root-sibling" / "acme").mkdir(parents=True)  # the root's name as a prefix
    for number, (path, match) in enumerate(cases):
        dest = tmp_path / f"dest-{number}"
        with pytest.raises(AdapterRejected, match=match) as info:
            copy_from_path(path, [str(tmp_path / "hidden"), str(root)], "acme", dest, 1 << 20)
        assert status_code(info.value) == 400, path
        assert "hidden" not in info.value.message, "the allowed roots are not revealed"
        assert not dest.exists() or not list(dest.iterdir()), path
    with pytest.raises(AdapterRejected, match="registration by path is disabled"):
        copy_from_path(str(mine / "ok"), [], "acme", tmp_path / "dest-x", 1 << 20)


def test_a_link_swapped_in_during_the_copy_is_never_followed(tmp_path):
    """The race of issue 14: a file flips between a regular file and a link to a secret
    outside the subtree while registrations read it. Every copy holds the tenant's own bytes
    or is refused with 400; none holds the secret."""
    import threading

    root = tmp_path / "root"
    adapter = make_adapter(root / "acme" / "a")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret " * 100)
    own = (adapter / WEIGHTS_FILE).read_bytes()
    weights = adapter / WEIGHTS_FILE
    stop = threading.Event()

    def flip() -> None:
        tmp = adapter / "next"
        while not stop.is_set():
            tmp.symlink_to(secret)
            os.replace(tmp, weights)
            tmp.write_bytes(own)
            os.replace(tmp, weights)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    outcomes = {"copied": 0, "refused": 0}
    try:
        for attempt in range(200):
            dest = tmp_path / f"d{attempt}"
            try:
                copy_from_path(str(adapter), [str(root)], "acme", dest, 1 << 20)
            except AdapterRejected as e:
                assert status_code(e) == 400
                outcomes["refused"] += 1
                continue
            assert (dest / WEIGHTS_FILE).read_bytes() == own
            outcomes["copied"] += 1
    finally:
        stop.set()
        flipper.join()
    assert outcomes["copied"] and outcomes["refused"], outcomes
