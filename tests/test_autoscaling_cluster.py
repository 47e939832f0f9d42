"""The `lora` autoscaling policy in a real cluster (`loraplex up`: real etcd, real local Ray,
Ray Serve's own autoscaler calling router/autoscaling.py, the demo model): 1 replica ->
2 when a working set larger than one replica's tiers arrives, back to 1 once it has gone,
and every request of both phases answered 200 with all its tokens.

The tiers are made small so a handful of adapters is a working set: the device pool
(`pool_mib: 8`, 128 pages of 64 KiB) holds at most three copies of the demo's largest
adapter (translate-r64, 37 pages) beside the KV blocks, and `host_mib: 0` keeps no host
copy, so each of WORKING_SET names that has left the pool is read from the store again.
The demo's adapters are read from a local folder in milliseconds, so `read_busy` (the
share of its time a replica may spend reading) is set low enough for those reads to count.
SENDERS requests in flight stay under the load count's one replica (target_slot_use x 8
slots): only the reads can ask for the second replica. When the working set leaves, one
sender keeps asking for a small adapter that stays resident: no reads, one replica's load.

Serve's intervals are shortened through its environment (the replicas push their metrics
every PUSH_INTERVAL_S) and its config (look-back, delays), the policy's own delay and
cool-down likewise, so the whole test takes under ~3 minutes on two loaded cores.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_e2e_cluster import (
    CLI_ENV,
    CLIENT_TIMEOUT_S,
    Cluster,
    cluster_of,
    cluster_up,
    yaml_config,
)

from loraplex.cluster.adapters_cli import add_adapter
from loraplex.cluster.local_cluster import ray_temp_dir
from loraplex.demo.assets import DemoAssets
from loraplex.net import free_port
from loraplex.replica.deployment import DEPLOYMENT_NAME

pytestmark = [
    pytest.mark.ray,
    pytest.mark.etcd,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.serve._private.config"),
    # metrics_interval_s is set below Serve's 10 s default so the 3 s look-back passes its
    # check (the push intervals themselves are the environment's)
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]

APP = "loraplex"
BASE_ID = "loraplex-demo-llama"
WORKING_SET = tuple(f"set-{i}" for i in range(6))  # each the demo's translate-r64
STEADY = "steady"  # the demo's sql-r8: one page, never evicted by one sender's KV
SENDERS = 3
MAX_TOKENS = 8
PUSH_INTERVAL_S = 0.5
HOLD_S = 10.0  # the working set stays this long once both replicas run
# the demand's memory shortened with the rest: the step-down projection forgets the
# working set within ~a minute of its leaving, not over the default 10 minutes
LORA = {"read_busy": 0.005, "downscale_delay_s": 8.0, "cooldown_s": 8.0, "demand_window_s": 10.0}


@pytest.fixture(scope="module")
def scaling_cluster(
    demo_assets: DemoAssets, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("autoscaling_cluster")
    settings = {
        "model": str(demo_assets.model),
        "model_id": BASE_ID,
        "engine": {
            "max_model_len": 256,
            "pool_mib": 8,
            "page_kib": 64,
            "max_num_seqs": 8,
            "host_mib": 0,
        },
        "replicas": {
            "num_cpus": 1,
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "initial_replicas": 1,
                "metrics_interval_s": PUSH_INTERVAL_S,
                "look_back_period_s": 3.0,
                "upscale_delay_s": 1.0,
                "downscale_delay_s": 1.0,
                "policy": "lora",
                "lora": LORA,
            },
        },
        "router": {"stats_period_s": 0.5},
        "http": {"port": free_port()},
    }
    config = yaml_config(root, settings)
    state_dir = (root / "state").resolve()
    push = str(PUSH_INTERVAL_S)
    with pytest.MonkeyPatch.context() as env:
        # read by Serve's controller and replicas, which inherit `loraplex up`'s environment
        env.setitem(CLI_ENV, "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", push)
        env.setitem(CLI_ENV, "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", push)
        with cluster_up(config, state_dir) as (state, _):
            yield cluster_of(state, state_dir)


@pytest.fixture(scope="module")
def serve_status(scaling_cluster: Cluster) -> Iterator[Any]:
    """A function giving the replica deployment's replica states ({state name: count}),
    through a Ray driver connected to the cluster (disconnected after)."""
    ray = pytest.importorskip("ray")
    from ray import serve

    if ray.is_initialized():
        pytest.skip("this process already runs a Ray driver; cannot connect to the cluster")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(
            address=scaling_cluster.ray_address, log_to_driver=False, logging_level=logging.WARNING
        )
        try:

            def states() -> dict[str, int]:
                deployment = serve.status().applications[APP].deployments[DEPLOYMENT_NAME]
                return {str(s): n for s, n in deployment.replica_states.items() if n}

            yield states
        finally:
            ray.shutdown()


class Senders:
    """Threads sending completions for `models` (each thread in turn) until finished; every
    answer is kept as (model, status, body or text)."""

    def __init__(self, cluster: Cluster, count: int, models: tuple[str, ...]):
        self.cluster = cluster
        self.models = models
        self.stop = threading.Event()
        self.answers: list[tuple[str, int, Any]] = []
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(count)
        self.futures = [self.pool.submit(self._run, i) for i in range(count)]

    def _run(self, turn: int) -> None:
        with self.cluster.http(self.cluster.demo_key) as http:
            while not self.stop.is_set():
                model = self.models[turn % len(self.models)]
                turn += 1
                body = {
                    "model": model,
                    "prompt": "Once upon a time there was",
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                try:
                    r = http.post("/v1/completions", json=body)
                    answer = (model, r.status_code, r.json() if r.status_code == 200 else r.text)
                except httpx.HTTPError as e:
                    answer = (model, -1, repr(e))
                with self.lock:
                    self.answers.append(answer)

    def finish(self) -> list[tuple[str, int, Any]]:
        self.stop.set()
        for future in self.futures:
            future.result(timeout=CLIENT_TIMEOUT_S + 5)
        self.pool.shutdown()
        return self.answers


def wait_for(states, condition, timeout_s: float, what: str) -> list[tuple[float, dict]]:
    """Poll the replica states until `condition(states)`; the states seen, with their time."""
    seen: list[tuple[float, dict]] = []
    deadline = time.monotonic() + timeout_s
    while True:
        now = states()
        if not seen or seen[-1][1] != now:
            seen.append((round(time.monotonic(), 1), now))
        if condition(now):
            return seen
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: {seen}"
        time.sleep(0.5)


def running(n: int):
    return lambda states: states == {"RUNNING": n}


def register_all(cluster: Cluster, demo: DemoAssets) -> None:
    endpoint = cluster.endpoint(cluster.demo_key)
    for name in WORKING_SET:
        add_adapter(
            endpoint, name, path=demo.adapters_dir / "translate-r64", progress=io.StringIO()
        )
    add_adapter(endpoint, STEADY, path=demo.adapters_dir / "sql-r8", progress=io.StringIO())


def policy_log(cluster: Cluster) -> list[str]:
    """The lora policy's log lines (its wanted counts and why), from the Ray session's logs
    (the policy runs in Serve's controller)."""
    logs = Path(ray_temp_dir(cluster.state_dir)) / "session_latest" / "logs" / "serve"
    return [
        line.split(" -- ", 1)[-1]
        for path in sorted(logs.glob("controller_*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if "lora autoscaling wants" in line
    ]


def complete(answer: tuple[str, int, Any]) -> bool:
    _, status, body = answer
    if status != 200:
        return False
    (choice,) = body["choices"]
    return choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_working_set_past_one_replicas_tiers_scales_1_to_2_and_back_with_no_request_failing(
    scaling_cluster: Cluster, serve_status, demo_assets: DemoAssets
):
    started = time.monotonic()
    wait_for(serve_status, running(1), 30, "one running replica at the start")
    register_all(scaling_cluster, demo_assets)
    working_set = Senders(scaling_cluster, SENDERS, WORKING_SET)
    try:
        up = wait_for(serve_status, running(2), 90, "a second replica for the working set")
        up_s = time.monotonic() - started
        time.sleep(HOLD_S)  # both replicas serve the working set
        held = serve_status()
    finally:
        answers = working_set.finish()
    left = time.monotonic()
    steady = Senders(scaling_cluster, 1, (STEADY,))  # the working set has left
    try:
        down = wait_for(serve_status, running(1), 90, "the return to one replica")
        down_s = time.monotonic() - left
        time.sleep(2.0)  # requests after the second replica has gone
    finally:
        answers += steady.finish()
    failed = [a for a in answers if not complete(a)]
    in_set = sum(1 for model, _, _ in answers if model in WORKING_SET)
    print(
        f"up {up_s:.0f} s after the start {up}; down {down_s:.0f} s after the working set "
        f"left {down}; {len(answers)} requests, {in_set} for the working set"
    )
    wants = policy_log(scaling_cluster)
    print("\n".join(wants))
    up_why = [w for w in wants if w.startswith("lora autoscaling wants 2 replicas (1 now)")]
    assert up_why and "store reads keep replicas" in up_why[0], wants
    assert wants[-1].startswith("lora autoscaling wants 1 replicas (2 now)"), wants
    assert held == {"RUNNING": 2}, f"the count did not hold at 2 with the working set: {held}"
    assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:5]}"
    assert in_set and len(answers) > in_set  # both phases were served
