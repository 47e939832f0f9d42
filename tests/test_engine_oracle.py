"""The engine against a transformers + PEFT oracle.

Every test runs the engine greedily with `return_logits=True`, then teacher-forces the
engine's own tokens through transformers/PEFT (one mixed-batch forward, right padding,
`adapter_names=`) and checks, for every sampled step of every request:

* logits: max |engine - oracle| <= atol (the prefill step and every decode step);
* tokens: the engine's token is the oracle's argmax at that position. Because the oracle sees
  the engine's prefix, step-by-step agreement means the whole greedy continuation equals the
  oracle's own greedy continuation.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from loraplex.demo.assets import DemoAssets
from loraplex.demo.synthetic import (
    ATTENTION_TARGETS,
    LORA_TARGETS,
    MLP_TARGETS,
    SYNTHETIC_ADAPTERS,
    SYNTHETIC_MODEL,
    AdapterSpec,
    ModelSpec,
    write_adapter,
    write_checkpoint,
)
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.replica.sequence import Sequence

pytestmark = [
    pytest.mark.oracle,
    # peft 0.21 calls a transformers 5 API that is deprecated (is_gradient_checkpointing)
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]
pytest.importorskip("transformers")
pytest.importorskip("peft")

ATOL = 1e-3  # float32 engine vs float32 oracle
PAGE_BYTES = 64 * 1024
POOL_BYTES = 32 << 20
DEMO = {a.name: a for a in SYNTHETIC_ADAPTERS}

TEXTS = (
    "The capital of France is",
    "SELECT name, email FROM users WHERE",
    (
        "Once upon a time there was a fox who wanted to learn to sing. He asked the birds to "
        "teach him, but they laughed and flew away."
    ),
    "def add(a, b):",
    "My grandmother kept a garden behind her house. She grew",
    "The river runs from the mountains to the sea.",
)


def token_prompt(n: int, seed: int, vocab: int = 1531) -> list[int]:
    """n pseudo-random ordinary token ids (ids < vocab: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True
    )


@dataclass
class Run:
    """What one request produced, step by step."""

    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # engine step number of each token
    finish_reason: str | None = None
    seq: Sequence | None = None  # the engine's own state (read-only here)


class Driver:
    """Adds requests to an `LLMEngine` and records every RequestOutput."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.runs: dict[str, Run] = {}
        self.num_steps = 0

    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        max_tokens: int,
        adapter: str | None,
        **request,  # tenant, cache_salt
    ) -> Run:
        seq = self.engine.add_request(
            prompt, greedy(max_tokens), adapter=adapter, request_id=request_id, **request
        )
        run = Run(request_id, list(seq.prompt_ids), adapter, max_tokens, seq=seq)
        self.runs[request_id] = run
        return run

    def step(self) -> None:
        self.num_steps += 1
        for out in self.engine.step():
            run = self.runs[out.request_id]
            assert run.finish_reason is None, f"{out.request_id} produced output after finishing"
            assert len(out.new_token_ids) == 1
            assert out.logits is not None and out.logits.dtype == torch.float32
            run.tokens.extend(out.new_token_ids)
            run.logits.append(out.logits.detach().clone())
            run.steps.append(self.num_steps)
            assert out.token_ids == run.tokens
            assert out.num_prompt_tokens == len(run.prompt_ids)
            if out.finished:
                run.finish_reason = out.finish_reason

    def run_to_completion(self, max_steps: int = 2000) -> None:
        while self.engine.has_unfinished():
            assert self.num_steps < max_steps, "the engine made no progress"
            self.step()
        for run in self.runs.values():
            assert run.finish_reason == "length", (run.request_id, run.finish_reason)
            assert len(run.tokens) == run.max_tokens, (run.request_id, len(run.tokens))


def check_against_oracle(
    runs: list[Run],
    oracle: Callable[[list[list[int]], list[str | None]], list[torch.Tensor]],
    *,
    atol: float = ATOL,
    exact_tokens: bool = True,
) -> dict[str, float]:
    """Teacher-force every run's tokens through `oracle` in ONE mixed batch and compare.

    exact_tokens=False (reduced precision): where the oracle's top two logits are within
    2 * atol, the engine may pick either of the near-tied tokens; it must still pick a token
    whose oracle logit is within 2 * atol of the oracle's best (what |diff| <= atol implies
    for an argmax of the engine's own logits). Elsewhere the argmax must match exactly.
    Returns the worst prefill and decode differences (handy when debugging)."""
    sequences = [run.prompt_ids + run.tokens[:-1] for run in runs]
    reference = oracle(sequences, [run.adapter for run in runs])
    worst = {"prefill": 0.0, "decode": 0.0}
    for run, full in zip(runs, reference, strict=True):
        p = len(run.prompt_ids)
        want = full[p - 1 : p - 1 + len(run.tokens)]
        got = torch.stack(run.logits)
        assert got.shape == want.shape, (run.request_id, got.shape, want.shape)
        assert torch.isfinite(got).all(), run.request_id
        diff = (got - want).abs().amax(dim=-1)  # per sampled step
        label = f"{run.request_id} (adapter={run.adapter}, prompt={p} tokens)"
        assert diff[0] <= atol, f"{label}: prefill logits differ by {diff[0]:.3g} > {atol}"
        if len(diff) > 1:
            k = int(diff[1:].argmax()) + 1
            assert diff[k] <= atol, (
                f"{label}: decode step {k} logits differ by {diff[k]:.3g} > {atol}"
            )
            worst["decode"] = max(worst["decode"], float(diff[1:].max()))
        worst["prefill"] = max(worst["prefill"], float(diff[0]))

        tokens = torch.tensor(run.tokens)
        # the engine's greedy sampler takes the argmax of the logits it reports
        assert got.argmax(dim=-1).tolist() == run.tokens, (
            f"{label}: token is not the argmax of its logits"
        )
        oracle_best = want.argmax(dim=-1)
        if exact_tokens:
            mismatch = (oracle_best != tokens).nonzero().flatten().tolist()
            assert not mismatch, (
                f"{label}: greedy token differs from the oracle at steps {mismatch}"
            )
        else:
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
            mismatch = ((oracle_best != tokens) & clear).nonzero().flatten().tolist()
            assert not mismatch, (
                f"{label}: greedy token differs from the oracle at clear steps {mismatch}"
            )
            chosen = want.gather(1, tokens[:, None]).squeeze(1)
            assert (top2[:, 0] - chosen <= 2 * atol).all(), (
                f"{label}: engine token far from the oracle's best"
            )
    return worst


def demo_engine(assets: DemoAssets, adapters=(), **overrides) -> LLMEngine:
    cfg = EngineConfig(model=str(assets.model), page_bytes=PAGE_BYTES, pool_bytes=POOL_BYTES)
    engine = LLMEngine(replace(cfg, **overrides))
    for name in adapters:
        engine.add_adapter(name, assets.adapters_dir / name)
    return engine


# 2. one mixed batch: adapters of different ranks and target sets, base-only requests


MIXED_ADAPTERS = ("sql-r8", "chat-r16", "code-r32", "math-r64", "legal-r8", "poetry-r24")


def test_demo_adapters_used_here_differ_in_rank_and_targets():
    used = [DEMO[n] for n in MIXED_ADAPTERS]
    assert len({a.rank for a in used}) >= 4 and len({a.targets for a in used}) >= 4
    assert set(ATTENTION_TARGETS) <= set(DEMO["code-r32"].targets)
    assert set(DEMO["math-r64"].targets) == set(MLP_TARGETS)
    assert set(DEMO["chat-r16"].targets) == set(LORA_TARGETS)


def test_mixed_batch_matches_oracle(demo_assets: DemoAssets, oracle_logits):
    from transformers import AutoTokenizer

    engine = demo_engine(demo_assets, MIXED_ADAPTERS)
    driver = Driver(engine)
    requests = [  # (prompt, adapter); lengths 3..40, text and token-id prompts
        (TEXTS[0], "sql-r8"),
        (token_prompt(3, 1), "math-r64"),
        (TEXTS[2], "code-r32"),
        (token_prompt(17, 2), "legal-r8"),
        (TEXTS[1], "chat-r16"),
        (TEXTS[4], None),
        (token_prompt(40, 3), None),
        (token_prompt(9, 4), "poetry-r24"),
        (TEXTS[3], "sql-r8"),  # a second request on an adapter: a segment of two rows
        (token_prompt(25, 5), "chat-r16"),
    ]
    for i, (prompt, adapter) in enumerate(requests):
        driver.add(f"r{i}", prompt, 32, adapter)

    tok = AutoTokenizer.from_pretrained(demo_assets.model)
    for i, (prompt, _) in enumerate(requests):
        expected = tok(prompt).input_ids if isinstance(prompt, str) else prompt
        assert driver.runs[f"r{i}"].prompt_ids == expected  # text prompts: BOS + BPE, as HF
    lengths = [len(r.prompt_ids) for r in driver.runs.values()]
    assert min(lengths) == 3 and max(lengths) == 40 and len(set(lengths)) >= 8

    driver.run_to_completion()
    assert driver.num_steps == 32  # everything prefilled together in step 1, then 31 decodes
    runs = list(driver.runs.values())
    assert all(r.steps == list(range(1, 33)) for r in runs)
    check_against_oracle(runs, oracle_logits)

    # the adapters matter: each adapted request's greedy output differs from the base model's
    base = oracle_logits([r.prompt_ids + r.tokens[:-1] for r in runs], [None] * len(runs))
    for run, logits in zip(runs, base, strict=True):
        if run.adapter is not None:
            p = len(run.prompt_ids)
            assert logits[p - 1 : p - 1 + len(run.tokens)].argmax(-1).tolist() != run.tokens, (
                run.request_id
            )


# 3. continuous batching: requests join mid-way and finish at different times


def test_continuous_batching_matches_oracle(demo_assets: DemoAssets, oracle_logits):
    engine = demo_engine(
        demo_assets, ("sql-r8", "math-r64", "translate-r64", "support-r12", "med-r16-rslora")
    )
    driver = Driver(engine)
    driver.add("a", TEXTS[0], 12, "sql-r8")
    driver.add("b", token_prompt(30, 11), 20, None)
    driver.add("c", token_prompt(5, 12), 7, "math-r64")
    for _ in range(5):
        driver.step()
    assert all(len(r.tokens) == 5 for r in driver.runs.values())
    driver.add("d", TEXTS[2], 10, "translate-r64")  # adapters not used so far
    driver.add("e", token_prompt(12, 13), 16, "support-r12")
    driver.add("f", TEXTS[5], 3, "sql-r8")  # joins a running request's adapter
    driver.add("g", token_prompt(4, 14), 9, None)
    driver.step()
    # one step held d's prefill and a's decode
    assert len(driver.runs["d"].tokens) == 1 and len(driver.runs["a"].tokens) == 6
    for _ in range(2):
        driver.step()
    driver.add("h", TEXTS[4], 5, "med-r16-rslora")
    driver.run_to_completion()

    runs = driver.runs
    assert runs["c"].steps[-1] == 7 and runs["f"].steps[-1] == 8 and runs["b"].steps[-1] == 20
    assert runs["h"].steps[0] == 9
    assert len({r.steps[-1] for r in runs.values()}) >= 6  # finished at different steps
    check_against_oracle(list(runs.values()), oracle_logits)


# 4. chunked prefill and preemption


def test_chunked_prefill_and_preemption_match_oracle(demo_assets: DemoAssets, oracle_logits):
    page_bytes = 16 * 1024  # 8 tokens of KV per page
    engine = demo_engine(
        demo_assets,
        ("sql-r8", "legal-r8", "support-r12"),
        page_bytes=page_bytes,
        pool_bytes=40 * page_bytes,
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
    )
    assert engine.kv.block_size == 8
    driver = Driver(engine)
    requests = [  # (prompt, max_tokens, adapter)
        (token_prompt(45, 21), 24, "sql-r8"),
        (TEXTS[2], 4, "legal-r8"),  # finishes early: its adapter goes idle
        (token_prompt(20, 22), 24, None),
        (token_prompt(33, 23), 24, "support-r12"),
        (token_prompt(6, 24), 24, "sql-r8"),
        (TEXTS[0], 24, None),
    ]
    for i, (prompt, max_tokens, adapter) in enumerate(requests):
        driver.add(f"p{i}", prompt, max_tokens, adapter)
    while driver.runs["p1"].finish_reason is None:
        driver.step()
    assert engine.adapters.is_resident("legal-r8")
    while engine.adapters.is_resident("legal-r8"):  # KV blocks take the idle adapter's pages
        assert driver.num_steps < 60, "legal-r8 was never evicted"
        driver.step()
    assert engine.adapters.stats.evictions > 0
    driver.add("p6", token_prompt(30, 25), 12, "legal-r8")  # loaded again, into other pages
    driver.add("p7", token_prompt(19, 26), 12, None)
    driver.run_to_completion()

    assert engine.scheduler.num_preemptions > 0
    assert any(r.seq.num_preemptions for r in driver.runs.values())
    # a 45-token prompt with a 16-token budget needs >= 3 steps before its first token
    assert driver.runs["p0"].steps[0] >= 3
    check_against_oracle(list(driver.runs.values()), oracle_logits)
    engine.pool.check_invariants()


# 5. ranks 1, 4, 7 and 128 in one batch, and rsLoRA

RANK_ADAPTERS = (
    AdapterSpec("odd-r1", rank=1, alpha=2.0, targets=("v_proj",), seed=201),
    AdapterSpec(
        "odd-r4-rslora",
        rank=4,
        alpha=3.0,
        targets=("gate_proj", "down_proj"),
        seed=202,
        use_rslora=True,
    ),
    AdapterSpec("odd-r7", rank=7, alpha=5.0, targets=("k_proj", "o_proj", "up_proj"), seed=203),
    AdapterSpec("odd-r128", rank=128, alpha=64.0, targets=LORA_TARGETS, seed=204),  # max rank
    DEMO["med-r16-rslora"],
)


@pytest.fixture(scope="module")
def rank_adapters(
    demo_assets: DemoAssets, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rank_adapters")
    paths = {}
    for spec in RANK_ADAPTERS:
        paths[spec.name] = (
            demo_assets.adapters_dir / spec.name if spec.name in DEMO else root / spec.name
        )
        if spec.name not in DEMO:
            write_adapter(paths[spec.name], SYNTHETIC_MODEL, spec)
    return paths


def _without_rslora(src: Path, dst: Path) -> Path:
    """A copy of a PEFT adapter folder with use_rslora switched off (same weights)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, "use_rslora": False}))
    return dst


def test_ranks_1_4_7_128_and_rslora_in_one_batch_match_oracle(
    demo_assets: DemoAssets, rank_adapters, oracle_model_loader, oracle_logits, tmp_path: Path
):
    engine = demo_engine(demo_assets)
    for spec in RANK_ADAPTERS:
        info = engine.add_adapter(spec.name, rank_adapters[spec.name])
        assert (info.rank, set(info.targets)) == (spec.rank, set(spec.targets))
    driver = Driver(engine)
    requests = [
        (token_prompt(11, 31), "odd-r1"),
        (TEXTS[1], "odd-r4-rslora"),
        (token_prompt(4, 32), "odd-r7"),
        (TEXTS[2], "odd-r128"),
        (token_prompt(23, 33), "med-r16-rslora"),
        (TEXTS[3], "odd-r128"),
        (token_prompt(8, 34), None),
    ]
    for i, (prompt, adapter) in enumerate(requests):
        driver.add(f"k{i}", prompt, 20, adapter)
    driver.run_to_completion()
    model = oracle_model_loader(demo_assets.model, rank_adapters)
    runs = list(driver.runs.values())
    check_against_oracle(runs, lambda ids, adapters: oracle_logits(ids, adapters, model=model))

    # rsLoRA matters here (alpha/sqrt(r) vs alpha/r): the same weights read as plain LoRA
    # give logits far from the engine's
    rslora = [r for r in runs if r.adapter in ("odd-r4-rslora", "med-r16-rslora")]
    plain = {
        r.adapter: _without_rslora(rank_adapters[r.adapter], tmp_path / r.adapter) for r in rslora
    }
    plain_model = oracle_model_loader(demo_assets.model, plain)
    with pytest.raises(AssertionError, match="logits differ"):
        check_against_oracle(
            rslora[:1], lambda ids, adapters: oracle_logits(ids, adapters, model=plain_model)
        )
    with pytest.raises(AssertionError, match="logits differ"):
        check_against_oracle(
            rslora[1:], lambda ids, adapters: oracle_logits(ids, adapters, model=plain_model)
        )


# 6. checkpoint variants: base model + one adapter, 8 greedy steps each


@dataclass(frozen=True)
class Variant:
    name: str
    spec: ModelSpec = SYNTHETIC_MODEL
    dtype: torch.dtype = torch.float32
    num_shards: int = 1
    config_patch: tuple[tuple[str, object], ...] = ()  # written over config.json
    hf_kwargs: tuple[tuple[str, object], ...] = ()  # extra from_pretrained kwargs for the oracle
    atol: float = ATOL
    exact_tokens: bool = True


SLIDING_WINDOW = 8
MISTRAL_PATCH = (
    ("model_type", "mistral"),
    ("architectures", ["MistralForCausalLM"]),
    ("sliding_window", SLIDING_WINDOW),
)
VARIANTS = (
    Variant("tied-embeddings", replace(SYNTHETIC_MODEL, tie_word_embeddings=True)),
    Variant("sharded-3", num_shards=3),
    # Reduced precision. The oracle runs in the same dtype, but the engine rounds differently
    # (fused qkv / gate_up, paged attention over padded blocks, LoRA in the model dtype with the
    # scale folded into B, where PEFT up-casts adapters to float32), so the two disagree by a few
    # ulps of the logits (|logit| < 8 here: ulp 2^-8 in fp16, 2^-5 in bf16). Seen: <= 0.01
    # (fp16) and <= 0.09 (bf16). Tolerances: 5e-2 (fp16, ~13 ulps) and 0.125 (bf16, 4 ulps).
    # Near-ties within 2 * atol may flip the greedy token (see check_against_oracle), and the
    # test also asserts the engine is about as close to a float32 run as HF in that dtype is.
    Variant("float16", dtype=torch.float16, atol=5e-2, exact_tokens=False),
    Variant("bfloat16", dtype=torch.bfloat16, atol=0.125, exact_tokens=False),
    Variant(
        "mistral-sliding-window",
        replace(SYNTHETIC_MODEL, rope_scaling=None),
        config_patch=MISTRAL_PATCH,
        hf_kwargs=(("attn_implementation", "eager"),),  # sdpa agrees; eager is the plainest
    ),
    Variant("default-rope", replace(SYNTHETIC_MODEL, rope_scaling=None)),
    Variant(  # q_size (144) != hidden_size (96), 3 query heads per kv head
        "gqa-head-dim-24",
        ModelSpec(
            hidden_size=96,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=24,
        ),
    ),
)
VARIANT_ADAPTER = AdapterSpec("variant-r8", rank=8, alpha=16.0, targets=LORA_TARGETS, seed=301)


def _write_variant(root: Path, v: Variant) -> tuple[Path, Path]:
    model_dir, adapter_dir = root / "model", root / "adapter"
    write_checkpoint(model_dir, v.spec, seed=7, dtype=v.dtype, num_shards=v.num_shards)
    if v.config_patch:
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg.update(dict(v.config_patch))
        (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    write_adapter(adapter_dir, v.spec, VARIANT_ADAPTER, dtype=v.dtype)
    return model_dir, adapter_dir


def _model_outputs(runs: list[Run], logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """The rows of teacher-forced logits that line up with each run's sampled steps."""
    return [
        full[len(r.prompt_ids) - 1 : len(r.prompt_ids) - 1 + len(r.tokens)]
        for r, full in zip(runs, logits, strict=True)
    ]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_checkpoint_variant_matches_transformers(
    variant: Variant, tmp_path: Path, oracle_model_loader, oracle_logits
):
    model_dir, adapter_dir = _write_variant(tmp_path, variant)
    files = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    assert len(files) == variant.num_shards
    assert (model_dir / "model.safetensors.index.json").is_file() == (variant.num_shards > 1)

    engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=POOL_BYTES))  # auto page size
    mc = engine.model_config
    assert mc.dtype == variant.dtype and mc.tie_word_embeddings == variant.spec.tie_word_embeddings
    assert mc.sliding_window == (SLIDING_WINDOW if variant.config_patch else None)
    engine.add_adapter(VARIANT_ADAPTER.name, adapter_dir)
    driver = Driver(engine)
    driver.add("base", TEXTS[4], 8, None)
    driver.add("lora", token_prompt(14, 41), 8, VARIANT_ADAPTER.name)
    driver.add("short", token_prompt(3, 42), 8, VARIANT_ADAPTER.name)
    driver.run_to_completion()
    runs = list(driver.runs.values())
    assert len(runs[0].prompt_ids) > SLIDING_WINDOW  # the window cuts into prefill and decode

    hf_kwargs = dict(variant.hf_kwargs)
    adapters = {VARIANT_ADAPTER.name: adapter_dir}
    model = oracle_model_loader(model_dir, adapters, dtype=variant.dtype, **hf_kwargs)
    assert model.dtype == variant.dtype
    check_against_oracle(
        runs,
        lambda ids, a: oracle_logits(ids, a, model=model),
        atol=variant.atol,
        exact_tokens=variant.exact_tokens,
    )

    ids = [r.prompt_ids + r.tokens[:-1] for r in runs]
    names = [r.adapter for r in runs]
    if variant.dtype != torch.float32:
        # the same (rounded) weights in float32: the engine is about as accurate as HF
        exact = oracle_model_loader(model_dir, adapters, dtype=torch.float32, **hf_kwargs)
        ref = torch.cat(_model_outputs(runs, oracle_logits(ids, names, model=exact)))
        hf = torch.cat(_model_outputs(runs, oracle_logits(ids, names, model=model)))
        engine_err = (torch.cat([torch.stack(r.logits) for r in runs]) - ref).abs().max()
        hf_err = (hf - ref).abs().max()
        assert engine_err <= 2 * hf_err, (float(engine_err), float(hf_err))
    if variant.config_patch:
        # the window matters: the same checkpoint with no window disagrees with the engine
        cfg = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
        full = oracle_model_loader(model_dir, adapters, **hf_kwargs)
        with pytest.raises(AssertionError, match="logits differ"):
            check_against_oracle(runs[:1], lambda i, a: oracle_logits(i, a, model=full))


def test_sliding_window_with_chunked_prefill_and_preemption_matches_oracle(
    tmp_path: Path, oracle_model_loader, oracle_logits
):
    variant = next(v for v in VARIANTS if v.config_patch)
    model_dir, _ = _write_variant(tmp_path, variant)
    page_bytes = 16 * 1024  # 8 tokens of KV per page: the window spans page boundaries
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            page_bytes=page_bytes,
            pool_bytes=12 * page_bytes,
            scheduler=SchedulerConfig(max_num_batched_tokens=6),  # chunks < window < prompts
        )
    )
    driver = Driver(engine)
    for i in range(5):
        driver.add(f"w{i}", token_prompt(7 + 6 * i, 50 + i), 16, None)
    driver.run_to_completion()
    assert engine.scheduler.num_preemptions > 0
    model = oracle_model_loader(model_dir, {}, **dict(variant.hf_kwargs))
    check_against_oracle(list(driver.runs.values()), lambda i, a: oracle_logits(i, a, model=model))
