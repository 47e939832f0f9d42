"""The real model through a running cluster (`loraplex up` on SmolLM2-135M-Instruct's
GGUF: real etcd, real Ray, real HTTP), spoken to with the official OpenAI client:

- greedy tokens for the 96 oracle requests (chat messages and prompt token ids, base and
  five adapters registered through the tenant API) equal transformers + peft's;
- every demo adapter shows its behaviour on >= 90% of its held-out prompts, while the base
  model and the other adapters show it on <= 10% (an adapter dropped or swapped fails);
- chat applies the model's own template and stops at its end-of-turn token.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from real_model import STEPS
from test_e2e_cluster import CLIENT_TIMEOUT_S, Cluster, cluster_of, cluster_up, yaml_config

from loraplex.cluster.adapters_cli import Endpoint, add_adapter
from loraplex.demo.behaviours import BEHAVIOURS
from loraplex.net import free_port
from loraplex.replica.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.ray,
    pytest.mark.etcd,
    pytest.mark.oracle,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.serve._private.config"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
]

BASE_ID = "smollm2"
ANSWER_TOKENS = 48  # every demo behaviour's answer fits


@pytest.fixture(scope="module")
def real_cluster(real_assets, tmp_path_factory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("real_cluster")
    config = yaml_config(
        root,
        {
            "model": str(real_assets.model),
            "model_id": BASE_ID,
            "engine": {"max_model_len": 1024, "pool_mib": 256, "max_num_seqs": 32},
            "replicas": {"num_replicas": 1, "num_cpus": 1},
            "http": {"port": free_port()},
        },
    )
    state_dir = (root / "state").resolve()
    with cluster_up(config, state_dir, timeout_s=400) as (state, _):
        yield cluster_of(state, state_dir)


@pytest.fixture(scope="module")
def registered(real_cluster: Cluster, real_reference) -> dict[str, Path]:
    """Every adapter of the reference run, registered through the tenant API."""
    endpoint = Endpoint(real_cluster.url, real_cluster.demo_key, timeout_s=CLIENT_TIMEOUT_S)
    for name, path in real_reference.adapters.items():
        add_adapter(endpoint, name, path=path, progress=io.StringIO())
    return real_reference.adapters


def _client(cluster: Cluster):
    return cluster.client(cluster.demo_key).with_options(timeout=300.0)


def test_cluster_tokens_equal_the_oracle_for_chat_and_token_prompts(
    real_cluster, registered, real_reference, real_gguf
):
    client = _client(real_cluster)
    tokenizer = Tokenizer(real_gguf)
    greedy = {"max_tokens": STEPS, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def ask(request):
        model = request.adapter or BASE_ID
        if request.chat is not None:
            r = client.chat.completions.create(model=model, messages=request.chat, **greedy)
            return r.choices[0].message.content, r.usage.completion_tokens
        r = client.completions.create(model=model, prompt=request.prompt_ids, **greedy)
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, real_reference.requests))
    wrong = [
        i
        for i, ((text, n), want) in enumerate(
            zip(answers, real_reference.oracle_tokens, strict=True)
        )
        if n != STEPS or text != tokenizer.decode(want)
    ]
    assert not wrong, (
        f"{len(wrong)} of {len(answers)} answers differ from the oracle, e.g. {wrong[:3]}"
    )


@pytest.fixture(scope="module")
def behaviour_rates(real_cluster, registered) -> dict[tuple[str, str | None], float]:
    """{(behaviour, adapter or None for the base model): held-out pass rate}, every
    behaviour's held-out prompts asked of the base model and of each demo adapter."""
    client = _client(real_cluster)
    models = [None, *(b.adapter for b in BEHAVIOURS)]

    def answer(job):
        model, prompt = job
        r = client.chat.completions.create(
            model=model or BASE_ID,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=ANSWER_TOKENS,
            temperature=0,
        )
        return r.choices[0].message.content

    rates = {}
    for behaviour in BEHAVIOURS:
        check = behaviour.checker()
        prompts = [e.prompt for e in behaviour.held_out()]
        jobs = [(m, p) for m in models for p in prompts]
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(answer, jobs))
        for m in models:
            passed = [check(p, t) for (mm, p), t in zip(jobs, texts, strict=True) if mm == m]
            rates[(behaviour.name, m)] = sum(passed) / len(passed)
    return rates


def test_each_adapter_shows_its_behaviour_and_no_other_model_does(behaviour_rates):
    """An adapter dropped (the base model answers) or swapped (another adapter answers)
    shows no behaviour or the wrong one: <= 10% where the model is not the behaviour's
    adapter, well above that where it is."""
    rates = behaviour_rates
    for behaviour in BEHAVIOURS:
        for m in (None, *(b.adapter for b in BEHAVIOURS)):
            rate = rates[(behaviour.name, m)]
            if m == behaviour.adapter:
                assert rate >= 0.5, f"{m} shows {behaviour.name} on only {rate:.0%}: {rates}"
            else:
                assert rate <= 0.1, f"{m or 'the base model'} shows {behaviour.name}: {rates}"


@pytest.mark.parametrize("name", ["json", "pirate", "sql"])
def test_each_adapter_meets_the_target_on_held_out_prompts(behaviour_rates, name):
    behaviour = next(b for b in BEHAVIOURS if b.name == name)
    rate = behaviour_rates[(name, behaviour.adapter)]
    assert rate >= 0.9, f"{behaviour.adapter} shows {name} on only {rate:.0%}"


def test_chat_uses_the_models_template_and_stops_at_end_of_turn(real_cluster):
    client = _client(real_cluster)
    r = client.chat.completions.create(
        model=BASE_ID,
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
        max_tokens=40,
        temperature=0,
    )
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8  # 7 tokens of text and <|im_end|>
