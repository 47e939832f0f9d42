"""The process `loraplex up` hands a local cluster to (`python -m loraplex.cluster.supervisor
STATE_DIR`, in its own session): it owns the etcd and the Ray head it starts, deploys the
app, keeps etcd up, and tears everything down on SIGTERM/SIGINT (`loraplex down`), or when
the Ray cluster it serves on is gone (`ray stop`, `ray down`): etcd must not outlive it. It
reports its phase in the state folder (cluster/state.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loraplex.cluster.config import APP_NAME, LoraplexConfig
from loraplex.cluster.ingress_proxy import check_running_proxy
from loraplex.cluster.ray_node_watch import RAY_LOST_AFTER_S, accepts, host_port
from loraplex.cluster.serve_status import deployment_errors
from loraplex.cluster.state import write_state
from loraplex.ray_start import init_once_more_if_slow
from loraplex.serve_flags import HAPROXY_PORTS, local_ray_env

log = logging.getLogger("loraplex.cluster")


class Supervisor:
    """Starts etcd and Ray, deploys the app, waits for SIGTERM, then undoes it all."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        spec = json.loads((state_dir / "run.json").read_text())
        self.config = LoraplexConfig.model_validate(spec["config"])
        self.ray_options = spec["ray"]
        self.ray_address = spec["ray_address"]
        self.stop = threading.Event()
        self.ray_lost = False
        self.etcd = None
        self.state: dict[str, Any] = {"pid": os.getpid(), "started_at": time.time()}

    def phase(self, phase: str, detail: str = "", **fields: Any) -> None:
        log.info("%s %s", phase, detail)
        self.state.update(phase=phase, detail=detail, **fields)
        write_state(self.state_dir, self.state)

    def on_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())

    def run(self) -> int:
        self.on_signals()
        try:
            config = self.start_etcd(self.config)
            self.start_ray()
            # ray.init installs a SIGTERM handler that ends the process: take it back.
            self.on_signals()
            self.deploy(config)
            url = f"http://{_dial_host(config.http.host)}:{config.http.port}"
            self.phase("running", url=url)
            gcs = host_port(self.state["ray_address"])
            refused_since = None
            while not self.stop.wait(1.0):
                self.keep_etcd_up()
                if accepts(gcs):
                    refused_since = None
                    continue
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since > RAY_LOST_AFTER_S:
                    log.warning("Ray's GCS at %s:%d is gone: stopping", *gcs)
                    self.ray_lost = True
                    break
            return 0
        except Exception as e:
            log.exception("the cluster failed")
            self.phase("failed", error=f"{type(e).__name__}: {e}")
            return 1
        finally:
            self.teardown()

    def start_etcd(self, config: LoraplexConfig) -> LoraplexConfig:
        if config.etcd.endpoints is not None:
            self.state["etcd_endpoints"] = config.etcd.endpoints
            return config
        from loraplex.registry.etcd_process import EtcdProcess

        self.phase("starting etcd", str(self.state_dir / "etcd"))
        self.etcd = EtcdProcess(
            self.state_dir / "etcd", host=config.etcd.host, client_port=config.etcd.client_port
        )
        self.etcd.start()
        self.state.update(etcd_endpoints=[self.etcd.endpoint], etcd_pid=self.etcd.pid)
        return config.with_etcd_endpoints([self.etcd.endpoint])

    def keep_etcd_up(self) -> None:
        if self.etcd is not None and not self.etcd.running:
            log.warning("etcd exited; restarting it:\n%s", self.etcd.log_tail())
            self.etcd.start()
            self.state["etcd_pid"] = self.etcd.pid
            write_state(self.state_dir, self.state)

    def start_ray(self) -> None:
        import ray

        proxy = self.config.http.ingress_proxy
        if self.ray_address is not None:
            self.phase("connecting to Ray", self.ray_address)
            ray.init(address=self.ray_address, log_to_driver=False)
            check_running_proxy(ray, proxy)
            self.state["ingress_proxy"] = proxy
        else:
            opts = self.ray_options
            # the Ray started here (raylet, controller, proxies, replicas) inherits these
            env = local_ray_env(proxy, os.environ)
            os.environ.update(env)
            ports = ", ".join(f"{k}={v}" for k, v in env.items() if k in HAPROXY_PORTS)
            self.state["ingress_proxy"] = proxy + (f" ({ports})" if ports else "")
            self.phase(
                "starting Ray",
                f"{opts['num_cpus']} CPUs, temp dir {opts['temp_dir']}, "
                f"ingress proxy {self.state['ingress_proxy']}",
            )
            init_once_more_if_slow(
                ray,
                num_cpus=opts["num_cpus"],
                object_store_memory=opts["object_store_bytes"],
                include_dashboard=False,
                _temp_dir=opts["temp_dir"],
                log_to_driver=False,
            )
        self.state["ray_address"] = ray.get_runtime_context().gcs_address

    def deploy(self, config: LoraplexConfig) -> None:
        from ray import serve

        from loraplex.cluster.app import build_app

        replicas = config.replicas.num_replicas
        self.phase("deploying", f"{replicas} replicas build their engines")
        serve.start(http_options={"host": config.http.host, "port": config.http.port})
        try:
            serve.run(build_app(config.model_dump(mode="json")), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            raise RuntimeError(f"{e} {deployment_errors()}".strip()) from None

    def teardown(self) -> None:
        self.phase("stopping")
        if not self.ray_lost:
            self.undeploy()
        if self.etcd is not None:
            self.etcd.stop()
        self.state.pop("etcd_pid", None)
        self.phase("stopped", "the Ray cluster is gone" if self.ray_lost else "")

    def undeploy(self) -> None:
        with contextlib.suppress(Exception):
            import ray
            from ray import serve

            if ray.is_initialized():
                if self.ray_address is None:
                    serve.shutdown()
                else:
                    serve.delete(APP_NAME)
                ray.shutdown()


def _dial_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    (state_dir,) = argv if argv is not None else sys.argv[1:]
    supervisor = Supervisor(Path(state_dir))
    code = supervisor.run()
    if supervisor.ray_lost:  # Ray's exit hooks would wait for the GCS that is gone
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
