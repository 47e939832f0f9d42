"""`http.ingress_proxy`: HAProxy in front of Serve's direct ingress instead of Serve's proxy
actor (cluster/ingress_proxy.py).

Ray reads the choice from `ray start`'s environment, so the tests check each place that
sets it: the flags themselves, `loraplex up` on its own Ray (end to end, over real HTTP),
the `ray up` files (the command their start commands run, on the shipped config), and
`loraplex up --address`'s refusal of a Ray started with the other proxy (a real local Ray).
The Helm chart's env is checked in test_helm.py.

HAProxy's stats page and Prometheus exporter bind every interface (Ray's template: `bind
*:port`), and servers in tests bind 127.0.0.1 only: the end-to-end test runs the whole
cluster, and its client, in a network namespace of its own (`unshare --net`, root), whose
only interface is its own loopback. It is skipped, with the reason, where that is refused.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import netns
import pytest

from loraplex.cluster import ingress_proxy
from loraplex.cluster.ingress_proxy import check_running_proxy, running_proxy
from loraplex.serve_flags import FLAGS, HAPROXY_PORTS, local_ray_env, ray_env

REPO = Path(__file__).resolve().parents[1]


def test_haproxy_sets_both_of_serve_s_flags_and_serve_clears_them():
    assert ray_env("haproxy") == dict.fromkeys(FLAGS, "1")
    assert ray_env("serve") == dict.fromkeys(FLAGS, "0")
    with pytest.raises(ValueError, match="one of"):
        ray_env("nginx")


def test_a_local_haproxy_gets_free_stats_and_exporter_ports_unless_the_environment_names_them():
    env = local_ray_env("haproxy", {})
    ports = [int(env[name]) for name in HAPROXY_PORTS]
    assert len(set(ports)) == 2 and all(p not in (8404, 9101) for p in ports)
    named = dict.fromkeys(HAPROXY_PORTS, "18404")
    assert {k: local_ray_env("haproxy", named)[k] for k in HAPROXY_PORTS} == named
    assert local_ray_env("serve", {}) == ray_env("serve")


def test_the_ray_up_start_commands_export_the_flags_of_the_config_file(tmp_path, capsys):
    """What `export $(python3 -m loraplex.cluster.ingress_proxy CONFIG)` exports, on the
    shipped serve_config.yaml, on one switched to haproxy, and on a bad file (an error on
    stderr, nothing on stdout, so `&&` stops `ray start`)."""
    shipped = REPO / "cluster" / "serve_config.yaml"
    assert ingress_proxy.main([str(shipped)]) == 0
    assert capsys.readouterr().out.split() == [f"{k}=0" for k in FLAGS]

    config = shipped.read_text()
    assert "ingress_proxy: serve" in config
    switched = tmp_path / "serve_config.yaml"
    switched.write_text(config.replace("ingress_proxy: serve", "ingress_proxy: haproxy"))
    assert ingress_proxy.main([str(switched)]) == 0
    assert capsys.readouterr().out.split() == [f"{k}=1" for k in FLAGS]

    switched.write_text(config.replace("ingress_proxy: serve", "ingress_proxy: nginx"))
    assert ingress_proxy.main([str(switched)]) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and "ingress_proxy" in printed.err

    from loraplex.cluster.ray_up_files import HEAD_START_RAY_COMMANDS, WORKER_START_RAY_COMMANDS

    for commands in (HEAD_START_RAY_COMMANDS, WORKER_START_RAY_COMMANDS):
        start = next(" ".join(c) for c in commands if "ray start" in " ".join(c))
        assert start.index("loraplex.cluster.ingress_proxy") < start.index("ray start")


@pytest.mark.ray
def test_loraplex_up_on_a_ray_started_with_the_other_proxy_is_refused_with_the_flags_to_set():
    """A real local Ray, started without the flags (Serve's proxy): asking it for haproxy
    names the flags; asking for serve passes."""
    import ray

    from loraplex.demo.lean_ray import lean_ray_serve

    saved = {name: os.environ.pop(name, None) for name in FLAGS}
    try:
        with lean_ray_serve():
            assert running_proxy(ray) == "serve"
            check_running_proxy(ray, "serve")
            with pytest.raises(RuntimeError) as refused:
                check_running_proxy(ray, "haproxy")
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    message = str(refused.value)
    assert "runs 'serve'" in message
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_ENABLE_HA_PROXY=1" in message


# -- end to end, in a network namespace of its own -----------------------------------------


@pytest.mark.ray
@pytest.mark.etcd
@pytest.mark.slow
def test_loraplex_up_with_haproxy_serves_streams_through_haproxy_and_down_stops_it(
    demo_assets, tmp_path
):
    refused = netns.refused()
    if refused:
        pytest.skip(refused)
    from loraplex.registry.etcd_process import INSTALL_HINT, find_etcd_binary

    if find_etcd_binary() is None:
        pytest.skip(f"no etcd server binary; install one: {INSTALL_HINT}")
    result_file = tmp_path / "result.json"
    inside = netns.run(
        [sys.executable, __file__, str(tmp_path), str(demo_assets.model)], timeout=420, cwd=REPO
    )
    assert inside.returncode == 0 and result_file.exists(), inside.stdout + inside.stderr[-6000:]
    seen = json.loads(result_file.read_text())

    # HAProxy, not Serve's proxy, holds the HTTP port, and its stats and exporter are on the
    # free ports `up` chose
    assert seen["http_listener"] == "haproxy", seen
    assert seen["haproxy_ports"] and all(p not in (8404, 9101) for p in seen["haproxy_ports"])
    assert all(name == "haproxy" for name in seen["haproxy_port_listeners"]), seen
    assert seen["status_proxy"].split()[:2] == ["proxy:", "haproxy"], seen  # `loraplex status`
    # the ingress answers through it: auth, the tenant API, a stream
    assert seen["no_key_status"] == 401
    assert seen["models"][0] == "haproxy-demo"
    assert seen["stream_events"] >= 2, seen  # tokens arrive as they are made, not at the end
    assert seen["streamed_text"] == seen["whole_text"] != ""
    # `loraplex down` stops HAProxy and frees the port
    assert seen["after_down"] == {"port_accepts": False, "haproxy_alive": False}, seen


def _listeners(port: int) -> list[tuple[str, int]]:
    """(process name, pid) of what listens on TCP `port` here (ss, iproute2)."""
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    return [(m[1], int(m[2])) for m in re.finditer(r'\(\("([^"]+)",pid=(\d+)', out)]


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _inside(root: Path, model: str) -> dict[str, Any]:
    """In the new network namespace: the cluster up, spoken to, and down."""
    from test_e2e_cluster import cluster_of, cluster_up, loraplex, yaml_config

    from loraplex.net import free_port

    port = free_port()
    settings = {
        "model": model,
        "model_id": "haproxy-demo",
        "engine": {"max_model_len": 512, "pool_mib": 32, "page_kib": 64, "max_num_seqs": 4},
        "replicas": {"num_replicas": 1, "num_cpus": 1},
        "http": {"port": port, "ingress_proxy": "haproxy"},
    }
    seen: dict[str, Any] = {}
    state_dir = root / "state"
    with cluster_up(yaml_config(root, settings), state_dir, timeout_s=240) as (state, _):
        cluster = cluster_of(state, state_dir)
        ((seen["http_listener"], haproxy_pid),) = _listeners(port)
        ports = re.findall(r"RAY_SERVE_HAPROXY_\w+_PORT=(\d+)", _log(state_dir))
        seen["haproxy_ports"] = [int(p) for p in ports]
        seen["haproxy_port_listeners"] = [n for p in ports for n, _ in _listeners(int(p))]
        status = loraplex("status", "--state-dir", str(state_dir), timeout=90).stdout
        seen["status_proxy"] = next(x for x in status.splitlines() if x.startswith("proxy:"))
        with cluster.http() as anonymous:
            seen["no_key_status"] = anonymous.get("/v1/models").status_code
        body = {
            "model": "haproxy-demo",
            "messages": [{"role": "user", "content": "Name a fruit."}],
            "max_tokens": 16,
            "temperature": 0,
        }
        with cluster.http(cluster.demo_key) as http:
            seen["models"] = [m["id"] for m in http.get("/v1/models").json()["data"]]
            whole = http.post("/v1/chat/completions", json=body)
            whole.raise_for_status()
            seen["whole_text"] = whole.json()["choices"][0]["message"]["content"]
            events, text = 0, ""
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events += 1
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
            seen["stream_events"], seen["streamed_text"] = events, text
    deadline = time.monotonic() + 20
    while _pid_alive(haproxy_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    seen["after_down"] = {"port_accepts": _accepts(port), "haproxy_alive": _pid_alive(haproxy_pid)}
    return seen


def _log(state_dir: Path) -> str:
    return (state_dir / "cluster.log").read_text(errors="replace")


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


if __name__ == "__main__":  # the end-to-end test's body, in its network namespace
    tmp, model_dir = Path(sys.argv[1]), sys.argv[2]
    (tmp / "result.json").write_text(json.dumps(_inside(tmp, model_dir)))
