"""The chart's etcd StatefulSet, run: one real etcd process per member with exactly the
environment its pod template gives (Kubernetes' `$(POD_NAME)` expansion done here), the
members' DNS names mapped to loopback ports. They must form one cluster."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helm_chart import NAMESPACE, container, render

from loraplex.net import free_port
from loraplex.registry.etcd_process import INSTALL_HINT, find_etcd_binary

pytestmark = pytest.mark.etcd
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def member_env(
    template: dict[str, Any], pod: str, urls: dict[str, str], data_dir: Path
) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "")}
    for var in container(template)["env"]:
        if "value" in var:
            value = var["value"].replace("$(POD_NAME)", pod)
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            value = pod
        for url, local in urls.items():
            value = value.replace(url, local)
        env[var["name"]] = value
    (mount,) = container(template)["volumeMounts"]
    assert env["ETCD_DATA_DIR"] == mount["mountPath"]
    env["ETCD_DATA_DIR"] = str(data_dir)  # the member's claim, here a folder
    return env


def get(url: str, body: bytes | None = None) -> dict[str, Any]:
    with _DIRECT.open(urllib.request.Request(url, data=body), timeout=2) as response:
        return json.loads(response.read())


def test_members_form_one_cluster_from_the_rendered_pod_template(tmp_path):
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(f"no etcd binary: {INSTALL_HINT}")
    statefulset = render().one("StatefulSet")
    spec = statefulset["spec"]
    template = spec["template"]
    domain = f"{spec['serviceName']}.{NAMESPACE}.svc"
    members = [f"{statefulset['metadata']['name']}-{i}" for i in range(spec["replicas"])]
    ports = {pod: {2379: free_port(), 2380: free_port()} for pod in members}
    clients = {pod: f"http://127.0.0.1:{ports[pod][2379]}" for pod in members}
    processes = []
    try:
        for pod in members:
            urls = {
                f"http://{other}.{domain}:{port}": f"http://127.0.0.1:{local}"
                for other in members
                for port, local in ports[other].items()
            }
            # each pod listens on its own 0.0.0.0; here, on its own loopback ports
            urls |= {f"http://0.0.0.0:{p}": f"http://127.0.0.1:{ports[pod][p]}" for p in ports[pod]}
            env = member_env(template, pod, urls, tmp_path / pod)
            command = [binary, *container(template)["command"][1:]]
            with (tmp_path / f"{pod}.log").open("w") as log:
                processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 60
        healthy: set[str] = set()
        while healthy != set(members):
            assert time.monotonic() < deadline, f"members never all healthy: {healthy}"
            assert all(p.poll() is None for p in processes), "an etcd member exited"
            for pod in set(members) - healthy:
                try:
                    if get(f"{clients[pod]}/health")["health"] == "true":
                        healthy.add(pod)
                except OSError:
                    pass
            time.sleep(0.2)
        listed = get(f"{clients[members[0]]}/v3/cluster/member/list", b"{}")["members"]
        assert sorted(m["name"] for m in listed) == members
    finally:
        for process in processes:  # throwaway data: no graceful leader handover to wait for
            process.kill()
            process.wait(timeout=20)
    for pod in members:
        log = (tmp_path / f"{pod}.log").read_text()
        assert "unrecognized environment variable" not in log, log
