"""SmolLM2-135M-Instruct from its GGUF against transformers + peft on the same dequantized
weights: the engine (logits and greedy tokens, 96 requests x 32 steps, base + three demo
adapters + two random odd-rank ones), `loraplex generate`, tp = 3, the tokenizer and the
chat template read from the GGUF."""

from __future__ import annotations

import json

import pytest
from real_model import ATOL, STEPS, reference_run

from loraplex.cluster.cli import main
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.tokenizer import Tokenizer

# kv_cache_dtype bfloat16: the worst logit's distance from the oracle (measured 2026-12-06:
# 0.30 over 24 requests x 32 steps, the greedy token the oracle's at 767 of 768 steps)
LOSSY_ATOL = 0.5
pytestmark = [
    pytest.mark.oracle,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]


def test_engine_logits_and_greedy_tokens_equal_transformers_peft(real_reference):
    run = real_reference
    assert len(run.requests) >= 16 * 6 and all(len(t) == STEPS for t in run.tokens)
    assert {r.adapter for r in run.requests} == {None, *run.adapters}
    worst = max(run.max_logit_diff)
    assert worst <= ATOL, f"max |engine - oracle| logit = {worst:.2e}"
    mismatched = [
        i for i, (a, b) in enumerate(zip(run.tokens, run.oracle_tokens, strict=True)) if a != b
    ]
    assert not mismatched, f"{len(mismatched)} requests part from the oracle, e.g. {mismatched[:3]}"
    # the adapters change what the model says (else the comparison proves little)
    per_adapter = {}
    for r, t in zip(run.requests, run.tokens, strict=True):
        per_adapter.setdefault(r.adapter, []).append(t)
    base = per_adapter.pop(None)
    for name, tokens in per_adapter.items():
        assert tokens != base, f"adapter {name} changed no output"


def test_loraplex_generate_gives_the_oracle_tokens(real_reference, real_gguf, tmp_path, capsys):
    run = real_reference
    links = tmp_path / "adapters"
    links.mkdir()
    for name, path in run.adapters.items():
        (links / name).symlink_to(path)
    lines = []
    for i, r in enumerate(run.requests):
        prompt = {"prompt": r.text} if r.text is not None else {"prompt_token_ids": r.prompt_ids}
        lines.append(
            {
                "id": i,
                **prompt,
                "adapter": r.adapter,
                "max_tokens": STEPS,
                "temperature": 0,
                "ignore_eos": True,
            }  # fmt: skip
        )
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    gguf = str(real_gguf)
    code = main(
        [
            "generate",
            "--model",
            gguf,
            "--adapters",
            str(links),
            "--input",
            str(requests),
            "--output",
            str(out),
            "--max-loras-per-batch",
            "8",
        ]  # fmt: skip
    )
    assert code == 0, capsys.readouterr().err
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in results] == run.oracle_tokens


def test_tp3_gives_tp1_tokens(real_reference, real_gguf):
    """9 query and 3 KV heads: tp must divide the KV heads, so 3 (not 2) is the real
    model's tensor-parallel degree; 2 is refused with that reason."""
    run = real_reference
    picks = [i for i in range(len(run.requests)) if i % 8 in (0, 5)]  # a chat and a text each
    engine = LLMEngine(
        EngineConfig(
            model=str(real_gguf),
            dtype="float32",
            tp=3,
            tp_launcher="process",
            pool_bytes=192 << 20,
        )  # fmt: skip
    )
    try:
        for name, path in run.adapters.items():
            engine.add_adapter(name, path)
        params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
        outs = engine.generate(
            [run.requests[i].prompt_ids for i in picks],
            [params] * len(picks),
            [run.requests[i].adapter for i in picks],
        )
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == [run.oracle_tokens[i] for i in picks]


def test_a_bfloat16_kv_cache_stays_within_its_rounding_of_the_oracle(real_reference, real_gguf):
    """kv_cache_dtype bfloat16 under the float32 model: K and V are rounded to bfloat16
    (8 bits of mantissa) as they are written, so logits move by that rounding's effect,
    not by a bug's: within LOSSY_ATOL of transformers + peft teacher-forced on the
    engine's own tokens, and the greedy token the oracle's at nearly every step."""
    run = reference_run(  # a chat and a text on the base model and each adapter
        real_gguf, real_reference.adapters, "bfloat16", lambda i: i % 8 in (0, 5)
    )
    assert len(run.requests) == 24 and all(len(t) == STEPS for t in run.tokens)
    worst = max(run.max_logit_diff)
    assert ATOL < worst <= LOSSY_ATOL, f"max |engine - oracle| logit = {worst:.2e}"
    steps = [
        (a, b)
        for t, o in zip(run.tokens, run.oracle_tokens, strict=True)
        for a, b in zip(t, o, strict=True)
    ]
    agree = sum(a == b for a, b in steps) / len(steps)
    assert agree >= 0.99, f"the greedy token is the oracle's at {agree:.1%} of steps"


def test_tp2_is_refused_with_the_reason(real_gguf):
    from loraplex.checkpoint_shape import CheckpointError

    with pytest.raises(CheckpointError, match="tp=2 must divide num_key_value_heads"):
        LLMEngine(EngineConfig(model=str(real_gguf), tp=2, tp_launcher="process"))


def test_tokenizer_and_chat_template_come_from_the_gguf(real_gguf):
    from transformers import AutoTokenizer

    ours = Tokenizer(real_gguf)
    theirs = AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    texts = [
        "Hello world! How are you?",
        "  leading spaces\n\nnew  lines\ttab",
        "<|im_start|>user\nHi<|im_end|>",
        "naïve café — ünïcode ✓ 日本語",
        "def f(x):\n    return x ** two",
    ]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
    # llama.cpp's `smollm` pre-tokenizer (as SmolLM2's own tokenizer.json) puts every digit
    # alone; transformers' GGUF converter ignores the pre-tokenizer name.
    digits = ours.encode("in 2024")
    assert [ours.decode([t]) for t in digits] == ["in", " ", "2", "0", "2", "4"]
    chat = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ours.decode(chat) == (
        "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n"
        "user\nHi\nassistant\n"
    )
    want = theirs.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
    )
    assert chat == (want["input_ids"] if hasattr(want, "keys") else want)
    assert ours.eos_token_id == 2 and ours.token_to_id("<|im_end|>") == 2


def test_chat_stops_at_the_end_of_turn_with_the_models_known_answer(real_gguf):
    """The issue's check: greedy decoding of this question through the model's template
    answers "The capital of France is Paris." and stops at <|im_end|>."""
    engine = LLMEngine(EngineConfig(model=str(real_gguf), pool_bytes=64 << 20))
    try:
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        )
        [out] = engine.generate([ids], [SamplingParams(max_tokens=40, temperature=0)], [None])
    finally:
        engine.close()
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert engine.tokenizer.decode(out.token_ids) == "The capital of France is Paris."


def test_chat_template_jinja_of_a_transformers5_folder_is_read(demo_assets, tmp_path):
    """transformers 5 saves the template in chat_template.jinja, not tokenizer_config.json."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((demo_assets.model / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(demo_assets.model / name)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    messages = [{"role": "user", "content": "Name a fruit."}]
    assert Tokenizer(folder).apply_chat_template(messages) == Tokenizer(
        demo_assets.model
    ).apply_chat_template(messages)
    (folder / "chat_template.jinja").unlink()
    assert not Tokenizer(folder).has_chat_template
