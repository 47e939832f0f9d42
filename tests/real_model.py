"""The real-model workload the oracle tests share: SmolLM2-135M-Instruct (the demo GGUF),
its three demo adapters and two randomly initialised adapters of odd rank, 16 prompts
(8 chat conversations through the model's own template, 8 plain texts) on the base
model and on every adapter: 96 greedy requests of 32 steps.

`reference_run` serves them once with the engine (logits kept) and checks every step
against transformers + peft teacher-forced on the engine's tokens, on the same
dequantized weights (transformers reads the GGUF with its own loader). The tests of
`loraplex generate`, of the cluster and of tp = 3 compare their tokens with the oracle's
argmax tokens from that run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.demo.synthetic import LORA_TARGETS, AdapterSpec, ModelSpec, write_adapter
from loraplex.replica.config import KvCacheDtype

STEPS = 32
ATOL = 1e-3
# The real model's shape, for writing random adapters (write_adapter needs only the shapes).
SHAPE = ModelSpec(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    weight_gain=0.2,  # a delta of ~0.1 of a unit input: visible, not destructive
)
RANDOM_ADAPTERS = (
    AdapterSpec("random-r3", 3, 6.0, ("q_proj", "v_proj", "o_proj"), seed=301),
    AdapterSpec("random-r7", 7, 7.0, LORA_TARGETS, seed=302),
)
CHATS = (
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Write a haiku about the sea.",
    "Explain what a hash table is.",
    "How many customers live in Lisbon?",
    "What sound does a frog make?",
    "Translate 'good morning' into French.",
)
TEXTS = (
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "SELECT name FROM customers WHERE",
    "The three primary colors are",
    "import numpy as np\n",
    "Water boils at 100 degrees Celsius because",
    "My favourite recipe for pancakes is",
)


@dataclass
class Request:
    prompt_ids: list[int]
    adapter: str | None
    chat: list[dict] | None = None  # the conversation, for chat prompts
    text: str | None = None  # the plain text, for text prompts


@dataclass
class ReferenceRun:
    requests: list[Request]
    tokens: list[list[int]]  # the engine's greedy tokens
    oracle_tokens: list[list[int]]  # transformers + peft argmax at each of those steps
    max_logit_diff: list[float]  # per request, over every step
    adapters: dict[str, Path] = field(default_factory=dict)


def write_random_adapters(root: Path) -> dict[str, Path]:
    out = {}
    for spec in RANDOM_ADAPTERS:
        write_adapter(root / spec.name, SHAPE, spec)
        out[spec.name] = root / spec.name
    return out


def build_requests(tokenizer, adapters: list[str | None]) -> list[Request]:
    requests = []
    for adapter in adapters:
        for content in CHATS:
            chat = [{"role": "user", "content": content}]
            requests.append(Request(tokenizer.apply_chat_template(chat), adapter, chat=chat))
        for text in TEXTS:
            requests.append(Request(tokenizer.encode(text), adapter, text=text))
    return requests


def reference_run(
    gguf: Path,
    adapters: dict[str, Path],
    kv_cache_dtype: KvCacheDtype = "auto",
    pick: Callable[[int], bool] = lambda i: True,
) -> ReferenceRun:
    """The engine's run of the requests `pick` keeps (by index), checked step by step."""
    from loraplex.replica.config import EngineConfig
    from loraplex.replica.engine import LLMEngine
    from loraplex.replica.sampling import SamplingParams
    from loraplex.replica.scheduling.scheduler import SchedulerConfig

    engine = LLMEngine(
        EngineConfig(
            model=str(gguf),
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            pool_bytes=384 << 20,
            scheduler=SchedulerConfig(max_num_seqs=32, max_loras_per_batch=8),
        )
    )
    try:
        for name, path in adapters.items():
            engine.add_adapter(name, path)
        requests = build_requests(engine.tokenizer, [None, *adapters])
        requests = [r for i, r in enumerate(requests) if pick(i)]
        params = SamplingParams(
            max_tokens=STEPS, temperature=0, ignore_eos=True, return_logits=True
        )
        seqs = [engine.add_request(r.prompt_ids, params, r.adapter) for r in requests]
        logits: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
        while engine.has_unfinished():
            for out in engine.step():
                logits[out.request_id].append(out.logits)
        tokens = [list(s.output_ids) for s in seqs]
        engine_logits = [torch.stack(logits[s.request_id]) for s in seqs]
    finally:
        engine.close()
    oracle_tokens, diffs = _teacher_forced(gguf, adapters, requests, tokens, engine_logits)
    return ReferenceRun(requests, tokens, oracle_tokens, diffs, dict(adapters))


@torch.inference_mode()
def _teacher_forced(gguf, adapters, requests, tokens, engine_logits, chunk: int = 8):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    (first, first_path), *rest = adapters.items()
    model = PeftModel.from_pretrained(model, first_path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    model.eval()
    oracle_tokens, diffs = [], []
    for lo in range(0, len(requests), chunk):
        rows = range(lo, min(lo + chunk, len(requests)))
        seqs = [requests[i].prompt_ids + tokens[i] for i in rows]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        names = [requests[i].adapter or "__base__" for i in rows]
        out = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        for row, i in enumerate(rows):
            n = len(requests[i].prompt_ids)
            want = out[row, n - 1 : n - 1 + STEPS].float()
            oracle_tokens.append(want.argmax(-1).tolist())
            diffs.append((engine_logits[i] - want).abs().max().item())
    return oracle_tokens, diffs
