"""The cluster's configuration: YAML loading, defaults, refusals with clear messages, and
what it is turned into, each checked by the consumer's own validation (EngineConfig, Ray
Serve's ServeDeploySchema, Ray's cluster-launcher schema). No Ray cluster is started."""

from __future__ import annotations

import importlib
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from loraplex.cluster import local_cluster, ray_up_files, state
from loraplex.cluster.cli import main as cli_main
from loraplex.cluster.config import APP_NAME, IMPORT_PATH, LoraplexConfig
from loraplex.cluster.errors import CLIError
from loraplex.cluster.sections import ReplicaSection
from loraplex.net import free_port
from loraplex.registry.etcd_client import EtcdSettings
from loraplex.replica.config import ArtifactReadConfig, EngineConfig, build_engine_config
from loraplex.replica.demand import DEMAND_TAU_S
from loraplex.replica.memory.adapter_cache import CacheConfig
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.router.policy import AffinityConfig
from loraplex.settings import declared_fields

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"
MODEL_CONFIG = {  # what every reader of the shape needs (the engine refuses less)
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 131072,
}


def write_yaml(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "models" / "tiny-llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return folder


def engine_of(values: dict) -> EngineConfig:
    return build_engine_config(values)


# ---------------------------------------------------------------- loading and defaults


def test_defaults_are_a_two_replica_cpu_demo_and_match_the_engine_defaults():
    config = LoraplexConfig()
    assert config.model is None and config.etcd.endpoints is None
    assert config.replicas.num_replicas == 2 and config.replicas.num_gpus == 0
    assert (config.http.host, config.http.port) == ("127.0.0.1", 8000)
    assert config.auth.admin_key_env == "LORAPLEX_ADMIN_KEY"
    engine = engine_of(config.model_copy(update={"model": "/m"}).engine_config())
    assert engine == EngineConfig(model="/m")  # same defaults as the engine's own
    assert AffinityConfig(**config.router.affinity_kwargs()) == AffinityConfig()


def test_from_yaml_resolves_paths_against_the_file_and_maps_every_engine_field(
    tmp_path: Path, model_dir: Path
):
    (tmp_path / "conf").mkdir()
    path = write_yaml(
        tmp_path / "conf" / "loraplex.yaml",
        {
            "model": "../models/tiny-llama",
            "engine": {
                "dtype": "bfloat16",
                "max_model_len": 512,
                "pool_mib": 64,
                "page_kib": 128,
                "max_lora_rank": 32,
                "max_num_seqs": 8,
                "max_num_batched_tokens": 256,
                "max_loras_per_batch": 4,
                "seed": 7,
                "scheduler_policy": "chameleon",
                "eviction": "gdsf",
                "adapter_loading": "sync",
                "prefetch": 4,
                "low_watermark": 0.05,
                "high_watermark": 0.1,
                "host_mib": 256,
                "kernels": "torch",
                "enable_prefix_caching": False,
                "share_base_prefix": True,
            },
            "replicas": {"num_replicas": 3, "num_cpus": 2, "num_gpus": 1, "tp": 1},
            "artifact_root": "artifacts",
            "artifacts": {"read_bandwidth_mib_s": 5, "read_latency_ms": 50},
            "registry": {"allowed_roots": ["adapters"]},
            "etcd": {
                "endpoints": ["10.0.0.5:2379", "10.0.0.6:2379"],
                "timeout_s": 3,
                "ca_cert": "pki/ca.pem",
            },
        },
    )
    config = LoraplexConfig.from_yaml(path)
    assert config.model == str(model_dir)
    assert config.artifact_root == str(tmp_path / "conf" / "artifacts")
    assert config.registry.allowed_roots == [str(tmp_path / "conf" / "adapters")]
    assert config.base_model_id == "tiny-llama"
    engine = engine_of(config.engine_config())
    assert engine == EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        device="cuda",  # auto: replicas hold a GPU
        max_model_len=512,
        pool_bytes=64 << 20,
        page_bytes=128 << 10,
        max_lora_rank=32,
        scheduler=SchedulerConfig(8, 256, 4, policy="chameleon"),
        cache=CacheConfig(
            eviction="gdsf",
            loading="sync",
            prefetch=4,
            low_watermark=0.05,
            high_watermark=0.1,
            host_bytes=256 << 20,
        ),
        kernels="torch",
        seed=7,
        artifacts=ArtifactReadConfig(read_bandwidth_mib_s=5, read_latency_ms=50),
        enable_prefix_caching=False,
        share_base_prefix=True,
    )
    assert config.etcd_settings() == EtcdSettings(
        endpoints=["10.0.0.5:2379", "10.0.0.6:2379"],
        timeout_s=3,
        ca_cert=str(tmp_path / "conf" / "pki" / "ca.pem"),
    )
    assert config.serve_options() == {
        "num_replicas": 3,
        "ray_actor_options": {"num_cpus": 2, "num_gpus": 1},
        "max_ongoing_requests": 1000,  # the ingress's 1000, not max_num_seqs (8): see below
        "router_kwargs": config.router.affinity_kwargs(),
        "routing_stats_period_s": 1.0,
        "routing_stats_timeout_s": 10.0,
    }


def test_a_replica_accepts_every_request_the_ingresses_hold_unless_set():
    """Serve's router queues what a replica does not accept, and it knows no tenants: by
    default a replica accepts whatever the ingresses can hold, far above its batch, so a
    flood queues in the replica's tenant-fair admission (tests/test_e2e_flood.py)."""
    config = LoraplexConfig(
        engine={"max_num_seqs": 8}, http={"ingress_replicas": 3, "ingress_max_ongoing_requests": 50}
    )
    assert config.serve_options()["max_ongoing_requests"] == 150
    config = config.model_copy(update={"replicas": ReplicaSection(max_ongoing_requests=12)})
    assert config.serve_options()["max_ongoing_requests"] == 12


def test_model_derived_settings_read_the_checkpoint_config(model_dir: Path):
    config = LoraplexConfig(model=str(model_dir), engine={"max_lora_rank": 16})
    assert config.max_model_len() == 8192  # max_position_embeddings capped like the engine
    api = config.registry_api_settings("an-admin-key-of-16+chars")
    assert api.base_model_id == "tiny-llama" and api.max_lora_rank == 16
    assert (api.base_model.num_kv_heads, api.base_model.head_dim) == (2, 16)


def test_autoscaling_is_passed_through_and_replaces_num_replicas():
    config = LoraplexConfig(
        replicas={
            "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
        }
    )
    options = config.serve_options()
    assert options["num_replicas"] == "auto"
    assert options["autoscaling_config"]["max_replicas"] == 4
    assert local_cluster.ray_cpus(config) >= 4  # room for the largest scale-out


def test_the_demand_window_reaches_the_replicas():
    lora = {"policy": "lora", "lora": {"demand_window_s": 90}}
    assert LoraplexConfig(replicas={"autoscaling": lora}).demand_window_s() == 90
    assert LoraplexConfig().demand_window_s() == DEMAND_TAU_S


def test_etcd_endpoints_unset_cannot_be_deployed_by_serve():
    with pytest.raises(ValueError, match="etcd.endpoints is not set"):
        LoraplexConfig().etcd_settings()
    config = LoraplexConfig().with_etcd_endpoints(["127.0.0.1:2379"])
    assert config.etcd_settings().endpoints == ["127.0.0.1:2379"]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"replicas": {"num_replicas": 0}},
            "replicas.num_replicas: Input should be greater than or equal to 1 (got 0)",
        ),
        ({"replicas": {"num_gpus": 2}}, "num_gpus must be 0 (CPU) or tp (1)"),
        ({"replicas": {"tp": 65}}, "replicas.tp: Input should be less than or equal to 64"),
        (
            {"replicas": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}},
            "not a Ray Serve autoscaling_config",
        ),
        (
            {"replicas": {"autoscaling": {"policy": "lora", "lora": {"demand_window_s": 0}}}},
            "demand_window_s",
        ),
        (
            {"engine": {"dtype": "int4"}},
            "engine.dtype: Input should be 'auto', 'float32', 'float16' or 'bfloat16'",
        ),
        (
            {"engine": {"max_lora_rank": 4096}},
            "engine.max_lora_rank: Input should be less than or equal to 1024",
        ),
        (
            {"engine": {"max_num_seqs": "many"}},
            "engine.max_num_seqs: Input should be a valid integer",
        ),
        ({"etcd": {"endpoints": ["http://etcd:2379"]}}, "expected host:port"),
        ({"etcd": {"endpoints": []}}, "etcd.endpoints: List should have at least 1 item"),
        ({"etcd": {"cert": "/c.pem"}}, "cert and key go together"),
        ({"auth": {"admin_key_env": "1BAD"}}, "auth.admin_key_env: String should match pattern"),
        ({"etcd": {"password": "hunter2"}}, "username and password go together"),
        (
            {"etcd": {"username": "root", "password": 2**70}},
            "etcd.password: Input should be a valid string (got '***')",
        ),
        (
            {"router": {"bounded_load_c": 1.0}},
            "router.bounded_load_c: Input should be greater than 1",
        ),
        (
            {"router": {"host_load_cost_s": 2.0}},
            "host_load_cost_s (2) must not exceed load_cost_s (0.5)",
        ),
        ({"http": {"port": 70000}}, "http.port: Input should be less than or equal to 65535"),
        ({"replica": {"num_replicas": 2}}, "replica: unknown setting"),
        ({"engine": {"pool_gib": 4}}, "engine.pool_gib: unknown setting"),
    ],
)
def test_bad_settings_are_refused_naming_the_file_and_the_field(tmp_path, settings, message):
    path = write_yaml(tmp_path / "bad.yaml", settings)
    with pytest.raises(ValueError) as caught:
        LoraplexConfig.from_yaml(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    assert "hunter2" not in str(caught.value) and str(2**70) not in str(caught.value)


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read it as YAML"):
        LoraplexConfig.from_yaml(write_yaml(tmp_path / "a.yaml", "model: [unclosed"))
    with pytest.raises(ValueError, match="expected a mapping of settings, got list"):
        LoraplexConfig.from_yaml(write_yaml(tmp_path / "b.yaml", "- 1\n- 2\n"))
    with pytest.raises(ValueError, match="cannot read it as YAML"):
        LoraplexConfig.from_yaml(tmp_path / "missing.yaml")


def test_every_setting_is_documented():
    def check(model: type) -> None:
        for name, field in declared_fields(model).items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "__pydantic_fields__"):
                check(annotation)

    check(LoraplexConfig)
    check(EngineConfig)  # what the YAML's engine section is made into


# ---------------------------------------------------------------- Serve config and app


def test_serve_config_validates_with_ray_and_round_trips(tmp_path, model_dir):
    config = LoraplexConfig(
        model=str(model_dir),
        artifact_root=str(tmp_path / "artifacts"),
        etcd={"endpoints": ["127.0.0.1:2379"], "ca_cert": "/etc/etcd/ca.pem"},
        replicas={"autoscaling": {"min_replicas": 1, "max_replicas": 3}},
        http={"host": "0.0.0.0", "port": 8080},
    )
    serve_config = config.to_serve_config()
    schema = ServeDeploySchema.model_validate(serve_config)
    (app,) = schema.applications
    assert (app.name, app.import_path, app.route_prefix) == (APP_NAME, IMPORT_PATH, "/")
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 8080)
    assert LoraplexConfig.model_validate(app.args) == config
    # through a YAML file, as `serve deploy` and `loraplex up --config` read it
    path = write_yaml(tmp_path / "serve.yaml", serve_config)
    assert LoraplexConfig.from_yaml(path) == config


def test_the_example_serve_config_validates():
    path = CLUSTER / "serve_config.yaml"
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    config = LoraplexConfig.from_yaml(path)
    assert config.replicas.num_gpus == config.replicas.tp == 1
    assert config.device == "cuda"
    engine_of(config.engine_config())


def test_a_serve_config_without_the_loraplex_app_is_refused(tmp_path):
    path = write_yaml(
        tmp_path / "other.yaml", {"applications": [{"name": "x", "import_path": "other:app"}]}
    )
    with pytest.raises(ValueError, match="exactly one application with import_path"):
        LoraplexConfig.from_yaml(path)


def test_build_app_composes_replicas_behind_the_ingress(tmp_path, model_dir):
    pytest.importorskip("loraplex.replica.deployment")
    from loraplex.cluster.app import build_app

    config = LoraplexConfig(
        model=str(model_dir),
        artifact_root=str(tmp_path / "artifacts"),
        etcd={"endpoints": ["127.0.0.1:2379"]},
        replicas={"num_replicas": 3, "num_cpus": 0.5},
    )
    app = build_app(config.model_dump(mode="json"))
    ingress = app._bound_deployment
    assert ingress.name == "ingress"
    replicas_app, args = ingress.init_args
    assert LoraplexConfig.model_validate(args) == config
    replicas = replicas_app._bound_deployment
    assert replicas.num_replicas == 3
    assert replicas.ray_actor_options["num_cpus"] == 0.5
    assert replicas.init_args == (
        config.engine_config(),
        config.etcd_settings().model_dump(),
        config.artifact_root,
        config.demand_window_s(),
    )
    with pytest.raises(ValueError, match="etcd.endpoints is not set"):
        build_app(LoraplexConfig(model=str(model_dir), artifact_root="/a").model_dump())


def test_serve_builds_the_app_from_the_config_files_import_path(tmp_path, model_dir):
    """What `serve deploy` does with the file: import `import_path`, call it with `args`."""
    pytest.importorskip("loraplex.replica.deployment")
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    config = LoraplexConfig(
        model=str(model_dir),
        artifact_root=str(tmp_path / "artifacts"),
        etcd={"endpoints": ["127.0.0.1:2379"]},
    )
    (app_spec,) = config.to_serve_config()["applications"]
    module, _, name = app_spec["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), name)
    app = call_user_app_builder_with_args_if_necessary(builder, app_spec["args"])
    assert app._bound_deployment.name == "ingress"


# ---------------------------------------------------------------- `ray up` cluster files


@pytest.mark.parametrize("name", ray_up_files.CLUSTER_FILES)
def test_ray_up_cluster_files_pass_rays_own_validation(name):
    config = yaml.safe_load((CLUSTER / name).read_text())
    prepared = prepare_config(config)  # what `ray up` does before validating
    validate_config(prepared)
    commands = " ".join(prepared["head_start_ray_commands"])
    assert "loraplex.cluster.cli up --config" in commands and "--address auto" in commands
    starts = [c for c in prepared["worker_start_ray_commands"] if "ray start" in c]
    assert starts and all("LORAPLEX_ADMIN_KEY" in c for c in starts)
    assert any(
        "loraplex.cluster.ray_node_watch" in c for c in prepared["worker_start_ray_commands"]
    )


@pytest.mark.parametrize("name", ray_up_files.CLUSTER_FILES)
def test_ray_up_files_share_one_list_of_mounts_and_commands(name):
    """Every path and command the cloud and on-prem files share is the one list in
    cluster/ray_up_files.py: as a YAML loader reads the file, and as its text (a test of
    `python -m loraplex.cluster.ray_up_files --check`: the committed file is current)."""
    text = (CLUSTER / name).read_text()
    assert sorted(ray_up_files.blocks(text)) == sorted(ray_up_files.SHARED)
    assert ray_up_files.rewrite(text) == text, "run: python -m loraplex.cluster.ray_up_files"
    config = yaml.safe_load(text)
    shared = ray_up_files.shared_values()
    assert config["file_mounts"] == shared["file_mounts"]
    setup = shared["setup_commands"]
    assert config["setup_commands"][: len(setup)] == setup  # a cloud adds its own after
    assert config["head_start_ray_commands"] == shared["head_start_ray_commands"]
    assert config["worker_start_ray_commands"] == shared["worker_start_ray_commands"]


def test_the_shared_commands_install_the_ray_the_project_ships():
    """One Ray version: the nodes' venv, the chart's image and its values."""
    image = (CLUSTER.parent / "helm" / "image" / "Dockerfile").read_text()
    values = yaml.safe_load((CLUSTER.parent / "helm" / "loraplex" / "values.yaml").read_text())
    assert f"ARG RAY_VERSION={ray_up_files.RAY_VERSION}\n" in image
    assert values["rayVersion"] == ray_up_files.RAY_VERSION
    assert f'"ray[serve]=={ray_up_files.RAY_VERSION}"' in " ".join(
        ray_up_files.shared_values()["setup_commands"]
    )


def test_a_stale_shared_block_is_rewritten_and_reported(tmp_path, capsys):
    for name in ray_up_files.CLUSTER_FILES:
        (tmp_path / name).write_text((CLUSTER / name).read_text())
    stale = tmp_path / "cluster.yaml"
    stale.write_text(stale.read_text().replace("ray stop", "ray stop --force", 1))
    assert ray_up_files.main(["--check", "--dir", str(tmp_path)]) == 1
    assert f"{stale}: differ" in capsys.readouterr().out
    assert ray_up_files.main(["--dir", str(tmp_path)]) == 0
    assert stale.read_text() == (CLUSTER / "cluster.yaml").read_text()


def test_ray_validation_is_not_vacuous():
    config = yaml.safe_load((CLUSTER / "cluster.yaml").read_text())
    config["available_node_types"]["head"]["min_workerz"] = 1
    with pytest.raises(Exception, match="min_workerz"):
        validate_config(prepare_config(config))


# ---------------------------------------------------------------- `loraplex up` pieces


def test_up_names_the_missing_parts_of_the_app(monkeypatch):
    local_cluster.check_app_importable()  # this install has them all
    monkeypatch.setitem(sys.modules, "loraplex.router.serve_backend", None)  # as if absent
    with pytest.raises(CLIError) as caught:
        local_cluster.check_app_importable()
    assert "the Serve app cannot be built" in str(caught.value)
    assert "loraplex.router.serve_backend" in str(caught.value)


@pytest.mark.parametrize("address", [[], ["--address", "auto"]])
def test_up_refuses_a_model_folder_missing_here_before_starting_anything(tmp_path, capsys, address):
    missing = tmp_path / "models" / "absent"
    config = write_yaml(tmp_path / "c.yaml", {"model": str(missing)})
    state_dir = tmp_path / "state"
    assert cli_main(["up", "--config", str(config), "--state-dir", str(state_dir), *address]) == 2
    where = " on this node (every node of the cluster needs it)" if address else ""
    err = capsys.readouterr().err
    assert f"model {missing}{where}: " in err and "(no config.json) nor a .gguf file" in err
    assert not state_dir.exists()  # nothing written, no supervisor started


def test_up_refuses_an_etcd_that_does_not_answer_before_starting_anything(
    tmp_path, capsys, model_dir
):
    port = free_port()
    settings = {
        "model": str(model_dir),
        "etcd": {"endpoints": [f"127.0.0.1:{port}"], "timeout_s": 1},
    }
    config = write_yaml(tmp_path / "c.yaml", settings)
    state_dir = tmp_path / "state"
    started = time.monotonic()
    code = cli_main(
        ["up", "--config", str(config), "--state-dir", str(state_dir), "--address", "auto"]
    )
    assert code == 2 and time.monotonic() - started < 30
    error = capsys.readouterr().err
    assert f"etcd unavailable (timeout 1s): 127.0.0.1:{port}: not reachable" in error, error
    assert "check etcd.endpoints" in error
    assert not state_dir.exists()


def test_up_check_refuses_as_up_does_and_passes_a_good_config_starting_nothing(
    tmp_path, capsys, model_dir
):
    """`loraplex up --check`, which the `ray up` files run before `ray start`: a missing
    model is refused with `up`'s message, a good config passes, and neither writes the
    state dir or starts anything (a supervisor would have written cluster.json there)."""
    missing = write_yaml(tmp_path / "bad.yaml", {"model": str(tmp_path / "absent")})
    good = write_yaml(tmp_path / "good.yaml", {"model": str(model_dir)})
    state_dir = tmp_path / "state"
    common = ["--state-dir", str(state_dir), "--address", "auto", "--check"]
    assert cli_main(["up", "--config", str(missing), *common]) == 2
    assert "on this node (every node of the cluster needs it)" in capsys.readouterr().err
    assert cli_main(["up", "--config", str(good), *common]) == 0
    out = capsys.readouterr().out
    assert f"model {model_dir} is a checkpoint" in out and "`loraplex up` starts one" in out
    assert not state_dir.exists()


def test_the_ray_up_files_check_the_config_before_ray_starts():
    """The head's first command is the check, before `ray stop` and `ray start`: a bad
    config starts nothing and leaves a running cluster running."""
    for name in ("cluster.yaml", "cluster-onprem.yaml"):
        head = yaml.safe_load((CLUSTER / name).read_text())["head_start_ray_commands"]
        assert head[0].startswith("python3 -m loraplex.cluster.cli up --check"), (name, head[0])
        assert head[1] == "ray stop" and "ray start --head" in head[2], (name, head)


def test_admin_key_is_generated_once_and_private(tmp_path):
    key = local_cluster.admin_key_for(tmp_path, None)
    assert len(key) >= 16
    assert stat.S_IMODE(os.stat(tmp_path / "admin_key").st_mode) == 0o600
    assert local_cluster.admin_key_for(tmp_path, None) == key
    assert (
        local_cluster.admin_key_for(tmp_path, "from-the-environment-0123")
        == "from-the-environment-0123"
    )
    with pytest.raises(CLIError, match="at least 16 characters"):
        local_cluster.admin_key_for(tmp_path, "short")


def test_down_and_status_without_a_cluster_say_so(tmp_path, capsys):
    assert local_cluster.down(tmp_path) == 0
    assert "no loraplex cluster is running" in capsys.readouterr().out
    assert local_cluster.status(tmp_path) == 1
    assert "not running" in capsys.readouterr().out
    # a stale state file whose pid is not a supervisor counts as not running
    state.write_state(tmp_path, {"pid": os.getpid(), "phase": "running"})
    assert local_cluster.status(tmp_path) == 1


def test_a_worker_watch_returns_only_once_the_gcs_has_refused_for_a_while():
    """cluster/ray_node_watch.py against a real listener standing in for the head's GCS."""
    import socket
    import threading

    from loraplex.cluster import ray_node_watch

    listener = socket.create_server(("127.0.0.1", 0))
    gcs = listener.getsockname()[:2]
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (ray_node_watch.watch(gcs, poll_s=0.1), done.set()), daemon=True
    )
    thread.start()
    assert not done.wait(1.5)  # the GCS answers: the watch goes on
    listener.close()
    closed = time.monotonic()
    assert done.wait(ray_node_watch.RAY_LOST_AFTER_S + 5)
    assert time.monotonic() - closed >= ray_node_watch.RAY_LOST_AFTER_S
