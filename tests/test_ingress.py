"""The HTTP ingress end to end: the real engine on the demo model behind `LocalBackend`, served
by uvicorn on loopback and spoken to with the official `openai` client (and raw httpx where
the wire format itself is checked); the tenant API mounted on the same app over a real etcd.

Oracle: the engine run offline (`LLMEngine.generate`) on the same prompt ids, adapter and
sampling parameters; chat prompt ids come from the checkpoint's chat template."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import prometheus_client
import pytest
from etcd_server import EtcdServer, shared_etcd_server_fixture  # noqa: F401 (fixture)
from fastapi import FastAPI
from fastapi.testclient import TestClient
from http_server import serve
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import ClientDisconnect

from loraplex.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loraplex.demo.assets import DemoAssets
from loraplex.model_shape import read_model_shape
from loraplex.registry.api import RegistryAPISettings
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.models import Adapter
from loraplex.registry.store import RegistryStore
from loraplex.registry.watch import RegistryWatcher
from loraplex.replica.async_engine import Engine
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.local_backend import LocalBackend
from loraplex.replica.protocol import GenerateChunk, GenerateRequest, ReplicaFailed, adapter_id
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import RequestOutput
from loraplex.replica.tokenizer import Tokenizer
from loraplex.router.ingress import RegistryHandles, build_ingress
from loraplex.router.openai_requests import MAX_PROMPT_TOKEN_IDS

BASE_ID = "loraplex-demo-llama"
ADMIN_KEY = "admin-key-for-the-ingress-tests-0123"
METRICS_KEY = "metrics-key-for-the-ingress-tests"
PAGE = 64 * 1024
DEMO_ADAPTER = "sql-r8"  # the demo adapter the tests upload
PROMPT = "Once upon a time there was"
MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a fruit."},
]


def engine_config(assets: DemoAssets) -> EngineConfig:
    return EngineConfig(model=str(assets.model), page_bytes=PAGE, pool_bytes=512 * PAGE)


@pytest.fixture(scope="module")
def tokenizer(demo_assets: DemoAssets) -> Tokenizer:
    return Tokenizer(demo_assets.model)


@pytest.fixture(scope="module")
def offline(demo_assets: DemoAssets) -> LLMEngine:
    """The oracle: a second engine, run synchronously, with the demo adapter read from the
    demo folder (the served one is read from the artifact store)."""
    eng = LLMEngine(engine_config(demo_assets))
    eng.add_adapter(DEMO_ADAPTER, demo_assets.adapters_dir / DEMO_ADAPTER)
    return eng


def expected(
    offline: LLMEngine, ids: list[int], adapter: str | None = None, **params
) -> RequestOutput:
    out = offline.generate([ids], [SamplingParams(**params)], [adapter])[0]
    assert out.token_ids, "the oracle produced nothing"
    return out


@pytest.fixture(scope="module")
def engine(demo_assets: DemoAssets) -> Iterator[Engine]:
    eng = Engine(engine_config(demo_assets))
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def backend(engine: Engine) -> LocalBackend:
    return LocalBackend(engine)


@dataclass
class Served:
    url: str
    app: FastAPI
    registry: RegistryHandles | None = None
    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self, key: str = "anonymous") -> openai.OpenAI:
        """The official client pointed at the app (closed when the server stops)."""
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30)
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self.clients:
            client.close()


@pytest.fixture(scope="module")
def anonymous(backend: LocalBackend, engine: Engine, tokenizer: Tokenizer) -> Iterator[Served]:
    """The ingress without a registry: the base model, for anyone."""
    app = build_ingress(
        backend,
        tokenizer,
        base_model_id=BASE_ID,
        max_model_len=engine.core.max_model_len,
        registry=None,
    )
    with serve(app) as url:
        served = Served(url, app)
        yield served
        served.close_clients()


@pytest.fixture(scope="module")
def tenants_app(
    shared_etcd_server: EtcdServer,
    backend: LocalBackend,
    engine: Engine,
    tokenizer: Tokenizer,
    demo_assets: DemoAssets,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    """The ingress with the registry: tenant keys, adapters, the tenant API."""
    tmp = tmp_path_factory.mktemp("ingress")
    (tmp / "staging").mkdir()
    settings = RegistryAPISettings(
        admin_key=ADMIN_KEY,
        base_model_id=BASE_ID,
        base_model=read_model_shape(demo_assets.model),
        staging_dir=str(tmp / "staging"),
    )
    etcd = shared_etcd_server.settings()
    handles = RegistryHandles(
        RegistryStore(etcd), RegistryWatcher(etcd), ArtifactStore(tmp / "artifacts"), settings
    )
    app = build_ingress(
        backend,
        tokenizer,
        base_model_id=BASE_ID,
        max_model_len=engine.core.max_model_len,
        registry=handles,
        metrics_key=METRICS_KEY,
    )
    with serve(app) as url:
        served = Served(url, app, handles)
        yield served
        served.close_clients()


@pytest.fixture(scope="module")
def keys(tenants_app: Served) -> dict[str, str]:
    """API keys of two tenants, acme and globex."""
    keys = {}
    for name in ("acme", "globex"):
        r = httpx.post(
            f"{tenants_app.url}/v1/tenants",
            json={"name": name},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert r.status_code == 201, r.text
        keys[name] = r.json()["api_key"]
    return keys


def openai_error(response: httpx.Response, status: int) -> dict:
    """The `error` object of an OpenAI-shaped error body, after checking the shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def idle(engine: Engine) -> bool:
    """No request in the engine and no KV page held."""
    stats = asyncio.run(engine.stats())
    return (stats["running"], stats["waiting"], stats["pool"]["kv_pages"]) == (0, 0, 0)


# ---------------------------------------------------------------- the openai client


def test_completions_match_the_offline_engine(anonymous: Served, offline, tokenizer):
    client = anonymous.client()
    ids = tokenizer.encode(PROMPT)
    want = expected(offline, ids, max_tokens=24, temperature=0.0)

    got = client.completions.create(model=BASE_ID, prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == BASE_ID
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        len(ids),
        len(want.token_ids),
        len(ids) + len(want.token_ids),
    )

    by_ids = client.completions.create(model=BASE_ID, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == want.text

    chunks = list(
        client.completions.create(
            model=BASE_ID,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)

    # seeded sampling with top-p, top-k (an extension) and a stop string
    sampled = expected(offline, ids, max_tokens=32, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    stop = sampled.text[12:15]
    want = expected(
        offline, ids, max_tokens=32, temperature=0.9, top_p=0.95, top_k=50, seed=7, stop=(stop,)
    )
    got = client.completions.create(
        model=BASE_ID,
        prompt=PROMPT,
        max_tokens=32,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        stop=stop,
        extra_body={"top_k": 50},
    )
    assert got.choices[0].text == want.text and stop not in want.text
    assert got.choices[0].finish_reason == want.finish_reason == "stop"


def test_chat_matches_the_offline_engine(anonymous: Served, offline, tokenizer):
    client = anonymous.client()
    ids = tokenizer.apply_chat_template(MESSAGES)
    want = expected(offline, ids, max_tokens=20, temperature=0.0)

    got = client.chat.completions.create(
        model=BASE_ID, messages=MESSAGES, max_completion_tokens=20, temperature=0
    )
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        len(ids),
        len(want.token_ids),
    )

    chunks = list(
        client.chat.completions.create(
            model=BASE_ID,
            messages=MESSAGES,
            max_tokens=20,  # the older name
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    last_choice = [c for c in chunks if c.choices][-1].choices[0]
    assert last_choice.finish_reason == want.finish_reason and not last_choice.delta.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


# ---------------------------------------------------------------- adapters through the registry


@pytest.mark.etcd
def test_adapter_registered_over_http_serves_its_owner_only(
    tenants_app: Served, keys, backend: LocalBackend, offline, tokenizer, demo_assets
):
    url, acme_key = tenants_app.url, keys["acme"]
    folder = demo_assets.adapters_dir / DEMO_ADAPTER
    r = httpx.post(
        f"{url}/v1/adapters",
        data={"name": "sql"},
        files={
            "adapter_config": (CONFIG_FILE, (folder / CONFIG_FILE).read_bytes()),
            "adapter_model": (WEIGHTS_FILE, (folder / WEIGHTS_FILE).read_bytes()),
        },
        headers={"Authorization": f"Bearer {acme_key}"},
    )
    assert r.status_code == 201, r.text
    record = Adapter.model_validate(r.json())
    acme, globex = tenants_app.client(acme_key), tenants_app.client(keys["globex"])
    ids = tokenizer.encode(PROMPT)
    greedy = {"max_tokens": 24, "temperature": 0}

    # registered, but not yet loaded in the replica: the backend's AdapterNotFound is a 404
    with pytest.raises(openai.NotFoundError):
        acme.completions.create(model="sql", prompt=PROMPT, **greedy)

    sql_id = adapter_id("acme", "sql", record.version)
    path = tenants_app.registry.artifacts.path_of(record.artifact)
    asyncio.run(backend.ensure_adapter(sql_id, path))
    try:
        want = expected(offline, ids, DEMO_ADAPTER, max_tokens=24, temperature=0.0)
        base = expected(offline, ids, None, max_tokens=24, temperature=0.0)
        assert want.token_ids != base.token_ids, "the adapter must change the greedy output"

        got = acme.completions.create(model="sql", prompt=PROMPT, **greedy)
        assert got.model == "sql" and got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        on_base = acme.completions.create(model=BASE_ID, prompt=PROMPT, **greedy)
        assert on_base.choices[0].text == base.text

        chat_ids = tokenizer.apply_chat_template(MESSAGES)
        want_chat = expected(offline, chat_ids, DEMO_ADAPTER, max_tokens=16, temperature=0.0)
        stream = acme.chat.completions.create(
            model="sql", messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want_chat.text

        # another tenant using the name: the same 404 as a name nobody has
        with pytest.raises(openai.NotFoundError) as taken:
            globex.completions.create(model="sql", prompt=PROMPT, **greedy)
        with pytest.raises(openai.NotFoundError) as unknown:
            globex.completions.create(model="nope", prompt=PROMPT, **greedy)
        assert taken.value.body["message"] == "model 'sql' does not exist"
        assert unknown.value.body["message"] == "model 'nope' does not exist"
        assert taken.value.code == "model_not_found"

        listed = {m.id: m.owned_by for m in acme.models.list()}
        assert listed == {BASE_ID: "loraplex", "sql": "acme"}
        assert [m.id for m in globex.models.list()] == [BASE_ID]

        r = httpx.delete(f"{url}/v1/adapters/sql", headers={"Authorization": f"Bearer {acme_key}"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            acme.completions.create(model="sql", prompt=PROMPT, **greedy)
        assert [m.id for m in acme.models.list()] == [BASE_ID]
    finally:
        asyncio.run(backend.remove_adapter(sql_id))


# ---------------------------------------------------------------- errors


@pytest.mark.etcd
def test_errors_have_the_openai_shape(tenants_app: Served, keys, engine: Engine, tokenizer):
    url = f"{tenants_app.url}/v1/completions"
    acme = {"Authorization": f"Bearer {keys['acme']}"}
    ok = {"model": BASE_ID, "prompt": PROMPT, "max_tokens": 4}

    assert "Bearer" in openai_error(httpx.post(url, json=ok), 401)["message"]
    assert openai_error(httpx.post(url, json=ok), 401)["code"] == "invalid_api_key"
    wrong_key = {"Authorization": "Bearer lpx_not-a-key"}
    assert openai_error(httpx.post(url, json=ok, headers=wrong_key), 401)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert "tenant API key" in openai_error(httpx.post(url, json=ok, headers=admin), 403)["message"]

    error = openai_error(httpx.post(url, json=ok | {"model": "nope"}, headers=acme), 404)
    assert error["message"] == "model 'nope' does not exist" and error["param"] == "model"
    streamed = httpx.post(url, json=ok | {"model": "nope", "stream": True}, headers=acme)
    assert openai_error(streamed, 404)["code"] == "model_not_found"

    bad = {
        "temperature": (-1, "temperature"),
        "top_p": (0, "top_p"),
        "max_tokens": (0, "max_tokens"),
        "n": (2, "n must be 1"),
        "logprobs": (1, "logprobs is not supported"),
        "echo": (True, "echo is not supported"),
        "presence_penalty": (0.5, "presence_penalty is not supported"),
        "tools": ([], "tools: this parameter is not supported"),
        "prompt": (["one", "two"], "batched prompts are not supported"),
        "stop": ([""], "stop strings must not be empty"),
        "stream_options": ({"include_usage": True}, "only allowed when stream is true"),
    }
    for name, (value, message) in bad.items():
        error = openai_error(httpx.post(url, json=ok | {name: value}, headers=acme), 400)
        assert message in error["message"], (name, error)
        assert error["param"] == name or name == "stream_options", (name, error)
    assert (
        "prompt"
        in openai_error(httpx.post(url, json={"model": BASE_ID}, headers=acme), 400)["message"]
    )
    raw = httpx.post(url, content=b"{not json", headers=acme | {"content-type": "application/json"})
    assert "not valid JSON" in openai_error(raw, 400)["message"]
    # sampling values checked as the engine uses them: 1e-46 is 0 as a float32 (it used to
    # stop the replica's engine); seeds outside what torch's generator takes; NaN
    as_used = {
        "top_p": (1e-46, "top_p must be in (0, 1] as a float32"),
        "seed": (2**64, "seed"),
        "temperature": (float("nan"), "temperature"),
    }
    for name, (value, message) in as_used.items():
        body = json.dumps(ok | {name: value})  # NaN as the literal Python's json reads
        sent = httpx.post(url, content=body, headers=acme | {"content-type": "application/json"})
        error = openai_error(sent, 400)
        assert message in error["message"] and error["param"] == name, (name, error)
    assert httpx.post(url, json=ok | {"top_p": 1e-44}, headers=acme).status_code == 200
    # token ids the model does not have: refused by the engine (a ValueError), still a 400
    vocab = engine.core.model_config.vocab_size
    error = openai_error(httpx.post(url, json=ok | {"prompt": [1, vocab]}, headers=acme), 400)
    assert str(vocab) in error["message"]

    # ids no vocabulary has, or not ints, refused by the schema (a 2^63 one raised
    # OverflowError in the Ray router's prefix keys: 120 s, then 503)
    for ids in ([1, 2**63], [1, 2**64], [-1, 2], [True, 2], [1.5], [1, "2"], [1, None]):
        body = json.dumps(ok | {"prompt": ids})
        sent = httpx.post(url, content=body, headers=acme | {"content-type": "application/json"})
        error = openai_error(sent, 400)
        # past 64 bits the body's JSON itself is refused (loraplex.strict_json), naming it
        big = any(type(i) is int and abs(i) >= 2**63 for i in ids)
        expected = "64-bit range" if big else "token ids must be integers"
        assert expected in error["message"], (ids, error)
        assert error["param"] == "prompt", error
    # a list past any model's window: refused on its length, before any id is looked at;
    # in a body over 64 KiB, by the child process that parses it (loraplex/json_process.py),
    # at this model's window: the ints never reach the ingress's interpreter
    past = ok | {"prompt": [1] * (MAX_PROMPT_TOKEN_IDS + 1)}
    error = openai_error(httpx.post(url, json=past, headers=acme, timeout=30), 400)
    window = engine.core.max_model_len
    assert error["param"] == "prompt", error
    assert f"{MAX_PROMPT_TOKEN_IDS + 1} items; at most {window}" in error["message"], error
    assert "context window" in error["message"], error

    limit = engine.core.max_model_len
    too_long = ok | {"prompt": [1] * (limit - 8), "max_tokens": 16}
    error = openai_error(httpx.post(url, json=too_long, headers=acme), 400)
    assert error["code"] == "context_length_exceeded"
    for number in (limit, limit - 8, 16, limit + 8):
        assert str(number) in error["message"]

    chat = f"{tenants_app.url}/v1/chat/completions"
    chat_ok = {"model": BASE_ID, "messages": MESSAGES, "max_tokens": 4}
    chat_bad = [
        ({"messages": []}, "messages"),
        ({"logprobs": True}, "logprobs is not supported"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "not both"),
    ]
    for change, message in chat_bad:
        error = openai_error(httpx.post(chat, json=chat_ok | change, headers=acme), 400)
        assert message in error["message"], (change, error)
    huge = [{"role": "user", "content": "word " * limit}]
    error = openai_error(httpx.post(chat, json=chat_ok | {"messages": huge}, headers=acme), 400)
    assert error["code"] == "context_length_exceeded"

    client = tenants_app.client(keys["acme"])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE_ID, prompt=PROMPT, n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.AuthenticationError):
        tenants_app.client("lpx_wrong").models.list()

    assert openai_error(httpx.get(f"{tenants_app.url}/v1/models"), 401)

    # the mounted tenant API keeps its own error bodies
    r = httpx.get(f"{tenants_app.url}/v1/adapters")
    assert r.status_code == 401 and "detail" in r.json()
    assert idle(engine)


# ---------------------------------------------------------------- cancellation


def test_client_disconnect_mid_stream_aborts_the_request(anonymous: Served, engine: Engine):
    ids_room = engine.core.max_model_len - 16  # far more tokens than the test waits for
    body = {
        "model": BASE_ID,
        "prompt": PROMPT,
        "max_tokens": ids_room,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{anonymous.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()  # held: dropping the iterator would close the response
            events = [line for line in itertools.islice(lines, 6) if line]
            assert len(events) == 3 and all(json.loads(e[6:])["choices"] for e in events)
            stats = asyncio.run(engine.stats())
            assert stats["running"] == 1 and stats["pool"]["kv_pages"] > 0, stats
            (seq,) = list(engine.core.requests.values())
        closed = time.monotonic()
    assert wait_until(lambda: idle(engine), timeout=5), asyncio.run(engine.stats())
    assert time.monotonic() - closed < 2.0
    assert seq.finish_reason == "abort" and len(seq.output_ids) < body["max_tokens"]


def test_client_gone_before_a_whole_answer_aborts_the_request(anonymous: Served, engine: Engine):
    body = {
        "model": BASE_ID,
        "prompt": PROMPT,
        "max_tokens": engine.core.max_model_len - 16,
        "ignore_eos": True,
    }
    seqs = []

    def watch():  # the request's engine state, caught while it runs
        wait_until(lambda: bool(engine.core.requests), timeout=5)
        seqs.extend(engine.core.requests.values())

    watcher = threading.Thread(target=watch)
    watcher.start()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{anonymous.url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    gone = time.monotonic()
    watcher.join()
    assert wait_until(lambda: idle(engine), timeout=5), asyncio.run(engine.stats())
    assert time.monotonic() - gone < 2.0
    (seq,) = seqs
    assert seq.finish_reason == "abort" and len(seq.output_ids) < body["max_tokens"]


# ---------------------------------------------------------------- models, health, metrics


def samples(url: str, key: str | None = None) -> dict[tuple[str, frozenset], float]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    r = httpx.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


@pytest.mark.etcd
def test_models_health_and_metrics(tenants_app: Served, anonymous: Served, keys, engine, tokenizer):
    for served in (tenants_app, anonymous):
        r = httpx.get(f"{served.url}/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = anonymous.client().models.list()
    assert [(m.id, m.object) for m in models] == [(BASE_ID, "model")]
    with pytest.raises(openai.NotFoundError):  # without a registry there are no adapters
        anonymous.client().completions.create(model="sql", prompt=PROMPT)

    acme = tenants_app.client(keys["acme"])
    out = acme.completions.create(model=BASE_ID, prompt=PROMPT, max_tokens=8, temperature=0)
    with pytest.raises(openai.NotFoundError):
        acme.completions.create(model="nope", prompt=PROMPT)
    got = samples(tenants_app.url, METRICS_KEY)  # the engine is idle: its figures hold still

    def value(name: str, **labels) -> float:
        return got.get((name, frozenset(labels.items())), 0.0)

    http = "loraplex_http_requests_total"
    assert value(http, route="/v1/completions", method="POST", status="200") >= 1
    assert value(http, route="/v1/completions", method="POST", status="404") >= 1
    assert value(http, route="/v1/tenants", method="POST", status="201") == 2
    assert value("loraplex_tenant_requests_total", tenant="acme") >= 1
    assert value("loraplex_prompt_tokens_total", tenant="acme") >= len(tokenizer.encode(PROMPT))
    assert value("loraplex_completion_tokens_total", tenant="acme") >= out.usage.completion_tokens
    assert value("loraplex_time_to_first_token_seconds_count") >= 1
    assert value("loraplex_time_between_tokens_seconds_count") >= out.usage.completion_tokens - 1
    assert value("loraplex_request_latency_seconds_count") >= 1
    # the replica side: the engine's own figures, read from the engine, not its stats()
    assert value("loraplex_replicas_reporting") == 1
    core = engine.core
    pool = core.pool.stats()
    for kind, pages in [
        ("total", pool.num_pages),
        ("free", pool.free_pages),
        ("kv", pool.kv_pages),
        ("adapter", pool.adapter_pages),
        ("cached", pool.cached_pages),
        ("pinned", pool.pinned_pages),
    ]:
        assert value("loraplex_pool_pages", replica="local", kind=kind) == pages, kind
    kinds = pool.free_pages + pool.kv_pages + pool.adapter_pages + pool.cached_pages
    assert kinds == pool.num_pages
    resident = set(core.adapters.resident)
    assert value("loraplex_replica_adapters", replica="local", tier="device") == len(resident)
    host = len(set(core.adapters.host) - resident)
    assert value("loraplex_replica_adapters", replica="local", tier="host") == host
    assert value("loraplex_replica_adapters", replica="local", tier="loading") == 0
    cache = core.adapters.stats
    for event, count in [
        ("hit", cache.hits),
        ("miss", cache.misses),
        ("load", cache.loads),
        ("eviction", cache.evictions),
    ]:
        assert value("loraplex_adapter_cache_events_total", replica="local", event=event) == count
    for state in ("waiting", "running"):
        assert value("loraplex_replica_requests", replica="local", state=state) == 0
    preempted = value("loraplex_replica_preemptions_total", replica="local")
    assert preempted == core.scheduler.num_preemptions
    assert value("loraplex_engine_steps_total", replica="local") == core.steps > 0
    busy = value("loraplex_engine_step_seconds_total", replica="local")
    assert busy == pytest.approx(core.step_seconds) and busy > 0

    # one registry per app: the anonymous app counted none of acme's requests
    other = samples(anonymous.url)
    assert ("loraplex_tenant_requests_total", frozenset({"tenant": "acme"}.items())) not in other
    assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("loraplex")]


def test_local_backend_ensure_adapter_is_idempotent(backend: LocalBackend, demo_assets):
    folder = Path(demo_assets.adapters_dir / DEMO_ADAPTER)
    name = adapter_id("t", "once", "0" * 64)
    try:
        assert asyncio.run(backend.ensure_adapter(name, folder)) is not None
        assert asyncio.run(backend.ensure_adapter(name, folder)) is None
    finally:
        asyncio.run(backend.remove_adapter(name))


def test_closing_a_local_stream_aborts_before_aclose_returns(backend: LocalBackend, engine):
    request = GenerateRequest(
        request_id="close-me",
        prompt_token_ids=[1, 2, 3],
        adapter=None,
        params={"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True},
    )

    async def run() -> None:
        stream = backend.generate(request)
        # the tokens so far: 1, or more where the engine stepped again before this read
        # (seen once with another test process on the second core)
        assert (await anext(stream))["num_output_tokens"] >= 1
        await stream.aclose()
        assert not engine.core.requests  # no garbage collector, no later task involved

    asyncio.run(run())
    assert idle(engine)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("events_read", [0, 2])
def test_sse_response_aborts_the_request_when_the_client_leaves(
    anonymous: Served, engine: Engine, spec_version: str, events_read: int
):
    """At the ASGI level, both ways Starlette learns of a disconnect: a disconnect message
    (ASGI spec 2.3, as uvicorn speaks; Starlette cancels the response task) and a failing
    send (spec 2.4). A failing send cancels nothing, so only the response closing its
    generators aborts the request: it must be out of the engine when the app returns."""
    body = json.dumps(
        {"model": BASE_ID, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    ).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }

    async def run() -> list[dict]:
        sent: list[dict] = []
        left = asyncio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if left.is_set() and spec_version == "2.4":
                raise OSError("client gone")
            sent.append(message)
            if message["type"] == "http.response.start" or message.get("body"):
                if len(sent) == 1 + events_read:
                    left.set()

        try:
            await app(scope, receive, send)
        except ClientDisconnect:  # how Starlette ends a response under spec 2.4
            assert spec_version == "2.4"
        if spec_version == "2.4":
            assert not engine.core.requests
        # Under 2.3 the cancellation reaches into the engine's stream, which then aborts from
        # a shielded task: moments later, on this loop (a server's loop keeps running).
        for _ in range(200):
            if not engine.core.requests:
                break
            await asyncio.sleep(0.01)
        assert not engine.core.requests
        return sent

    app = anonymous.app
    sent = asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert len(sent) >= 1 + events_read
    assert idle(engine)


def test_chat_needs_a_chat_template(backend: LocalBackend, demo_assets, tmp_path: Path):
    (tmp_path / "tokenizer.json").write_bytes((demo_assets.model / "tokenizer.json").read_bytes())
    config = json.loads((demo_assets.model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    app = build_ingress(
        backend, Tokenizer(tmp_path), base_model_id=BASE_ID, max_model_len=2048, registry=None
    )
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"model": BASE_ID, "messages": MESSAGES})
    assert "no chat template" in openai_error(r, 400)["message"]


class FailingBackend:
    """A backend whose replica dies after `chunks_before` chunks (a real replica death needs
    Ray: the cluster tests cover it end to end)."""

    def __init__(self, chunks_before: int) -> None:
        self.chunks_before = chunks_before

    async def generate(self, request: GenerateRequest):
        for i in range(self.chunks_before):
            yield GenerateChunk(
                request_id=request["request_id"],
                new_token_ids=[65 + i],
                new_text="x",
                finished=False,
                finish_reason=None,
                num_prompt_tokens=len(request["prompt_token_ids"]),
                num_output_tokens=i + 1,
            )
        raise ReplicaFailed(f"request {request['request_id']}: the replica died")


class RequestFailingBackend(FailingBackend):
    """A replica whose engine ends one request with an error after `chunks_before` chunks
    (what the engine sends when sampling, stop handling or the adapter's load fails for that
    request alone; tests/test_fault_isolation.py checks the engine side)."""

    async def generate(self, request: GenerateRequest):
        n = len(request["prompt_token_ids"])
        for i in range(self.chunks_before):
            yield GenerateChunk(
                request_id=request["request_id"],
                new_token_ids=[65 + i],
                new_text="x",
                finished=False,
                finish_reason=None,
                num_prompt_tokens=n,
                num_output_tokens=i + 1,
            )
        yield GenerateChunk(
            request_id=request["request_id"],
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=n,
            num_output_tokens=self.chunks_before,
            error="the adapter failed to load; retry",
        )


def test_a_request_failing_in_the_engine_is_a_500_or_an_error_event(tokenizer: Tokenizer):
    body = {"model": BASE_ID, "prompt": PROMPT, "max_tokens": 8}

    def app(chunks_before: int) -> FastAPI:
        return build_ingress(
            RequestFailingBackend(chunks_before),
            tokenizer,
            base_model_id=BASE_ID,
            max_model_len=2048,
            registry=None,
        )

    with TestClient(app(0)) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json=body | {"stream": stream})
            assert openai_error(r, 500)["message"] == "the adapter failed to load; retry"
    with TestClient(app(2)) as client:
        r = client.post("/v1/completions", json=body | {"stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["x", "x"]
        error = json.loads(events[2])["error"]
        assert error == {
            "message": "the adapter failed to load; retry",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        assert events[3:] == ["[DONE]"]
        assert (
            "failed to load"
            in openai_error(client.post("/v1/completions", json=body), 500)["message"]
        )


def test_replica_failures_are_503_or_an_error_event(tokenizer: Tokenizer):
    body = {"model": BASE_ID, "prompt": PROMPT, "max_tokens": 8}

    def app(chunks_before: int) -> FastAPI:
        backend = FailingBackend(chunks_before)
        return build_ingress(
            backend, tokenizer, base_model_id=BASE_ID, max_model_len=2048, registry=None
        )

    with TestClient(app(0)) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json=body | {"stream": stream})
            assert "the replica died; retry" in openai_error(r, 503)["message"]
    with TestClient(app(2)) as client:
        r = client.post("/v1/completions", json=body | {"stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["x", "x"]
        error = json.loads(events[2])["error"]
        assert error["type"] == "server_error" and "the replica died" in error["message"]
        assert events[3:] == ["[DONE]"]
        assert openai_error(client.post("/v1/completions", json=body), 503)


class _SilentBackend:
    """A backend whose replicas never answer within the first-chunk bound (what ServeBackend
    raises when its `first_chunk_timeout_s` passes)."""

    async def generate(self, request):
        raise TimeoutError
        yield  # an async generator, like every backend


def test_no_first_token_in_time_is_a_503_not_a_hang(demo_assets: DemoAssets):
    from loraplex.replica.tokenizer import Tokenizer
    from loraplex.router.ingress import build_ingress

    app = build_ingress(
        _SilentBackend(),
        Tokenizer(demo_assets.model),
        base_model_id="base",
        max_model_len=256,
        registry=None,
    )
    with TestClient(app) as client:
        for stream in (False, True):
            r = client.post(
                "/v1/completions",
                json={"model": "base", "prompt": "hi", "max_tokens": 4, "stream": stream},
            )
            assert r.status_code == 503
            assert r.headers["retry-after"] == "5"
            assert "first token in time" in r.json()["error"]["message"]
