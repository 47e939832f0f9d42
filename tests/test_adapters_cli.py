"""`loraplex adapters add | list | rm` against the real tenant API (uvicorn, real etcd):
uploads from a folder and from an archive stream with a progress bar, and every refusal is
one line carrying the API's own message, exit code 2."""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from etcd_server import EtcdServer, shared_etcd_server_fixture  # noqa: F401 (fixture)
from http_server import serve
from tiny_model import BASE, SPEC

from loraplex.cluster import adapters_cli
from loraplex.cluster.errors import CLIError
from loraplex.demo.synthetic import AdapterSpec, write_adapter
from loraplex.net import free_port
from loraplex.registry.api import RegistryAPISettings, create_app

pytestmark = pytest.mark.etcd

ADMIN_KEY = "admin-key-for-the-adapters-cli-test"


@pytest.fixture(scope="module")
def api(shared_etcd_server: EtcdServer, tmp_path_factory) -> Iterator[str]:
    """The tenant API under uvicorn on a free loopback port."""
    tmp = tmp_path_factory.mktemp("tenant_api")
    settings = RegistryAPISettings(
        admin_key=ADMIN_KEY,
        base_model_id="tiny",
        base_model=BASE,
        max_lora_rank=32,
        staging_dir=str(tmp),
    )
    app = create_app(settings, shared_etcd_server.settings(), tmp / "artifacts")
    with serve(app, timeout_s=10) as url:
        yield url


_tenants = iter(range(1000))


@pytest.fixture
def env(api: str) -> dict[str, str]:
    """A fresh tenant per test: the environment the CLI would run in."""
    name = f"cli-{next(_tenants)}"
    r = httpx.post(
        f"{api}/v1/tenants",
        json={"name": name},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return {"LORAPLEX_URL": api, "LORAPLEX_API_KEY": r.json()["api_key"]}


def loraplex(*argv: str, env: dict[str, str]) -> int:
    """`loraplex adapters ...` as cluster/cli.py runs it: CLIError -> one line, exit 2."""
    parser = argparse.ArgumentParser(prog="loraplex")
    adapters_cli.add_parsers(parser.add_subparsers(dest="command", required=True))
    try:
        return adapters_cli.run(parser.parse_args(["adapters", *argv]), env)
    except CLIError as e:
        print(f"loraplex: error: {e}", file=__import__("sys").stderr)
        return 2


def adapter(path: Path, *, rank: int = 8, seed: int = 1) -> Path:
    write_adapter(path, SPEC, AdapterSpec(path.name, rank, 16.0, ("q_proj", "v_proj"), seed=seed))
    return path


def archive_of(folder: Path) -> Path:
    target = folder.with_suffix(".tar.gz")
    with tarfile.open(target, "w:gz") as tar:
        for file in (adapters_cli.CONFIG_FILE, adapters_cli.WEIGHTS_FILE):
            tar.add(folder / file, arcname=file)
    return target


def test_add_list_rm_from_a_folder_with_a_progress_bar(env, tmp_path, capsys):
    source = adapter(tmp_path / "sql")
    assert loraplex("add", "sql", str(source), "--pinned", env=env) == 0
    out, err = capsys.readouterr()
    assert out.startswith("added sql: rank 8, ")
    assert "uploading sql [" in err and "100%" in err.splitlines()[-1]

    assert loraplex("list", env=env) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "RANK", "ALPHA", "TARGETS", "SIZE", "PINNED"]
    assert table[1].split()[:4] == ["sql", "8", "16", "q_proj,v_proj"] and table[1].endswith("yes")

    assert loraplex("list", "--json", env=env) == 0
    (record,) = json.loads(capsys.readouterr().out)
    weights = (source / adapters_cli.WEIGHTS_FILE).stat().st_size
    assert record["name"] == "sql" and record["pinned"] and record["size_bytes"] >= weights

    assert loraplex("rm", "sql", env=env) == 0
    assert capsys.readouterr().out == "removed sql\n"
    assert loraplex("list", env=env) == 0
    assert capsys.readouterr().out == "no adapters\n"


def test_add_from_an_archive_flag_or_a_tar_gz_path(env, tmp_path, capsys):
    packed = archive_of(adapter(tmp_path / "one", seed=2))
    assert loraplex("add", "one", "--archive", str(packed), env=env) == 0
    assert loraplex("add", "two", str(archive_of(adapter(tmp_path / "two", rank=16))), env=env) == 0
    capsys.readouterr()
    assert loraplex("list", "--json", env=env) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["rank"]) for r in records] == [("one", 8), ("two", 16)]


@pytest.mark.parametrize(
    ("setup", "argv", "line"),
    [
        ("taken", ["add", "taken", "{src}"], "409 Conflict: adapter 'taken' already exists"),
        (None, ["add", "big", "{big}"], "422 Unprocessable Entity: "),
        (
            None,
            ["add", "Bad!", "{src}"],
            "422 Unprocessable Entity: adapter name 'Bad!' must match",
        ),
        (None, ["rm", "never-added"], "404 Not Found: adapter 'never-added' not found"),
        (None, ["list", "--api-key", "not-a-key"], "401 Unauthorized: "),
        (None, ["add", "x", "{src}/adapter_config.json"], "is not a folder"),
        (None, ["add", "x", "--archive", "{src}/none.tar.gz"], "none.tar.gz: no such file"),
        (None, ["add", "x"], "give one source"),
    ],
)
def test_refusals_are_one_line_with_the_api_message_and_exit_2(
    env, tmp_path, capsys, setup, argv, line
):
    src = adapter(tmp_path / "src")
    big = adapter(tmp_path / "big", rank=64)  # over the server's max_lora_rank of 32
    if setup:
        assert loraplex("add", setup, str(src), env=env) == 0
    capsys.readouterr()
    argv = [a.format(src=src, big=big) for a in argv]
    assert loraplex(*argv, env=env) == 2
    out, err = capsys.readouterr()
    errors = [e for e in err.splitlines() if e.startswith("loraplex: error: ")]
    assert len(errors) == 1 and line in errors[0], err
    assert out == ""


def test_rank_refusal_carries_the_validators_reason(env, tmp_path, capsys):
    assert loraplex("add", "big", str(adapter(tmp_path / "big", rank=64)), env=env) == 2
    assert "max_lora_rank), found 64" in capsys.readouterr().err


def test_no_key_or_no_server_fail_before_anything_is_sent(env, tmp_path, capsys):
    assert loraplex("list", env={"LORAPLEX_URL": env["LORAPLEX_URL"]}) == 2
    assert "no API key: pass --api-key or set LORAPLEX_API_KEY" in capsys.readouterr().err
    dead = f"http://127.0.0.1:{free_port()}"
    assert loraplex("list", "--url", dead, env=env) == 2
    assert f"cannot reach {dead}" in capsys.readouterr().err


def test_progress_bar_redraws_in_place_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = adapters_cli.ProgressBar(1000, "uploading x", stream)
    for done in range(0, 1001, 10):
        bar.update(done)
    bar.close()
    frames = stream.getvalue().split("\r")[1:]
    assert len(frames) == 101 and frames[-1].endswith("100%  1000 B/1000 B\n")
    assert "[###############...............]  50%" in frames[50]


def test_multipart_body_is_what_a_form_parser_reads(tmp_path):
    from multipart import MultipartParser  # python-multipart, the server's parser

    source = adapter(tmp_path / "m")
    files = [("adapter_model", source / adapters_cli.WEIGHTS_FILE, "application/octet-stream")]
    body = adapters_cli.MultipartBody({"name": "m", "pinned": "false"}, files)
    seen: list[int] = []
    body.on_progress = seen.append
    data = b"".join(body)
    assert len(data) == body.total == seen[-1] and seen == sorted(seen)
    parts: list[bytes] = []
    parser = MultipartParser(
        body.boundary.encode(),
        {
            "on_part_begin": lambda: parts.append(b""),
            "on_part_data": lambda d, s, e: parts.__setitem__(-1, parts[-1] + d[s:e]),
        },
    )
    parser.write(data)
    parser.finalize()
    assert parts == [b"m", b"false", (source / adapters_cli.WEIGHTS_FILE).read_bytes()]
