"""GGUF checkpoints: a small Llama written the way llama.cpp's converter writes one
(tests/gguf_files.py), in every supported tensor type, served by the engine and compared
with transformers' own GGUF loader (the oracle: it dequantizes with the same `gguf`
package and undoes the q/k permutation by its own code); bad files give clear errors."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_gguf

from loraplex.adapter_format import validate_adapter_dir
from loraplex.checkpoint_shape import CheckpointError
from loraplex.cluster.cli import main
from loraplex.demo.synthetic import AdapterSpec, ModelSpec, write_adapter, write_checkpoint
from loraplex.errors import Unacceptable
from loraplex.gguf_checkpoint import SUPPORTED_TYPES, open_gguf
from loraplex.model_shape import read_model_shape
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

pytest.importorskip("gguf")

# hidden and intermediate are multiples of 256: every row holds whole K-quant blocks
SPEC = ModelSpec(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    rope_scaling=None,
)
PROMPT = [5, 17, 200, 33, 4, 99, 250, 7]
STEPS = 4
ATOL = 1e-3  # float32 engine vs float32 oracle, as in test_engine_oracle.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    write_checkpoint(root / "hf", SPEC, with_tokenizer=False)
    write_checkpoint(
        root / "hf-tied", replace(SPEC, tie_word_embeddings=True), with_tokenizer=False
    )
    return root


def _engine_tokens_and_logits(model: Path, adapter: Path | None = None, tp: int = 1):
    engine = LLMEngine(
        EngineConfig(
            model=str(model), dtype="float32", tp=tp, tp_launcher="process", pool_bytes=32 << 20
        )
    )
    try:
        if adapter is not None:
            engine.add_adapter("a", adapter)
        seq = engine.add_request(
            PROMPT,
            SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, return_logits=True),
            None if adapter is None else "a",
        )
        logits = []
        while not seq.finished:
            for out in engine.step():
                logits.append(out.logits)
        return list(seq.output_ids), torch.stack(logits)
    finally:
        engine.close()


def _oracle_logits(folder: Path, gguf_name: str, tokens: list[int], adapter: Path | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()
    return logits[len(PROMPT) - 1 : len(PROMPT) - 1 + len(tokens)]


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_every_supported_type_serves_like_transformers_gguf_loader(checkpoints, qtype):
    tied = qtype in ("Q4_K", "Q8_0")  # tied and untied heads both covered
    source = checkpoints / ("hf-tied" if tied else "hf")
    path = write_gguf(checkpoints / f"model-{qtype}.gguf", source, qtype)
    tokens, logits = _engine_tokens_and_logits(path)
    want = _oracle_logits(checkpoints, path.name, tokens)
    assert (logits - want).abs().max().item() <= ATOL
    assert tokens == want.argmax(-1).tolist()


@pytest.mark.oracle
def test_an_adapter_on_a_gguf_base_is_validated_and_applied_like_peft(checkpoints, tmp_path):
    path = write_gguf(checkpoints / "model-lora.gguf", checkpoints / "hf", "Q4_1")
    adapter = tmp_path / "r7"
    write_adapter(adapter, SPEC, AdapterSpec("r7", 7, 14.0, ("q_proj", "k_proj", "down_proj"), 5))
    summary = validate_adapter_dir(adapter, read_model_shape(path), max_rank=64, max_bytes=1 << 30)
    assert summary.rank == 7
    tokens, logits = _engine_tokens_and_logits(path, adapter)
    want = _oracle_logits(checkpoints, path.name, tokens, adapter)
    assert (logits - want).abs().max().item() <= ATOL
    assert tokens == want.argmax(-1).tolist()
    wrong = tmp_path / "wrong"
    write_adapter(wrong, replace(SPEC, hidden_size=128), AdapterSpec("w", 4, 8.0, ("q_proj",), 6))
    with pytest.raises(Unacceptable, match="q_proj"):
        validate_adapter_dir(wrong, read_model_shape(path), 64, 1 << 30)


@pytest.mark.slow
def test_tensor_parallel_ranks_read_their_share_and_match_tp1(checkpoints):
    # Q4_0 blocks are 32 wide: the row-parallel cut (128 columns) falls on block bounds
    # and is taken from the bytes; Q6_K blocks are 256 wide, so that cut dequantizes
    # whole rows first.
    for qtype in ("Q4_0", "Q6_K"):
        path = write_gguf(checkpoints / f"tp-{qtype}.gguf", checkpoints / "hf", qtype)
        tokens1, logits1 = _engine_tokens_and_logits(path)
        tokens2, logits2 = _engine_tokens_and_logits(path, tp=2)
        assert tokens1 == tokens2
        assert (logits1 - logits2).abs().max().item() <= ATOL


def test_a_rank_share_is_the_same_numbers_as_the_whole_tensor(checkpoints):
    for qtype in ("Q8_0", "Q6_K", "BF16", "F16"):
        path = write_gguf(checkpoints / f"share-{qtype}.gguf", checkpoints / "hf", qtype)
        c = open_gguf(path)
        for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"):
            whole = c.read(name)
            rows, cols = slice(64, 192), slice(256, 512) if "down" in name else slice(0, 256)
            np.testing.assert_array_equal(c.read(name, rows, cols), whole[rows, cols])


def test_shape_comes_from_metadata(checkpoints):
    path = write_gguf(checkpoints / "shape.gguf", checkpoints / "hf", "F16")
    shape = read_model_shape(path)
    hf = read_model_shape(checkpoints / "hf")
    assert shape.projection_shapes() == hf.projection_shapes()
    assert (shape.vocab_size, shape.num_layers, shape.tie_word_embeddings) == (320, 2, False)
    assert shape.rope_theta == hf.rope_theta


# ---------------------------------------------------------------- bad files


def _generate_error(model: Path, tmp_path: Path, capsys) -> str:
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(model), "--input", str(requests), "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "Traceback" not in err
    return err


def test_truncated_or_corrupt_files_are_named_not_tracebacks(checkpoints, tmp_path, capsys):
    data = write_gguf(checkpoints / "whole.gguf", checkpoints / "hf", "Q8_0").read_bytes()
    for n, what in ((len(data) // 2, "truncated"), (len(data) - 7, "truncated"), (3, "truncated")):
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(data[:n])
        with pytest.raises(CheckpointError, match=f"{what} or corrupt"):
            read_model_shape(bad)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    assert "not a readable GGUF file" in _generate_error(junk, tmp_path, capsys)


def test_unsupported_architecture_and_type_are_refused(checkpoints, tmp_path, capsys):
    arch = write_gguf(tmp_path / "gpt2.gguf", checkpoints / "hf", "F32", architecture="gpt2")
    assert "architecture 'gpt2' unsupported" in _generate_error(arch, tmp_path, capsys)
    q5 = write_gguf(tmp_path / "q5.gguf", checkpoints / "hf", "Q5_0")
    err = _generate_error(q5, tmp_path, capsys)
    assert "is Q5_0; supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K" in err


def test_metadata_that_disagrees_with_the_tensors_is_refused(checkpoints, tmp_path, capsys):
    bad = write_gguf(
        tmp_path / "ffn.gguf",
        checkpoints / "hf",
        "F16",
        metadata_override={"feed_forward_length": 1024},
    )
    err = _generate_error(bad, tmp_path, capsys)
    assert (
        "tensor layers.0.mlp.gate_proj.weight: expected shape (1024, 256), found (512, 256)" in err
    )


def test_the_shape_reader_is_torch_free(checkpoints):
    """The registry validates adapters with it and must not import torch."""
    import subprocess
    import sys

    path = write_gguf(checkpoints / "torchless.gguf", checkpoints / "hf", "Q8_0")
    code = (
        "import sys\n"
        "from loraplex.model_shape import read_model_shape\n"
        f"read_model_shape({str(path)!r})\n"
        f"read_model_shape({str(checkpoints / 'hf')!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
