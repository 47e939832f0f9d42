"""Validation of PEFT LoRA adapter folders (load_adapter) and scale folding into Bt.

Every rejection must raise AdapterError naming the problem, and leave the adapter cache and
the pool untouched: nothing registered, no page allocated, nothing written."""

from __future__ import annotations

import functools
import json
import math
import pickle
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_model import SPEC

from loraplex.demo.synthetic import LORA_TARGETS, AdapterSpec, write_adapter
from loraplex.replica.memory.adapter_cache import AdapterCache, CacheConfig
from loraplex.replica.memory.adapters import AdapterError, load_adapter
from loraplex.replica.memory.pool import UnifiedPool
from loraplex.replica.model.config import ModelConfig
from loraplex.replica.model.llama import LlamaModel
from loraplex.replica.model.lora_groups import LORA_GROUPS

SYNC = CacheConfig(loading="sync")  # loads complete inside the call

CONFIG = {
    "model_type": "llama",
    "vocab_size": SPEC.vocab_size,
    "hidden_size": SPEC.hidden_size,
    "intermediate_size": SPEC.intermediate_size,
    "num_hidden_layers": SPEC.num_hidden_layers,
    "num_attention_heads": SPEC.num_attention_heads,
    "num_key_value_heads": SPEC.num_key_value_heads,
    "torch_dtype": "float32",
}
MODEL = ModelConfig.from_dict(CONFIG)
MAX_RANK = 64
PREFIX = "base_model.model.model.layers"
GOOD = AdapterSpec("good", rank=8, alpha=16.0, targets=LORA_TARGETS, seed=3)


def key(layer: int, target: str, which: str) -> str:
    block = "self_attn" if target in LORA_TARGETS[:4] else "mlp"
    return f"{PREFIX}.{layer}.{block}.{target}.lora_{which}.weight"


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    """A valid rank-8 adapter on all seven projections; tests break one thing in it."""
    out = tmp_path / "adapter"
    write_adapter(out, SPEC, GOOD, vocab_size=SPEC.vocab_size)
    return out


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path / "adapter_model.safetensors"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def assert_rejected(path: Path, *fragments: str, max_rank: int = MAX_RANK) -> str:
    """load_adapter + register must fail with every fragment in the message, and leave a
    fresh cache and pool exactly as they were."""
    pool = UnifiedPool(32, 4096, MODEL.dtype, torch.device("cpu"))
    columns = functools.partial(LlamaModel.output_columns, SimpleNamespace(cfg=MODEL))
    cache = AdapterCache(pool, MODEL, columns, config=SYNC)
    before = pool.stats()
    with pytest.raises(AdapterError) as info:
        cache.add(load_adapter(path, "bad", MODEL, max_rank))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "bad" not in cache and not cache.host and not cache.resident
    assert pool.stats() == before and pool.num_free == pool.num_pages
    assert not pool.arena.any()
    pool.check_invariants()
    return message


# --- shapes and names ---------------------------------------------------------------------------


def test_wrong_shape_of_lora_a_names_tensor_and_shapes(adapter_dir):
    t = tensors_of(adapter_dir)
    t[key(1, "k_proj", "A")] = torch.randn(8, 63)
    write_tensors(adapter_dir, t)
    assert_rejected(
        adapter_dir, "layers.1.self_attn.k_proj.lora_A", "has shape [8, 63]", "expected [8, 64]"
    )


def test_wrong_shape_of_lora_b_names_tensor_and_shapes(adapter_dir):
    t = tensors_of(adapter_dir)
    t[key(0, "down_proj", "B")] = torch.randn(65, 8)  # down_proj writes hidden (64) columns
    write_tensors(adapter_dir, t)
    assert_rejected(
        adapter_dir, "layers.0.mlp.down_proj.lora_B", "has shape [65, 8]", "expected [64, 8]"
    )


def test_transposed_lora_b_is_refused(adapter_dir):
    t = tensors_of(adapter_dir)
    t[key(0, "gate_proj", "B")] = t[key(0, "gate_proj", "B")].T.contiguous()  # [8, 128]
    write_tensors(adapter_dir, t)
    assert_rejected(
        adapter_dir, "layers.0.mlp.gate_proj.lora_B", "has shape [8, 128]", "expected [128, 8]"
    )


def test_a_b_rank_mismatch(adapter_dir):
    t = tensors_of(adapter_dir)
    t[key(1, "v_proj", "B")] = torch.randn(32, 4)  # A is rank 8
    write_tensors(adapter_dir, t)
    assert_rejected(
        adapter_dir, "layers.1.self_attn.v_proj.lora_B", "has shape [32, 4]", "expected [32, 8]"
    )


def test_lora_a_with_wrong_number_of_dims(adapter_dir):
    t = tensors_of(adapter_dir)
    t[key(0, "q_proj", "A")] = torch.randn(8 * 64)
    write_tensors(adapter_dir, t)
    assert_rejected(adapter_dir, "layers.0.self_attn.q_proj.lora_A", "has shape [512]")


@pytest.mark.parametrize("which", ["A", "B"])
def test_missing_half_of_a_pair(adapter_dir, which):
    t = tensors_of(adapter_dir)
    del t[key(1, "up_proj", which)]
    write_tensors(adapter_dir, t)
    assert_rejected(adapter_dir, "layer 1 up_proj", "is missing")


def test_rank_in_config_above_max_rank(adapter_dir):
    assert_rejected(adapter_dir, "r must be an integer in 1..4", "found 8", max_rank=4)


def test_tensor_rank_above_max_rank(adapter_dir):
    edit_config(adapter_dir, r=4)  # the config claims 4; the tensors are rank 8
    msg = assert_rejected(adapter_dir, "lora_A.weight' has shape [8, ", "expected [4, ", max_rank=4)
    assert "layers.0." in msg, msg


def test_layer_beyond_the_model(adapter_dir):
    t = tensors_of(adapter_dir)
    t[key(2, "q_proj", "A")] = torch.randn(8, 64)
    t[key(2, "q_proj", "B")] = torch.randn(64, 8)
    write_tensors(adapter_dir, t)
    assert_rejected(adapter_dir, "layers.2.self_attn.q_proj.lora_", "layer 2", "base model has 2")


@pytest.mark.parametrize(
    "bad_key",
    [
        "base_model.model.model.embed_tokens.lora_A.weight",  # unknown target module
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.rotary_emb.lora_A.weight",
        # PEFT's in-memory name, with the adapter name in it
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "model.layers.0.self_attn.q_proj.lora_A.weight",  # missing PEFT prefix
        "base_model.model.model.layers.0.self_attn.q_proj.lora_C.weight",
        "base_model.model.model.layers.x.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.weight",  # a base weight
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",  # q_proj is not in mlp
        "base_model.model.model.layers.0.self_attn.gate_proj.lora_A.weight",
        "base_model.model.model.layers.01.self_attn.q_proj.lora_A.weight",  # would alias layer 1
    ],
)
def test_tensor_name_not_a_lora_projection_weight(adapter_dir, bad_key):
    t = tensors_of(adapter_dir)
    t[bad_key] = torch.randn(8, 64)
    write_tensors(adapter_dir, t)
    assert_rejected(adapter_dir, repr(bad_key), "is not a LoRA weight")


def test_config_rank_disagreeing_with_tensors(adapter_dir):
    edit_config(adapter_dir, r=32)  # PEFT would scale by alpha / 32, the tensors have rank 8
    assert_rejected(adapter_dir, "has shape [8, ", "r = 32 from adapter_config.json")


@pytest.mark.parametrize("field", ["r", "lora_alpha"])
def test_boolean_rank_or_alpha(adapter_dir, field):
    edit_config(adapter_dir, **{field: True})
    assert_rejected(adapter_dir, field)


def test_tensor_outside_declared_target_modules(adapter_dir):
    edit_config(adapter_dir, target_modules=["q_proj", "v_proj"])
    assert_rejected(
        adapter_dir, "is not in adapter_config.json target_modules", "['q_proj', 'v_proj']"
    )


def test_non_finite_weights(adapter_dir):
    t = tensors_of(adapter_dir)
    t[key(1, "down_proj", "B")][0, 0] = float("nan")
    write_tensors(adapter_dir, t)
    assert_rejected(adapter_dir, "layers.1.mlp.down_proj", "NaN or infinite")


def test_no_lora_weights_at_all(adapter_dir):
    write_tensors(adapter_dir, {})
    assert_rejected(adapter_dir, "holds no tensors")


# --- files and config ---------------------------------------------------------------------------


class _Bomb:
    """Unpickling this creates `marker`: the test fails if anything ever unpickles the .bin."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_bin_only_is_refused_and_never_unpickled(adapter_dir, tmp_path):
    (adapter_dir / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (adapter_dir / "adapter_model.bin").write_bytes(pickle.dumps(_Bomb(marker)))
    assert_rejected(
        adapter_dir, "adapter_model.bin (pickle) is refused", "adapter_model.safetensors"
    )
    assert not marker.exists(), "adapter_model.bin was unpickled"


def test_bin_of_arbitrary_bytes_is_refused(adapter_dir):
    (adapter_dir / "adapter_model.safetensors").unlink()
    (adapter_dir / "adapter_model.bin").write_bytes(b"\x80\x04garbage, not a pickle")
    assert_rejected(adapter_dir, "adapter_model.bin (pickle) is refused")


def test_missing_weights_file(adapter_dir):
    (adapter_dir / "adapter_model.safetensors").unlink()
    msg = assert_rejected(adapter_dir, "adapter_model.safetensors")
    assert ".bin" not in msg


def test_missing_adapter_config(adapter_dir):
    (adapter_dir / "adapter_config.json").unlink()
    assert_rejected(adapter_dir, "missing adapter_config.json", "PEFT LoRA adapter")


def test_invalid_json(adapter_dir):
    (adapter_dir / "adapter_config.json").write_text('{"r": 8, "lora_alpha": ')
    assert_rejected(adapter_dir, "adapter_config.json is not valid JSON")


def test_json_that_is_not_an_object(adapter_dir):
    (adapter_dir / "adapter_config.json").write_text("[8, 16]")
    assert_rejected(adapter_dir, "must hold a JSON object")


@pytest.mark.parametrize("r", ["8", 8.0, 0, -8, None, [8]])
def test_r_not_a_positive_int(adapter_dir, r):
    edit_config(adapter_dir, r=r)
    assert_rejected(adapter_dir, "r must be an integer", f"found {r!r}")


def test_r_missing(adapter_dir):
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    del cfg["r"]
    (adapter_dir / "adapter_config.json").write_text(json.dumps(cfg))
    assert_rejected(adapter_dir, "r must be an integer", "found None")


def test_lora_alpha_not_a_number(adapter_dir):
    edit_config(adapter_dir, lora_alpha="16")
    assert_rejected(adapter_dir, "lora_alpha must be a positive finite number", "found '16'")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("fan_in_fan_out", True),
        ("rank_pattern", {"q_proj": 4}),
        ("alpha_pattern", {"q_proj": 4}),
        ("bias", "all"),
    ],
)
def test_unsupported_options(adapter_dir, option, value):
    edit_config(adapter_dir, **{option: value})
    assert_rejected(adapter_dir, "unsupported options", option)


def test_not_lora_peft_type(adapter_dir):
    edit_config(adapter_dir, peft_type="IA3")
    assert_rejected(adapter_dir, "peft_type must be 'LORA'", "'IA3'")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.bool, torch.float64])
def test_non_float_dtype(adapter_dir, dtype):
    t = tensors_of(adapter_dir)
    name = key(0, "o_proj", "A")
    t[name] = t[name].to(dtype)
    write_tensors(adapter_dir, t)
    assert_rejected(adapter_dir, repr(name), "has dtype", "accepted: F32, F16, BF16")


def test_truncated_safetensors(adapter_dir):
    path = adapter_dir / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert_rejected(adapter_dir, "adapter_model.safetensors")


def test_truncated_inside_header(adapter_dir):
    path = adapter_dir / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:20])
    assert_rejected(adapter_dir, "adapter_model.safetensors")


def _with_header(header: dict) -> bytes:
    """A safetensors header with no data after it: every tensor's offsets run past the end."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    "payload",
    [
        b"\xde\xad\xbe\xef" * 64,  # garbage: a huge header length
        struct.pack("<Q", 12) + b"not json!!!!",  # header of the right length, not JSON
        struct.pack("<Q", 2) + b"[]",  # JSON, not an object
        _with_header(
            {key(0, "q_proj", "A"): {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 2048]}}
        ),
    ],
)
def test_garbage_safetensors(adapter_dir, payload):
    (adapter_dir / "adapter_model.safetensors").write_bytes(payload)
    assert_rejected(adapter_dir, "adapter_model.safetensors")


def test_empty_safetensors_file(adapter_dir):
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"")
    assert_rejected(adapter_dir, "adapter_model.safetensors", "adapter_model.safetensors")


def test_weights_path_is_a_folder(adapter_dir):
    (adapter_dir / "adapter_model.safetensors").unlink()
    (adapter_dir / "adapter_model.safetensors").mkdir()
    assert_rejected(adapter_dir, "adapter_model.safetensors")


def test_path_is_not_a_folder(adapter_dir, tmp_path):
    assert_rejected(adapter_dir / "adapter_config.json", "is not a folder")
    assert_rejected(tmp_path / "does-not-exist", "is not a folder")


# --- good adapters: the scale is folded into Bt ---------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "scale"),
    [
        (AdapterSpec("plain", rank=8, alpha=16.0, targets=LORA_TARGETS, seed=1), 16.0 / 8),
        (AdapterSpec("odd", rank=7, alpha=3.0, targets=("q_proj", "down_proj"), seed=2), 3.0 / 7),
        (
            AdapterSpec(
                "rs", rank=16, alpha=8.0, targets=LORA_TARGETS[:4], seed=3, use_rslora=True
            ),
            8.0 / 4.0,
        ),
        (
            AdapterSpec(
                "rs7", rank=7, alpha=5.0, targets=("v_proj", "up_proj"), seed=4, use_rslora=True
            ),
            5.0 / math.sqrt(7),
        ),
    ],
    ids=lambda v: v.name if isinstance(v, AdapterSpec) else None,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_is_folded_into_bt(tmp_path, spec, scale, dtype):
    out = tmp_path / spec.name
    write_adapter(out, SPEC, spec, vocab_size=SPEC.vocab_size)
    assert spec.scaling == pytest.approx(scale)
    model = ModelConfig.from_dict(CONFIG, dtype)
    w = load_adapter(out, spec.name, model, MAX_RANK)
    raw = tensors_of(out)
    expected_targets = tuple(t for t in LORA_TARGETS if t in spec.targets)
    assert w.name == spec.name and w.rank == spec.rank and w.targets == expected_targets
    assert set(w.modules) == {
        (layer, t) for layer in range(SPEC.num_hidden_layers) for t in expected_targets
    }
    shapes = model.projection_shapes()
    for (layer, target), (a, bt) in w.modules.items():
        a_file, b_file = raw[key(layer, target, "A")], raw[key(layer, target, "B")]
        fan_in, fan_out = shapes[target].in_features, shapes[target].out_features
        assert a.shape == (spec.rank, fan_in) and bt.shape == (spec.rank, fan_out)
        assert a.dtype == bt.dtype == dtype and a.is_contiguous() and bt.is_contiguous()
        assert torch.equal(a, a_file.to(dtype))
        assert torch.equal(bt, (b_file.T * scale).to(dtype)), (
            f"layers.{layer}.{target}: Bt != scale * B.T"
        )
        # and the fold is what LoRA computes: x @ A.T @ (scale * B.T) == scale * (B @ A @ x)
        if dtype == torch.float32:
            x = torch.randn(3, fan_in)
            torch.testing.assert_close(x @ a.T @ bt, scale * (x @ a_file.T @ b_file.T))
    assert w.nbytes == sum(a.nbytes + bt.nbytes for a, bt in w.modules.values())


def test_missing_lora_alpha_is_refused(adapter_dir):
    # PEFT would silently fall back to its default alpha (8), which is rarely what was
    # trained: the scale must be stated.
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (adapter_dir / "adapter_config.json").write_text(json.dumps(cfg))
    assert_rejected(adapter_dir, "lora_alpha must be a positive finite number", "found None")


def test_good_adapter_registers_and_loads_into_the_pool(adapter_dir):
    pool = UnifiedPool(32, 4096, MODEL.dtype, torch.device("cpu"))
    columns = functools.partial(LlamaModel.output_columns, SimpleNamespace(cfg=MODEL))
    cache = AdapterCache(pool, MODEL, columns, config=SYNC)
    w = load_adapter(adapter_dir, "good", MODEL, MAX_RANK)
    cache.add(w)
    assert "good" in cache and pool.num_free == pool.num_pages  # registering takes no pages
    r = cache.acquire("good")
    assert r is not None and pool.num_free == pool.num_pages - len(r.pages)
    for (layer, target), (a, bt) in w.modules.items():
        group = next(g for g, targets in LORA_GROUPS.items() if target in targets)
        gw = r.groups[layer][group]
        out = next(o for o in gw.outs if (o.col_start, o.col_end) == columns(group)[target])
        assert torch.equal(torch.cat(gw.a)[out.h_start : out.h_end], a)
        assert torch.equal(torch.cat(out.bt), bt)
    cache.release(r)
    cache.remove("good")
    assert pool.num_free == pool.num_pages


def test_an_adapter_load_plans_its_layout_once(assets, monkeypatch: pytest.MonkeyPatch):
    """Registering an adapter and serving a request with it lays it out in pages once (the
    page count checked at read, by the cache and in the reply, the placement)."""
    from loraplex.replica import memory
    from loraplex.replica.config import EngineConfig
    from loraplex.replica.engine import LLMEngine
    from loraplex.replica.memory.pool import RowPacker
    from loraplex.replica.sampling import SamplingParams

    plans = []

    class CountingPacker(RowPacker):
        def __init__(self, page_elems: int):
            plans.append(page_elems)
            super().__init__(page_elems)

    monkeypatch.setattr(memory.adapters, "RowPacker", CountingPacker)
    engine = LLMEngine(
        EngineConfig(model=str(assets.model), page_bytes=64 * 1024, pool_bytes=512 * 64 * 1024)
    )
    engine.add_adapter("sql-r8", assets.adapters_dir / "sql-r8")
    [out] = engine.generate(["SELECT"], [SamplingParams(max_tokens=3, temperature=0)], ["sql-r8"])
    assert len(out.token_ids) == 3 and len(engine.adapters.resident) == 1
    assert len(plans) == 1
