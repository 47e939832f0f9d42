"""The whole product end to end: `loraplex up` in a subprocess (its supervisor starts a real
etcd, a real local Ray head and the Serve app of two replicas behind the ingress), spoken to
only through real HTTP (the official `openai` client, raw httpx, `loraplex status`), and
`loraplex down` at the end, whatever happened.

One cluster for the module (a start costs 15-35 s on two cores). Tests that need Ray's view
(where an adapter is resident, which actor to kill) connect a driver to the cluster's Ray
address from cluster.json; they are skipped, with the reason, when that connection fails.

Oracle: the engine run offline (`LLMEngine`) in this process, built from the same config file
the cluster runs, on the same prompt ids, adapter folder and greedy settings.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from process_memory import peak_growth
from prometheus_client.parser import text_string_to_metric_families

from loraplex.cluster.adapters_cli import Endpoint, add_adapter, remove_adapter
from loraplex.cluster.config import LoraplexConfig
from loraplex.cluster.local_cluster import ray_temp_dir
from loraplex.cluster.serve_status import short_ids
from loraplex.cluster.state import pid_alive, read_state, stop_orphaned_etcd
from loraplex.demo.assets import DemoAssets
from loraplex.net import free_port
from loraplex.registry.etcd_process import INSTALL_HINT, find_etcd_binary
from loraplex.replica.config import build_engine_config
from loraplex.replica.engine import LLMEngine
from loraplex.replica.protocol import adapter_id
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import RequestOutput
from loraplex.router.walk import walk_order

pytestmark = [
    pytest.mark.ray,
    pytest.mark.etcd,
    # Ray Serve's own config models, imported by the driver: not ours to fix
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.serve._private.config"),
]

BASE_ID = "loraplex-demo-llama"
MAX_MODEL_LEN = 1024
APP = "loraplex"
REPLICA_PREFIX = f"SERVE_REPLICA::{APP}#replica#"
PROMPT = "Once upon a time there was"
MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a fruit."},
]
MAX_TOKENS = 24
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0}
CLIENT_TIMEOUT_S = 30.0  # every HTTP call of these tests is bounded by this
PROBES = tuple(f"probe-{i}" for i in range(12))  # cold adapters for the replacement replica
CLI_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
CLI_ENV.pop("LORAPLEX_ADMIN_KEY", None)  # the state folder's generated key, not the caller's


# ---------------------------------------------------------------- the cluster


def loraplex(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loraplex.cluster.cli", *args],
        env=CLI_ENV,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass(frozen=True)
class Cluster:
    url: str
    state_dir: Path
    admin_key: str
    metrics_key: str
    demo_key: str
    ray_address: str

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S
        )

    def endpoint(self, key: str) -> Endpoint:
        return Endpoint(self.url, key, timeout_s=CLIENT_TIMEOUT_S)

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.Client(
            base_url=self.url, headers=headers, timeout=CLIENT_TIMEOUT_S, trust_env=False
        )


@pytest.fixture(scope="module")
def config_file(demo_assets: DemoAssets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two CPU replicas of the demo model with a small pool, on a free port."""
    settings = {
        "model": str(demo_assets.model),
        "model_id": BASE_ID,
        "engine": {
            "max_model_len": MAX_MODEL_LEN,
            "pool_mib": 32,
            "page_kib": 64,
            "max_num_seqs": 8,
            # a chunk a token, as before the per-stream cap: the stickiness test needs its
            # 800-token streams to outlast two stats periods, and with 20 chunks a second the
            # relay no longer slows the engine, so on the demo model they ended in ~1 s
            "stream_events_per_s_per_stream": 0,
        },
        "replicas": {"num_replicas": 2, "num_cpus": 1},
        # a short rate window: the hot-adapter test sees homes grow and shrink in seconds
        "router": {"stats_period_s": 0.5, "rate_window_s": 3.0},
        "http": {"port": free_port()},
    }
    return yaml_config(tmp_path_factory.mktemp("e2e_config"), settings)


def yaml_config(folder: Path, settings: dict[str, Any]) -> Path:
    """`settings` written as `folder`/loraplex.yaml."""
    path = folder / "loraplex.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


@contextlib.contextmanager
def cluster_up(
    config_file: Path, state_dir: Path, timeout_s: int = 150
) -> Iterator[tuple[dict[str, Any], str]]:
    """`loraplex up --config config_file` with its state in `state_dir`: the running state
    and what `up` printed; `loraplex down` (`stop_cluster`) on exit, however it exits. Skips
    without an etcd server binary."""
    if find_etcd_binary() is None:
        pytest.skip(f"no etcd server binary; install one: {INSTALL_HINT}")
    try:
        try:
            up = loraplex(
                "up", "--state-dir", str(state_dir), "--config", str(config_file),
                "--timeout", str(timeout_s),
                timeout=timeout_s + 30,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"`loraplex up` did not return in {e.timeout}s\n{_log_tail(state_dir)}")
        assert up.returncode == 0, f"`loraplex up` failed:\n{up.stderr}\n{_log_tail(state_dir)}"
        state = read_state(state_dir)
        assert state is not None and state["phase"] == "running", state
        yield state, up.stdout
    finally:
        stop_cluster(state_dir)


def cluster_of(state: dict[str, Any], state_dir: Path) -> Cluster:
    """The keys and addresses of a running cluster, read from its state folder."""
    return Cluster(
        url=state["url"],
        state_dir=state_dir,
        admin_key=(state_dir / "admin_key").read_text().strip(),
        metrics_key=(state_dir / "metrics_key").read_text().strip(),
        demo_key=(state_dir / "demo_api_key").read_text().strip(),
        ray_address=state["ray_address"],
    )


@pytest.fixture(scope="module")
def cluster(config_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state_dir = (tmp_path_factory.mktemp("e2e_cluster") / "state").resolve()
    with cluster_up(config_file, state_dir) as (state, printed):
        url = state["url"]
        assert f"loraplex is serving {BASE_ID} at {url} (2 replicas" in printed, printed
        running = cluster_of(state, state_dir)
        assert running.demo_key in printed  # the welcome shows the key to try
        yield running


def stop_cluster(state_dir: Path) -> None:
    """`loraplex down`; if it fails, kill the supervisor (and its etcd) by the recorded pids.
    Raises afterwards when `down` did not do its job."""
    problems = []
    try:
        down = loraplex("down", "--state-dir", str(state_dir), timeout=150)
        if down.returncode != 0:
            problems.append(f"`loraplex down` exited {down.returncode}: {down.stderr}")
    except subprocess.TimeoutExpired:
        problems.append("`loraplex down` did not return in 150 s")
    state = read_state(state_dir) or {}
    pid = state.get("pid")
    if pid_alive(pid):  # only while that pid still runs our supervisor
        problems.append(f"the supervisor (pid {pid}) outlived `loraplex down`: killed")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        stop_orphaned_etcd(state, state_dir)
    shutil.rmtree(ray_temp_dir(state_dir), ignore_errors=True)
    assert not problems, "; ".join(problems) + "\n" + _log_tail(state_dir)


def _log_tail(state_dir: Path, lines: int = 40) -> str:
    try:
        text = (state_dir / "cluster.log").read_text(errors="replace")
    except OSError:
        return "(no cluster.log)"
    return "cluster.log:\n" + "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def keys(cluster: Cluster) -> dict[str, str]:
    """API keys: tenant `acme`, created here with the admin key; tenant `demo`, which
    `loraplex up` created and whose key it stored in the state folder."""
    with cluster.http(cluster.admin_key) as http:
        r = http.post("/v1/tenants", json={"name": "acme"})
    assert r.status_code == 201, r.text
    return {"acme": r.json()["api_key"], "demo": cluster.demo_key}


@pytest.fixture(scope="module")
def ray_driver(cluster: Cluster) -> Iterator[Any]:
    """The `ray` module, connected as a driver to the cluster's Ray (disconnected after)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process already runs a Ray driver; cannot connect to the cluster")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        try:
            ray.init(
                address=cluster.ray_address, log_to_driver=False, logging_level=logging.WARNING
            )
        except Exception as e:  # noqa: BLE001
            pytest.skip(
                f"cannot connect a driver to the cluster's Ray at {cluster.ray_address}: {e!r}"
            )
        try:
            yield ray
        finally:
            ray.shutdown()


# ---------------------------------------------------------------- oracle and helpers


@pytest.fixture(scope="module")
def oracle(config_file: Path, demo_assets: DemoAssets) -> LLMEngine:
    """The replicas' engine configuration (read from the same file), run offline, with the
    demo adapters read from the demo folder under their own names."""
    config = LoraplexConfig.from_yaml(config_file)
    engine = LLMEngine(build_engine_config(config.engine_config()))
    for name in ("sql-r8", "code-r32", "legal-r8", "chat-r16"):
        engine.add_adapter(name, demo_assets.adapters_dir / name)
    return engine


def offline(
    oracle: LLMEngine,
    ids: list[int],
    adapter: str | None,
    max_tokens: int = MAX_TOKENS,
    ignore_eos: bool = False,
) -> RequestOutput:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    (out,) = oracle.generate([ids], [params], [adapter])
    assert out.token_ids, "the oracle produced nothing"
    return out


def register(
    cluster: Cluster, key: str, name: str, demo: DemoAssets, source: str
) -> dict[str, Any]:
    """Upload the demo adapter `source` as `name` through the tenant API (multipart)."""
    return add_adapter(
        cluster.endpoint(key), name, path=demo.adapters_dir / source, progress=io.StringIO()
    )


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.2)
    return value


def complete(client: openai.OpenAI, model: str, **kwargs: Any):
    return client.completions.create(model=model, prompt=PROMPT, **{**GREEDY, **kwargs})


def servable(client: openai.OpenAI, model: str, timeout: float = 10.0) -> None:
    """Wait until `model` is served (the registry watch reaches the ingress and replicas
    within milliseconds; the bound only absorbs a loaded machine)."""

    def answers() -> bool:
        try:
            complete(client, model, max_tokens=1)
        except openai.NotFoundError:
            return False
        return True

    wait_until(answers, timeout, f"model {model!r} to be served")


def not_found(client: openai.OpenAI, model: str) -> bool:
    try:
        complete(client, model, max_tokens=1)
    except openai.NotFoundError as e:
        assert (
            e.code == "model_not_found" and e.body["message"] == f"model {model!r} does not exist"
        )
        return True
    return False


class Streams:
    """Long streaming completions, one thread each. Each ends with its completion-token count
    (from the usage chunk) and its text, or with the openai.APIError that ended it (an error
    event, a timeout). `stagger_s`: the i-th stream starts i x that after the first."""

    def __init__(
        self, client: openai.OpenAI, models: list[str], max_tokens: int, stagger_s: float = 0.0
    ):
        self.started = [threading.Event() for _ in models]
        self.pool = ThreadPoolExecutor(len(models))
        self.futures = [
            self.pool.submit(self._run, client, model, max_tokens, started, i * stagger_s)
            for i, (model, started) in enumerate(zip(models, self.started, strict=True))
        ]

    @staticmethod
    def _run(
        client: openai.OpenAI,
        model: str,
        max_tokens: int,
        started: threading.Event,
        delay_s: float = 0.0,
    ) -> tuple[int, str] | openai.APIError:
        time.sleep(delay_s)
        try:
            with complete(
                client,
                model,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ) as events:
                usage, text = None, []
                for event in events:
                    started.set()
                    usage = event.usage or usage
                    text += [choice.text for choice in event.choices]
                return (-1 if usage is None else usage.completion_tokens), "".join(text)
        except openai.APIError as e:
            return e
        finally:
            started.set()

    def wait_started(self, timeout: float = 30.0) -> None:
        """Until every stream has its first event (its replica produced a token)."""
        for started in self.started:
            assert started.wait(timeout), f"a stream sent no first event within {timeout}s"

    def settled(self, at_least: int, quiet_s: float = 1.0, timeout: float = 60.0) -> int:
        """Once `at_least` streams have ended and no other ends for `quiet_s` (the ingress
        has nothing more to deliver), how many are still open."""
        deadline = time.monotonic() + timeout
        while sum(f.done() for f in self.futures) < at_least:
            assert time.monotonic() < deadline, f"fewer than {at_least} streams ended in {timeout}s"
            time.sleep(0.05)
        while True:
            done = sum(f.done() for f in self.futures)
            time.sleep(quiet_s)
            if sum(f.done() for f in self.futures) == done:
                return len(self.futures) - done

    def results(self, timeout: float = 90.0) -> list[tuple[int, str] | openai.APIError]:
        deadline = time.monotonic() + timeout
        return [f.result(timeout=max(0.1, deadline - time.monotonic())) for f in self.futures]

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def replica_actors(ray) -> dict[str, str]:
    """Live replica actors of the replica deployment: replica id -> actor name."""
    return {
        entry["name"].removeprefix(REPLICA_PREFIX): entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == "serve" and entry["name"].startswith(REPLICA_PREFIX)
    }


def actor_pid(ray, name: str, namespace: str = "serve") -> int:
    """The process id of an actor (a replica's, by default)."""
    actor = ray.get_actor(name, namespace=namespace)
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)


class Frozen:
    """A process stopped (SIGSTOP) for the block: `kill()` ends it (SIGKILL, as a crash
    would); otherwise it runs on (SIGCONT) when the block ends."""

    def __init__(self, pid: int):
        self.pid = pid
        self.killed = False

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.killed = True

    def __enter__(self) -> Frozen:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.killed:
            os.kill(self.pid, signal.SIGCONT)


def routing_stats(ray) -> dict[str, dict[str, Any]]:
    """Each live replica's routing stats, read from its actor (what the router ranks on)."""
    actors = replica_actors(ray)
    refs = {
        replica: ray.get_actor(name, namespace="serve").record_routing_stats.remote()
        for replica, name in actors.items()
    }
    stats = {}
    for replica, ref in refs.items():
        try:
            stats[replica] = ray.get(ref, timeout=10)
        except Exception:  # noqa: BLE001  (a replica stopping meanwhile)
            continue
    return stats


def holders(ray, adapter: str) -> dict[str, str]:
    """replica id -> tier ("device", "host" or "loading") of every replica holding `adapter`."""
    held = {}
    for replica, stats in routing_stats(ray).items():
        for tier in ("device", "host", "loading"):
            if adapter in stats[f"{tier}_adapters"]:
                held[replica] = tier
    return held


def status_table(cluster: Cluster) -> tuple[str, dict[str, dict[str, list[str]]]]:
    """`loraplex status`: its output, and its replica table as replica id -> {"device":
    [...], "host": [...], "loading": [...]}."""
    status = loraplex("status", "--state-dir", str(cluster.state_dir), "--full-ids", timeout=90)
    assert status.returncode == 0, status.stdout + status.stderr
    lines = status.stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.split()[:2] == ["replica", "queue"]]
    assert len(header) == 1, status.stdout
    table = {}
    for line in lines[header[0] + 1 :]:
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == 6, f"unexpected status row {line!r}:\n{status.stdout}"
        replica, _queue, _pages, *tiers = cells
        table[replica] = {
            tier: [] if cell == "-" else cell.split(", ")
            for tier, cell in zip(("device", "host", "loading"), tiers, strict=True)
        }
    return status.stdout, table


# ---------------------------------------------------------------- the tests


def test_adapter_registered_over_http_serves_the_engines_output_until_deleted(
    cluster: Cluster, keys: dict[str, str], oracle: LLMEngine, demo_assets: DemoAssets
):
    acme = cluster.client(keys["acme"])
    record = register(cluster, keys["acme"], "sql", demo_assets, "sql-r8")
    assert (record["name"], record["rank"]) == ("sql", 8)
    servable(acme, "sql")

    ids = oracle.tokenizer.encode(PROMPT)
    want = offline(oracle, ids, "sql-r8")
    base = offline(oracle, ids, None)
    assert want.token_ids != base.token_ids, "the adapter must change the greedy output"

    got = complete(acme, "sql")
    assert got.model == "sql" and got.object == "text_completion"
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want.token_ids))

    chunks = list(complete(acme, "sql", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    assert complete(acme, BASE_ID).choices[0].text == base.text

    # chat: the template's ids through the adapter, whole and streamed
    chat_ids = oracle.tokenizer.apply_chat_template(MESSAGES)
    want_chat = offline(oracle, chat_ids, "sql-r8", max_tokens=16)
    whole = acme.chat.completions.create(
        model="sql", messages=MESSAGES, max_tokens=16, temperature=0
    )
    streamed = acme.chat.completions.create(
        model="sql", messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert whole.choices[0].message.content == text == want_chat.text
    assert whole.usage.completion_tokens == len(want_chat.token_ids)

    removed = remove_adapter(cluster.endpoint(keys["acme"]), "sql")
    assert removed["name"] == "sql"
    wait_until(lambda: not_found(acme, "sql"), 10, "the delete to reach the ingress")
    assert "sql" not in {m.id for m in acme.models.list()}


def test_requests_for_an_adapter_stay_on_the_replica_holding_it(
    cluster: Cluster, keys: dict[str, str], demo_assets: DemoAssets, ray_driver
):
    """An adapter made resident away from its consistent-hash home (the home's batch was full
    and over the bounded load when it was first requested) keeps being served where it is
    resident: the home, idle again, never loads it."""
    ray = ray_driver
    acme = cluster.client(keys["acme"])
    # an adapter of this test's own: no other test's requests add to its rate (at 2 req/s
    # it would rightly get a second home, and the busy replica would not hold every stream)
    code = register(cluster, keys["acme"], "filler", demo_assets, "code-r32")
    servable(acme, "filler")
    code_id = adapter_id("acme", "filler", code["version"])
    (busy,) = wait_until(lambda: holders(ray, code_id), 10, "the warm-up")
    (other,) = set(replica_actors(ray)) - {busy}
    # an adapter whose home (first on the router's walk: by name, whatever the version) is
    # the replica about to be busy
    name = next(
        f"sticky-{i}"
        for i in range(1000)
        if walk_order(adapter_id("acme", f"sticky-{i}", "0" * 64), [busy, other])[0] == busy
    )
    sticky = adapter_id(
        "acme", name, register(cluster, keys["acme"], name, demo_assets, "chat-r16")["version"]
    )

    # resident on `busy`: all go there, 3 of them, so a cold adapter whose home is `busy` is
    # over the bounded load (a cold home takes one below ceil(1.25 x (3 + 1) / 2) = 3).
    # Started 0.6 s apart, so the adapter keeps one home, well inside both of the policy's
    # counts: by its rate (need = rate x 2 s / (0.5 x 8) < 1 up to 2 req/s) and by the
    # requests its holder reports (3 / (0.5 x 8) = 0.75; 4 sit at 1.0, where one more
    # report tips it to a second home, and 8 need two since issue 22)
    with Streams(acme, ["filler"] * 3, max_tokens=800, stagger_s=0.6) as streams:
        streams.wait_started()
        # the replica publishes the queue (on a loaded machine a stats call can lag), then
        # two stats periods so the ingress's router has received it too
        wait_until(lambda: routing_stats(ray)[busy]["queue_len"] == 3, 15, "the busy queue")
        time.sleep(2.5)
        servable(acme, name)  # its home is over the bounded load: read by the other
        assert holders(ray, sticky) == {other: "device"}
        assert [r if isinstance(r, Exception) else r[0] for r in streams.results()] == [800] * 3
    time.sleep(2.0)  # several stats periods: the ingress's router sees where it is resident

    # its home is idle now, yet every request goes where it is resident. One a second: the
    # rate stays within one home (need = rate x 2 s / (0.5 x 8) < 1 up to 2 req/s; spaced
    # 1 s, decayed over 3 s, the rate settles near 1.2 req/s), so no second home is made
    for _ in range(8):
        started = time.monotonic()
        assert complete(acme, name, max_tokens=8).usage.completion_tokens == 8
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    assert holders(ray, sticky) == {other: "device"}

    # the operator's view agrees
    output, table = status_table(cluster)
    assert "app:      loraplex RUNNING" in output, output
    assert set(table) == {busy, other}, output
    assert [r for r, tiers in table.items() if sticky in tiers["device"]] == [other], output
    assert not any(sticky in tiers["host"] + tiers["loading"] for tiers in table.values())


def router_homes(cluster: Cluster, adapter: str) -> tuple[float, list[str]]:
    """The ingress router's estimate of `adapter`'s rate and its homes, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with cluster.http(cluster.metrics_key) as http:
        r = http.get("/metrics")
    assert r.status_code == 200, r.text
    text = r.text
    rate, homes = 0.0, []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("adapter") != adapter:
                continue
            if sample.name == "loraplex_adapter_request_rate":
                rate = sample.value
            elif sample.name == "loraplex_adapter_home":
                homes.append(sample.labels["replica"])
    return rate, sorted(homes)


def received(ray) -> dict[str, int]:
    """Requests each replica has received so far."""
    return {replica: stats["requests_total"] for replica, stats in routing_stats(ray).items()}


def test_a_hot_adapter_spreads_over_both_replicas_and_back_to_one_when_it_cools(
    cluster: Cluster, keys: dict[str, str], demo_assets: DemoAssets, ray_driver
):
    """With the router's defaults a replica of 8 slots is a home for 2 req/s of one adapter
    (need = rate x 2 s / (0.5 x 8)); at ~8 req/s the adapter gets both replicas as homes and
    both serve it; at 0.5 req/s its rate decays (window 3 s) below (2 - 1) x 0.75 homes'
    worth, the second home is withdrawn and every request goes to the one left."""
    ray = ray_driver
    acme = cluster.client(keys["acme"])
    trending = register(cluster, keys["acme"], "trending", demo_assets, "sql-r8")
    servable(acme, "trending")
    hot = adapter_id("acme", "trending", trending["version"])

    stop = threading.Event()

    def keep_sending() -> None:
        while not stop.is_set():
            complete(acme, "trending", max_tokens=8)

    with ThreadPoolExecutor(4) as pool:
        senders = [pool.submit(keep_sending) for _ in range(4)]
        try:
            wait_until(lambda: len(router_homes(cluster, hot)[1]) == 2, 30, "a second home")
            before = received(ray)
            time.sleep(4.0)
            spread = received(ray)
        finally:
            stop.set()
        for sender in senders:
            sender.result(timeout=CLIENT_TIMEOUT_S)
    rate, homes = router_homes(cluster, hot)
    assert rate > 2.0 and set(homes) == set(spread), (rate, homes, spread)
    assert all(spread[r] - before.get(r, 0) >= 3 for r in spread), (before, spread)
    assert set(holders(ray, hot)) == set(spread)  # resident on both

    def one_home() -> bool:
        complete(acme, "trending", max_tokens=8)
        time.sleep(1.5)
        return len(router_homes(cluster, hot)[1]) == 1

    wait_until(one_home, 60, "the second home to be withdrawn")
    (home,) = router_homes(cluster, hot)[1]
    before = received(ray)
    for _ in range(6):
        complete(acme, "trending", max_tokens=8)
        time.sleep(0.5)
    after = received(ray)
    grew = {r for r in after if after[r] > before.get(r, 0)}
    assert grew == {home}, (home, before, after)
    output = loraplex("status", "--state-dir", str(cluster.state_dir), timeout=90).stdout
    assert re.search(rf"{re.escape(short_ids(hot))}\s+\S+/s\s+{home}", output), output


def test_tenants_see_only_their_own_adapters(
    cluster: Cluster, keys: dict[str, str], oracle: LLMEngine, demo_assets: DemoAssets
):
    acme, demo = cluster.client(keys["acme"]), cluster.client(keys["demo"])
    register(cluster, keys["acme"], "legal", demo_assets, "legal-r8")
    servable(acme, "legal")

    # another tenant asking for acme's adapter: the same 404 as a name nobody has
    assert not_found(demo, "legal") and not_found(demo, "nobody-has-this")
    with pytest.raises(openai.NotFoundError):
        demo.chat.completions.create(model="legal", messages=MESSAGES, max_tokens=4)
    assert [m.id for m in demo.models.list()] == [BASE_ID]
    with cluster.http(keys["demo"]) as http:
        assert http.get("/v1/adapters/legal").status_code == 404
        assert http.delete("/v1/adapters/legal").status_code == 404
    assert complete(acme, "legal").choices  # still acme's

    # the same name in each tenant: two adapters, each served to its owner
    register(cluster, keys["demo"], "legal", demo_assets, "chat-r16")
    servable(demo, "legal")
    ids = oracle.tokenizer.encode(PROMPT)
    acme_want, demo_want = offline(oracle, ids, "legal-r8"), offline(oracle, ids, "chat-r16")
    assert acme_want.text != demo_want.text
    assert complete(acme, "legal").choices[0].text == acme_want.text
    assert complete(demo, "legal").choices[0].text == demo_want.text

    for tenant, client in (("acme", acme), ("demo", demo)):
        with cluster.http(keys[tenant]) as http:
            owned = {r["name"] for r in http.get("/v1/adapters").json()["adapters"]}
        cards = client.models.list().data
        assert {m.id for m in cards} == owned | {BASE_ID}
        assert {m.owned_by for m in cards} == {"loraplex", tenant}
    assert remove_adapter(cluster.endpoint(keys["demo"]), "legal")["rank"] == 16
    assert complete(acme, "legal").choices[0].text == acme_want.text


def test_a_moved_name_serves_new_requests_with_its_new_version(
    cluster: Cluster,
    keys: dict[str, str],
    oracle: LLMEngine,
    demo_assets: DemoAssets,
    ray_driver,
):
    """Streams in flight when `PUT /v1/adapters/{name}` moves the name to new weights end
    with the old weights' exact tokens; every request sent after the PUT was acknowledged
    gets the new weights' exact tokens; the old version leaves every replica once its
    streams ended. A rollback moves the name back at once; a canary sends each request to
    one of the two versions, both in use."""
    ray = ray_driver
    acme = cluster.client(keys["acme"])
    old = register(cluster, keys["acme"], "swap", demo_assets, "sql-r8")
    servable(acme, "swap")
    old_id = adapter_id("acme", "swap", old["version"])
    ids = oracle.tokenizer.encode(PROMPT)
    long = 800  # tokens: seconds of decoding, so the move lands mid-stream (checked below)
    want_long = offline(oracle, ids, "sql-r8", max_tokens=long, ignore_eos=True)
    want_old, want_new = offline(oracle, ids, "sql-r8"), offline(oracle, ids, "chat-r16")
    assert want_old.text != want_new.text, "the two versions must differ in their output"

    folder = demo_assets.adapters_dir / "chat-r16"
    files = {
        "adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
        "adapter_model": (
            "adapter_model.safetensors",
            (folder / "adapter_model.safetensors").read_bytes(),
        ),
    }
    with (
        Streams(acme, ["swap", "swap"], max_tokens=long) as streams,
        cluster.http(keys["acme"]) as http,
    ):
        streams.wait_started()
        moved = http.put("/v1/adapters/swap", files=files)
        assert moved.status_code == 200, moved.text
        assert not any(f.done() for f in streams.futures), "the move did not land mid-stream"
        new_id = adapter_id("acme", "swap", moved.json()["version"])
        assert new_id != old_id
        for _ in range(6):  # arrived after the move was acknowledged
            assert complete(acme, "swap").choices[0].text == want_new.text
        results = streams.results()
        assert results == [(long, want_long.text)] * 2, results

        def old_gone() -> bool:
            return not holders(ray, old_id)

        wait_until(old_gone, 10, "the old version to leave every replica")
        assert holders(ray, new_id)

        back = http.post("/v1/adapters/swap/rollback")
        assert back.status_code == 200 and back.json()["version"] == old["version"], back.text
        assert complete(acme, "swap").choices[0].text == want_old.text

        canary = {"version": moved.json()["version"], "weight": 0.5}
        assert http.put("/v1/adapters/swap/canary", json=canary).status_code == 200
        texts = [complete(acme, "swap").choices[0].text for _ in range(16)]
        both = {want_old.text, want_new.text}
        assert set(texts) == both, texts  # each request one version, both used (2**-15)
    assert remove_adapter(cluster.endpoint(keys["acme"]), "swap")["name"] == "swap"


def test_errors(cluster: Cluster, keys: dict[str, str], oracle: LLMEngine):
    acme = cluster.client(keys["acme"])

    with pytest.raises(openai.NotFoundError) as unknown:
        complete(acme, "no-such-model")
    assert unknown.value.status_code == 404 and unknown.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        acme.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)

    bad_params = [{"temperature": 5}, {"top_p": 0}, {"max_tokens": 0}, {"n": 2}, {"logprobs": 2}]
    for bad in bad_params:
        with pytest.raises(openai.BadRequestError) as refused:
            complete(acme, BASE_ID, **bad)
        assert refused.value.status_code == 400, bad
    with pytest.raises(openai.BadRequestError):
        acme.chat.completions.create(model=BASE_ID, messages=[], max_tokens=4)
    with cluster.http(keys["acme"]) as http:
        r = http.post(
            "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"], r.text
        r = http.post("/v1/completions", json={"model": BASE_ID})  # no prompt
        assert r.status_code == 400, r.text

    # the context window: prompt + max_tokens up to MAX_MODEL_LEN is served, beyond it is 400
    ids = (oracle.tokenizer.encode(PROMPT) * MAX_MODEL_LEN)[: MAX_MODEL_LEN - 8]
    fits = acme.completions.create(model=BASE_ID, prompt=ids, max_tokens=8, temperature=0)
    assert fits.usage.prompt_tokens + fits.usage.completion_tokens <= MAX_MODEL_LEN
    for prompt, max_tokens in ((ids, 9), (ids * 2, 1), (PROMPT, MAX_MODEL_LEN)):
        with pytest.raises(openai.BadRequestError) as too_long:
            acme.completions.create(model=BASE_ID, prompt=prompt, max_tokens=max_tokens)
        assert too_long.value.code == "context_length_exceeded", too_long.value.body
    with pytest.raises(openai.BadRequestError) as too_long:
        acme.chat.completions.create(model=BASE_ID, messages=MESSAGES, max_tokens=MAX_MODEL_LEN)
    assert too_long.value.code == "context_length_exceeded"

    # keys: none, unknown, or the admin's on an inference route
    body = {"model": BASE_ID, "prompt": PROMPT, "max_tokens": 4}
    with cluster.http() as http:
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = http.post(route, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/adapters").status_code == 401
        assert http.post("/v1/tenants", json={"name": "intruder"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        complete(cluster.client("lpx_not-a-key"), BASE_ID)
    with pytest.raises(openai.PermissionDeniedError):
        complete(cluster.client(cluster.admin_key), BASE_ID)
    with cluster.http(keys["acme"]) as http:  # a tenant key cannot administer
        assert http.post("/v1/tenants", json={"name": "intruder"}).status_code == 403


def test_a_body_without_a_key_is_not_read(cluster: Cluster, ray_driver):
    """200 MB sent without a key (declared, then chunked) to an inference route and to the
    tenant API: 401, and neither Serve's HTTP proxy nor the ingress replica holds the body
    (read, the ingress would add its size at least, and the proxy buffers what the replica
    pulls). The proxy reads what arrives until the replica has answered, so its margin
    allows for that."""
    ray = ray_driver
    actors = ray.util.list_named_actors(all_namespaces=True)
    [proxy] = [a for a in actors if a["name"].startswith("SERVE_PROXY_ACTOR")]
    [ingress] = [a for a in actors if a["name"].startswith(f"SERVE_REPLICA::{APP}#ingress#")]
    pids = {"proxy": actor_pid(ray, **proxy), "ingress": actor_pid(ray, **ingress)}
    size = 200 << 20

    def body():
        chunk = b"{" * (1 << 20)
        for _ in range(size >> 20):
            yield chunk

    with cluster.http() as http:
        for route in ("/v1/completions", "/v1/tenants"):
            for headers in ({"Content-Length": str(size)}, {}):
                headers["Content-Type"] = "application/json"
                with peak_growth(pids["proxy"]) as proxy, peak_growth(pids["ingress"]) as ing:
                    r = http.post(route, content=body(), headers=headers)
                assert r.status_code == 401, (route, r.text)
                grew = {"proxy": proxy.mib, "ingress": ing.mib}
                assert grew["ingress"] < 48 and grew["proxy"] < 64, (route, headers, grew)


def stream_resumes(cluster: Cluster) -> float:
    """The ingress's count of streams resumed after their replica died (/metrics)."""
    with cluster.http(cluster.metrics_key) as http:
        r = http.get("/metrics")
    assert r.status_code == 200, r.text
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "loraplex_stream_resumes_total":
                return sample.value
    raise AssertionError("/metrics has no loraplex_stream_resumes_total")


def metrics_by_replica(cluster: Cluster) -> tuple[float, dict[str, dict[tuple, float]]]:
    """The ingress's /metrics: how many replicas it reports, and per replica id its
    samples, keyed by (name, other labels)."""
    with cluster.http() as http:
        assert http.get("/metrics").status_code == 401  # tenants' names and figures
    with cluster.http(cluster.metrics_key) as http:  # `loraplex up` made the key
        r = http.get("/metrics")
    assert r.status_code == 200, r.text
    reporting, view = None, {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "loraplex_replicas_reporting":
                reporting = sample.value
            labels = dict(sample.labels)
            replica = labels.pop("replica", None)
            # the router's adapter homes name replicas too, but are the router's view
            if replica is not None and sample.name != "loraplex_adapter_home":
                key = (sample.name, *sorted(labels.items()))
                view.setdefault(replica, {})[key] = sample.value
    assert reporting is not None, r.text
    return reporting, view


def expected_samples(stats: dict[str, Any]) -> dict[tuple, float]:
    """What /metrics should show of a replica whose `stats()` is `stats`."""
    pool, adapters, tiers = stats["pool"], stats["adapters"], stats["tiers"]
    samples = {("loraplex_pool_pages", ("kind", "total")): pool["num_pages"]}
    for kind in ("free", "kv", "adapter", "cached", "pinned"):
        samples["loraplex_pool_pages", ("kind", kind)] = pool[f"{kind}_pages"]
    for tier in ("device", "host", "loading"):
        samples["loraplex_replica_adapters", ("tier", tier)] = len(tiers[tier])
    for event, field in (("hit", "hits"), ("miss", "misses"), ("load", "loads")):
        samples["loraplex_adapter_cache_events_total", ("event", event)] = adapters[field]
    samples["loraplex_adapter_cache_events_total", ("event", "eviction")] = adapters["evictions"]
    for state in ("waiting", "running"):
        samples["loraplex_replica_requests", ("state", state)] = stats[state]
    samples[("loraplex_replica_preemptions_total",)] = stats["preemptions"]
    samples[("loraplex_engine_steps_total",)] = stats["steps"]
    samples[("loraplex_engine_step_seconds_total",)] = stats["step_seconds"]
    return samples


def test_metrics_show_every_replicas_own_stats(
    cluster: Cluster, keys: dict[str, str], demo_assets: DemoAssets, ray_driver
):
    """/metrics of the running cluster shows each replica's pool, adapters per tier, cache
    events, queue and preemptions: what the replicas report of themselves (their `stats`,
    asked from this driver, and their routing stats, read from their actors)."""
    ray = ray_driver
    from ray import serve

    acme = cluster.client(keys["acme"])
    register(cluster, keys["acme"], "metered", demo_assets, "code-r32")
    servable(acme, "metered")
    assert complete(acme, "metered", max_tokens=4).usage.completion_tokens == 4
    replicas = serve.get_deployment_handle("replica", app_name=APP)

    def agree() -> tuple[dict, dict] | None:
        """(shown, own) once an idle cluster's /metrics equals the replicas' own stats."""
        reporting, shown = metrics_by_replica(cluster)
        stats = replicas.broadcast("stats").results(timeout_s=CLIENT_TIMEOUT_S)
        own = {s["replica"]: expected_samples(s) for s in stats}
        return (shown, own) if reporting == len(own) and shown == own else None

    shown, own = wait_until(agree, 15, "/metrics to show the replicas' own stats")
    assert set(shown) == set(replica_actors(ray)), shown.keys()  # every live replica, by id
    assert sum(s["loraplex_adapter_cache_events_total", ("event", "load")] for s in shown.values())
    device = [r for r, s in shown.items() if s["loraplex_replica_adapters", ("tier", "device")]]
    assert device, shown  # "metered" is resident somewhere
    for replica, routing in routing_stats(ray).items():  # the actors' own view, not Serve's
        assert shown[replica]["loraplex_pool_pages", ("kind", "free")] == routing["free_pages"]
        assert shown[replica]["loraplex_pool_pages", ("kind", "total")] == routing["num_pages"]
        tier = shown[replica]["loraplex_replica_adapters", ("tier", "device")]
        assert tier == len(routing["device_adapters"])
    # and the ingress's router counts where it sent each adapter request, and why
    placed = router_placements(cluster)
    assert sum(placed.values()) >= 1, placed  # the request above, at least
    assert {tier for _, tier in placed} <= {"device", "loading", "host", "store"}, placed
    remove_adapter(cluster.endpoint(keys["acme"]), "metered")


def router_placements(cluster: Cluster) -> dict[tuple[str, str], float]:
    """The ingress router's adapter requests by (affinity, tier), from /metrics."""
    with cluster.http(cluster.metrics_key) as http:
        r = http.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        (sample.labels["affinity"], sample.labels["tier"]): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
        if sample.name == "loraplex_router_placements_total"
    }


def test_killing_a_replica_mid_stream_neither_hangs_nor_loses_adapters(
    cluster: Cluster,
    keys: dict[str, str],
    oracle: LLMEngine,
    demo_assets: DemoAssets,
    ray_driver,
):
    ray = ray_driver
    from ray import serve

    acme = cluster.client(keys["acme"])
    register(cluster, keys["acme"], "stream", demo_assets, "sql-r8")
    probes = {  # registered before the kill: the replacement must find them
        probe: adapter_id(
            "acme",
            probe,
            register(cluster, keys["acme"], probe, demo_assets, "legal-r8")["version"],
        )
        for probe in PROBES
    }
    servable(acme, "stream")
    before = replica_actors(ray)
    assert len(before) == 2, before

    # Why this test once failed: the victim was picked from routing stats after every stream
    # had started plus 0.5 s, and killed after a further RPC; on a quiet machine 600 tokens
    # of the demo model take about as long, so its streams could finish first. Now the
    # victim is frozen (SIGSTOP) as soon as its queue is read: its streams cannot finish
    # until the kill. Once the others have ended and the client has seen everything the
    # ingress holds, exactly queues[victim] streams must still be open; if one of the
    # victim's slipped out between the read and the freeze, the round is repeated.
    pids = {replica: actor_pid(ray, name) for replica, name in before.items()}
    long = 600  # tokens: seconds of decoding
    models = [BASE_ID, "stream", BASE_ID, "stream"]
    for _ in range(3):
        resumed_before = stream_resumes(cluster)
        with Streams(acme, models, max_tokens=long) as streams:
            streams.wait_started()
            queues = {r: s["queue_len"] for r, s in routing_stats(ray).items()}
            victim = max(queues, key=queues.__getitem__)
            with Frozen(pids[victim]) as freeze:
                assert set(queues) == set(before), queues
                assert queues[victim] > 0, queues
                if streams.settled(at_least=len(models) - queues[victim]) == queues[victim]:
                    freeze.kill()  # mid-stream, by construction
            if not freeze.killed:  # one of the victim's streams ended before the freeze
                streams.results()  # the others end now that it runs again
                continue

            # sent while the router may still count the victim in: retried before any token
            for model in (BASE_ID, "stream", BASE_ID):
                assert complete(acme, model, max_tokens=8).usage.completion_tokens == 8

            results = streams.results()  # never a hang
            break
    else:
        pytest.fail("in 3 rounds a stream of the victim ended before it was frozen")
    (survivor,) = set(before) - {victim}
    # no stream failed: the victim's resumed on the survivor after the tokens they had,
    # and each reads exactly as one uninterrupted run
    ids = oracle.tokenizer.encode(PROMPT)
    adapters = {BASE_ID: None, "stream": "sql-r8"}
    want = {
        m: offline(oracle, ids, a, max_tokens=long, ignore_eos=True) for m, a in adapters.items()
    }
    assert results == [(long, want[m].text) for m in models], results
    assert stream_resumes(cluster) - resumed_before == queues[victim]  # the kill was mid-stream

    def replaced() -> str | None:
        status = serve.status().applications[APP].deployments["replica"]
        newcomers = set(replica_actors(ray)) - set(before)
        running = status.replica_states.get("RUNNING") == 2
        return newcomers.pop() if running and len(newcomers) == 1 else None

    newcomer = wait_until(replaced, 60, "a replacement replica")

    # serving again, with the adapters registered before the kill
    assert complete(acme, "stream").choices[0].text == offline(oracle, ids, "sql-r8").text
    assert complete(acme, BASE_ID).choices[0].text == offline(oracle, ids, None).text
    # ... and on the replacement: a cold probe whose home (the router's walk) is the
    # newcomer is loaded there. The router may not know the newcomer for a moment: try a few.
    homed = [p for p in PROBES if walk_order(probes[p], [newcomer, survivor])[0] == newcomer]
    assert homed, "no probe adapter hashes to the newcomer (a 2**-12 chance)"
    want = offline(oracle, ids, "legal-r8").text
    for probe in homed:
        assert complete(acme, probe).choices[0].text == want
        if holders(ray, probes[probe]).get(newcomer):
            break
    else:
        pytest.fail(f"none of {homed} was served by the replacement replica {newcomer}")
