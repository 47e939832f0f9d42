import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from loraplex.demo.assets import DemoAssets
from loraplex.demo.synthetic import (
    ATTENTION_TARGETS,
    LORA_DELTA_RATIO,
    LORA_TARGETS,
    MLP_TARGETS,
    SYNTHETIC_ADAPTERS,
    SYNTHETIC_MODEL,
    AdapterSpec,
    ModelSpec,
    make_synthetic_assets,
    write_adapter,
    write_checkpoint,
)
from loraplex.demo.synthetic_tokenizer import (
    BOS_TOKEN,
    END_HEADER_TOKEN,
    EOT_TOKEN,
    START_HEADER_TOKEN,
)

PROMPTS = ("The capital of France is", "Once upon a time there was")
SMALL = ModelSpec(vocab_size=320, num_hidden_layers=2)
GQA = ModelSpec(
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    vocab_size=300,
)
TOKEN_IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 299, 2, 64, 128]])


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    return make_synthetic_assets(tmp_path_factory.mktemp("demo"))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_make_demo_assets_is_byte_identical_and_idempotent(assets: DemoAssets, tmp_path: Path):
    first = _tree_bytes(assets.model.parent)
    again = make_synthetic_assets(tmp_path, progress=lambda _message: None)
    assert _tree_bytes(tmp_path) == first
    make_synthetic_assets(tmp_path)
    assert _tree_bytes(tmp_path) == first
    assert again.adapter_names == tuple(a.name for a in SYNTHETIC_ADAPTERS)


def test_tokenizer_training_is_identical_in_a_fresh_process(assets: DemoAssets, tmp_path: Path):
    script = (
        "import sys; from pathlib import Path;"
        "from loraplex.demo.synthetic import write_tokenizer;"
        "write_tokenizer(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (assets.model / name).read_bytes()


def test_demo_adapters_cover_ranks_targets_and_rslora():
    ranks = [a.rank for a in SYNTHETIC_ADAPTERS]
    assert len(SYNTHETIC_ADAPTERS) >= 8
    assert len({a.name for a in SYNTHETIC_ADAPTERS}) == len(SYNTHETIC_ADAPTERS)
    assert min(ranks) == 8 and max(ranks) == 64
    assert any(a.use_rslora for a in SYNTHETIC_ADAPTERS)
    target_sets = {frozenset(a.targets) for a in SYNTHETIC_ADAPTERS}
    assert {frozenset(ATTENTION_TARGETS), frozenset(MLP_TARGETS), frozenset(LORA_TARGETS)} <= (
        target_sets
    )
    assert len({a.alpha for a in SYNTHETIC_ADAPTERS}) > 3


@pytest.mark.parametrize(
    "text", ["hi", "naïve café — 🚀 ok", "\x00\x7f control", "def f(x):\n    return {'a': x}\n"]
)
def test_tokenizer_prepends_bos_and_round_trips(assets: DemoAssets, text: str):
    tokenizer = Tokenizer.from_file(str(assets.model / "tokenizer.json"))
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == tokenizer.token_to_id(BOS_TOKEN)
    assert BOS_TOKEN not in tokenizer.decode(encoding.ids[1:], skip_special_tokens=False)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == text


def test_tokenizer_vocab_and_special_tokens(assets: DemoAssets):
    tokenizer = Tokenizer.from_file(str(assets.model / "tokenizer.json"))
    config = json.loads((assets.model / "config.json").read_text())
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert 1000 <= vocab_size <= 2000
    assert config["vocab_size"] == vocab_size
    assert config["bos_token_id"] == tokenizer.token_to_id(BOS_TOKEN)
    assert config["eos_token_id"] == tokenizer.token_to_id(EOT_TOKEN)
    header = f"{START_HEADER_TOKEN}user{END_HEADER_TOKEN}"
    ids = tokenizer.encode(header, add_special_tokens=False).ids
    assert ids[0] == tokenizer.token_to_id(START_HEADER_TOKEN)
    assert ids[-1] == tokenizer.token_to_id(END_HEADER_TOKEN)


def test_sharded_and_tied_checkpoints_hold_the_single_file_tensors(tmp_path: Path):
    write_checkpoint(tmp_path / "single", SMALL, seed=3, with_tokenizer=False)
    write_checkpoint(tmp_path / "sharded", SMALL, seed=3, num_shards=3, with_tokenizer=False)
    single = load_file(tmp_path / "single" / "model.safetensors")

    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sharded = {}
    for name in files:
        sharded.update(load_file(tmp_path / "sharded" / name))
    assert set(index["weight_map"]) == set(sharded) == set(single)
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in single.values())

    tied_spec = ModelSpec(vocab_size=320, num_hidden_layers=2, tie_word_embeddings=True)
    write_checkpoint(tmp_path / "tied", tied_spec, seed=3, with_tokenizer=False)
    tied = load_file(tmp_path / "tied" / "model.safetensors")
    assert "lm_head.weight" not in tied
    assert torch.equal(tied["model.embed_tokens.weight"], single["model.embed_tokens.weight"])


def test_rewriting_a_checkpoint_removes_stale_shards(tmp_path: Path):
    write_checkpoint(tmp_path, SMALL, num_shards=3, with_tokenizer=False)
    write_checkpoint(tmp_path, SMALL, with_tokenizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_invalid_specs_are_rejected(tmp_path: Path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_checkpoint(tmp_path, ModelSpec(), with_tokenizer=False)
    with pytest.raises(ValueError, match="num_shards"):
        write_checkpoint(tmp_path, SMALL, num_shards=1000, with_tokenizer=False)
    with pytest.raises(ValueError, match="targets"):
        AdapterSpec("bad", rank=4, alpha=8, targets=("embed_tokens",), seed=0)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelSpec(num_attention_heads=4, num_key_value_heads=3)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_adapter_delta_is_the_documented_fraction_of_the_base_output(
    tmp_path: Path, use_rslora: bool
):
    adapter = AdapterSpec(
        "probe", rank=16, alpha=32.0, targets=LORA_TARGETS, seed=5, use_rslora=use_rslora
    )
    write_checkpoint(tmp_path / "base", GQA, with_tokenizer=False)
    write_adapter(tmp_path / "adapter", GQA, adapter)
    base = load_file(tmp_path / "base" / "model.safetensors")
    lora = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for key, weight in base.items():
        prefix = "base_model.model." + key.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" not in lora:
            continue
        x = torch.randn(256, weight.shape[1], generator=generator)
        delta = (
            adapter.scaling
            * x
            @ lora[f"{prefix}.lora_A.weight"].T
            @ lora[f"{prefix}.lora_B.weight"].T
        )
        ratio = (delta.norm() / (x @ weight.T).norm()).item()
        assert LORA_DELTA_RATIO / 2 < ratio < LORA_DELTA_RATIO * 2, key


# ---- oracle tests: transformers + peft read what we wrote -------------------------------------


def _greedy(model, tokenizer, prompt: str, new_tokens: int = 8) -> list[int]:
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return out[0, input_ids.shape[1] :].tolist()


@pytest.mark.oracle
def test_transformers_loads_model_and_tokenizer(assets: DemoAssets, offline: None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(assets.model, local_files_only=True)
    assert tokenizer("hello world").input_ids[0] == tokenizer.bos_token_id
    assert tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer.eos_token == EOT_TOKEN
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert (
        model.config.head_dim == SYNTHETIC_MODEL.hidden_size // SYNTHETIC_MODEL.num_attention_heads
    )

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1

    generated = _greedy(model, tokenizer, PROMPTS[0], new_tokens=16)
    assert len(set(generated)) > 4


@pytest.mark.oracle
def test_every_demo_adapter_changes_greedy_output(assets: DemoAssets, offline: None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(assets.model, local_files_only=True)
    base = {prompt: _greedy(model, tokenizer, prompt) for prompt in PROMPTS}

    first, *rest = assets.adapter_names
    peft_model = PeftModel.from_pretrained(model, assets.adapters_dir / first, adapter_name=first)
    for name in rest:
        peft_model.load_adapter(assets.adapters_dir / name, adapter_name=name)
    with peft_model.disable_adapter():
        assert {prompt: _greedy(peft_model, tokenizer, prompt) for prompt in PROMPTS} == base
    for name in assets.adapter_names:
        peft_model.set_adapter(name)
        adapted = {prompt: _greedy(peft_model, tokenizer, prompt) for prompt in PROMPTS}
        assert adapted != base, f"adapter {name} does not change greedy output"


def _logits(model_dir: Path) -> tuple[torch.Tensor, torch.dtype]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    loaded_dtype = model.dtype
    with torch.no_grad():
        return model.float()(TOKEN_IDS).logits, loaded_dtype


@pytest.fixture(scope="module")
def reference_logits(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    model_dir = tmp_path_factory.mktemp("reference")
    write_checkpoint(model_dir, SMALL, seed=3, with_tokenizer=False)
    logits, _ = _logits(model_dir)
    return logits


@pytest.mark.oracle
@pytest.mark.parametrize(
    ("dtype", "num_shards", "atol"),
    [
        (torch.float32, 3, 0.0),
        (torch.float16, 1, 2e-2),
        (torch.bfloat16, 2, 1e-1),
    ],
)
def test_checkpoint_variants_match_fp32_single_file(
    tmp_path: Path,
    reference_logits: torch.Tensor,
    dtype: torch.dtype,
    num_shards: int,
    atol: float,
    offline: None,
):
    write_checkpoint(
        tmp_path, SMALL, seed=3, dtype=dtype, num_shards=num_shards, with_tokenizer=False
    )
    logits, loaded_dtype = _logits(tmp_path)
    assert loaded_dtype == dtype
    torch.testing.assert_close(logits, reference_logits, atol=atol, rtol=0.0)


@pytest.mark.oracle
def test_tied_checkpoint_uses_the_embedding_as_lm_head(tmp_path: Path, offline: None):
    from transformers import AutoModelForCausalLM

    tied_spec = ModelSpec(vocab_size=320, num_hidden_layers=2, tie_word_embeddings=True)
    write_checkpoint(tmp_path / "single", tied_spec, seed=3, with_tokenizer=False)
    write_checkpoint(tmp_path / "sharded", tied_spec, seed=3, num_shards=3, with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "single", local_files_only=True)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        out = model(TOKEN_IDS, output_hidden_states=True)
    final_hidden = out.hidden_states[-1]
    torch.testing.assert_close(out.logits, final_hidden @ model.model.embed_tokens.weight.T)
    assert 0.3 < out.logits.std().item() < 3.0

    sharded_logits, _ = _logits(tmp_path / "sharded")
    torch.testing.assert_close(sharded_logits, out.logits, atol=0.0, rtol=0.0)


@pytest.mark.oracle
@pytest.mark.parametrize(("rank", "use_rslora"), [(1, False), (4, True), (7, False), (128, False)])
def test_peft_loads_adapters_of_any_rank_on_a_gqa_model(
    tmp_path: Path, rank: int, use_rslora: bool, offline: None
):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    adapter = AdapterSpec(
        "probe", rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS, seed=rank, use_rslora=use_rslora
    )
    write_checkpoint(tmp_path / "base", GQA, with_tokenizer=False)
    write_adapter(tmp_path / "adapter", GQA, adapter)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    with torch.no_grad():
        base_logits = model(TOKEN_IDS).logits
    peft_model = PeftModel.from_pretrained(model, tmp_path / "adapter", adapter_name="probe")

    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(written) == 2 * len(LORA_TARGETS) * GQA.num_hidden_layers
    lora_layers = [(n, m) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    assert len(lora_layers) == len(LORA_TARGETS) * GQA.num_hidden_layers
    for name, module in lora_layers:
        key = f"{name}.lora_A.weight"
        lora_a = module.lora_A["probe"].weight
        lora_b = module.lora_B["probe"].weight
        assert lora_a.shape == (rank, module.in_features)
        assert lora_b.shape == (module.out_features, rank)
        assert torch.equal(lora_a, written[key])
        assert torch.equal(lora_b, written[key.replace("lora_A", "lora_B")])
        assert module.scaling["probe"] == pytest.approx(adapter.scaling)

    with torch.no_grad():
        adapted_logits = peft_model(TOKEN_IDS).logits
    assert not torch.allclose(adapted_logits, base_logits)
    assert adapted_logits.std() < 2.0 * base_logits.std()
