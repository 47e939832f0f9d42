"""`loraplex adapters add | list | rm`: the tenant API from the shell.

    loraplex adapters add NAME DIR             upload a PEFT folder (adapter_config.json
                                               + adapter_model.safetensors)
    loraplex adapters add NAME --archive FILE  upload a tar.gz of those two files
    loraplex adapters add NAME --server-path P register a folder the server can read
    loraplex adapters list [--json]
    loraplex adapters rm NAME

Uploads stream from disk with a progress bar on stderr. The server's refusal (4xx) is
printed as one line with its message, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from loraplex.cluster.errors import CLIError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
URL_ENV, API_KEY_ENV = "LORAPLEX_URL", "LORAPLEX_API_KEY"
DEFAULT_URL = "http://127.0.0.1:8000"
_CHUNK = 256 << 10


@dataclass(frozen=True, slots=True)
class Endpoint:
    url: str
    api_key: str
    timeout_s: float = 300.0

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url.rstrip("/"),
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=httpx.Timeout(self.timeout_s, connect=10.0),
        )


def add_parsers(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the cluster (default ${URL_ENV} or {DEFAULT_URL})")
    common.add_argument("--api-key", help=f"a tenant API key (default ${API_KEY_ENV})")
    p = sub.add_parser("adapters", help="add, list and remove your LoRA adapters")
    verbs = p.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", parents=[common], help="register an adapter")
    add.add_argument("name", help="adapter name (a-z 0-9 . _ -), what requests pass as model")
    add.add_argument("path", nargs="?", type=Path, help="PEFT adapter folder (or a .tar.gz)")
    add.add_argument("--archive", type=Path, help="tar.gz holding the adapter's two files")
    add.add_argument(
        "--server-path",
        help="a folder in your subtree of the server's allowed roots (ROOT/TENANT/...)",
    )
    add.add_argument("--pinned", action="store_true", help="keep it resident on replicas")
    ls = verbs.add_parser("list", parents=[common], help="your adapters")
    ls.add_argument("--json", action="store_true", help="the API's JSON")
    rm = verbs.add_parser("rm", parents=[common], help="delete an adapter")
    rm.add_argument("name")


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ  # read once, here
    api_key = args.api_key or environ.get(API_KEY_ENV)
    if not api_key:
        raise CLIError(f"no API key: pass --api-key or set {API_KEY_ENV}")
    endpoint = Endpoint(args.url or environ.get(URL_ENV) or DEFAULT_URL, api_key)
    if args.verb == "add":
        record = add_adapter(
            endpoint,
            args.name,
            path=args.path,
            archive=args.archive,
            server_path=args.server_path,
            pinned=args.pinned,
        )
        print(f"added {record['name']}: rank {record['rank']}, {_size(record['size_bytes'])}")
    elif args.verb == "list":
        records = list_adapters(endpoint)
        print(json.dumps(records, indent=2) if args.json else format_table(records))
    else:
        record = remove_adapter(endpoint, args.name)
        print(f"removed {record['name']}")
    return 0


# ---------------------------------------------------------------- calls


def add_adapter(
    endpoint: Endpoint,
    name: str,
    *,
    path: Path | None = None,
    archive: Path | None = None,
    server_path: str | None = None,
    pinned: bool = False,
    progress: IO[str] | None = None,
) -> dict[str, Any]:
    """Register one adapter from exactly one source; the API's record."""
    sources = [s for s in (path, archive, server_path) if s is not None]
    if len(sources) != 1:
        raise CLIError("give one source: a PEFT folder PATH, --archive FILE or --server-path")
    if server_path is not None:
        body = {"name": name, "path": server_path, "pinned": pinned}
        return _call(endpoint, "POST", "/v1/adapters", json=body)
    if path is not None and path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        path, archive = None, path
    if archive is not None:
        _check_file(archive)
        files = [("archive", archive, "application/gzip")]
    else:
        assert path is not None
        if not path.is_dir():
            raise CLIError(f"{path} is not a folder (a PEFT adapter folder or a .tar.gz)")
        files = [
            ("adapter_config", path / CONFIG_FILE, "application/json"),
            ("adapter_model", path / WEIGHTS_FILE, "application/octet-stream"),
        ]
        for _, file, _ in files:
            _check_file(file)
    form = MultipartBody({"name": name, "pinned": "true" if pinned else "false"}, files)
    bar = ProgressBar(form.total, f"uploading {name}", progress or sys.stderr)
    form.on_progress = bar.update
    try:
        return _call(
            endpoint,
            "POST",
            "/v1/adapters",
            content=iter(form),
            headers={"Content-Type": form.content_type, "Content-Length": str(form.total)},
        )
    finally:
        bar.close()


def list_adapters(endpoint: Endpoint) -> list[dict[str, Any]]:
    return _call(endpoint, "GET", "/v1/adapters")["adapters"]


def remove_adapter(endpoint: Endpoint, name: str) -> dict[str, Any]:
    return _call(endpoint, "DELETE", f"/v1/adapters/{name}")


def _call(endpoint: Endpoint, method: str, route: str, **kwargs: Any) -> Any:
    try:
        with endpoint.client() as client:
            response = client.request(method, route, **kwargs)
    except httpx.TransportError as e:
        raise CLIError(f"cannot reach {endpoint.url}: {e or type(e).__name__}") from None
    if response.is_success:
        return response.json()
    raise CLIError(f"{response.status_code} {response.reason_phrase}: {error_message(response)}")


def error_message(response: httpx.Response) -> str:
    """The API's message: FastAPI's `detail` (a string, or validation errors) or OpenAI's
    `error.message`; else the body's first line."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip().splitlines()[0] if response.text.strip() else "(no body)"
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):  # request validation: [{loc, msg, ...}]
        return "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}" for d in detail
        )
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(body)


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise CLIError(f"{path}: no such file")


# ---------------------------------------------------------------- upload body and progress


class MultipartBody:
    """multipart/form-data streamed from disk, with its exact length known up front (so
    the server can refuse an oversized upload before it is sent). `on_progress(sent)` is
    called after every chunk."""

    def __init__(self, fields: dict[str, str], files: list[tuple[str, Path, str]]):
        self.boundary = secrets.token_hex(16)
        self.content_type = f"multipart/form-data; boundary={self.boundary}"
        self._parts: list[bytes | Path] = []
        for key, value in fields.items():
            self._parts.append(self._head(key) + b"\r\n" + value.encode() + b"\r\n")
        for key, path, mime in files:
            head = self._head(key, f'; filename="{path.name}"', mime)
            self._parts += [head + b"\r\n", path, b"\r\n"]
        self._parts.append(f"--{self.boundary}--\r\n".encode())
        self.total = sum(p.stat().st_size if isinstance(p, Path) else len(p) for p in self._parts)
        self.on_progress: Callable[[int], None] = lambda _sent: None

    def _head(self, key: str, extra: str = "", mime: str | None = None) -> bytes:
        lines = [f"--{self.boundary}", f'Content-Disposition: form-data; name="{key}"{extra}']
        if mime:
            lines.append(f"Content-Type: {mime}")
        return ("\r\n".join(lines) + "\r\n").encode()

    def __iter__(self) -> Iterator[bytes]:
        sent = 0
        for part in self._parts:
            for chunk in _chunks(part):
                sent += len(chunk)
                yield chunk
                self.on_progress(sent)


def _chunks(part: bytes | Path) -> Iterator[bytes]:
    if isinstance(part, bytes):
        yield part
        return
    with open(part, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class ProgressBar:
    """`label [#####.....]  42%  1.2/2.9 MiB` on one line of `stream`, redrawn in place
    on a terminal; elsewhere (logs, pipes) one line per quarter."""

    WIDTH = 30

    def __init__(self, total: int, label: str, stream: IO[str]):
        self.total, self.label, self.stream = max(total, 1), label, stream
        self.tty = stream.isatty()
        self.shown = -1

    def update(self, done: int) -> None:
        percent = min(100, done * 100 // self.total)
        step = 1 if self.tty else 25
        if percent == self.shown or (percent < 100 and percent < self.shown + step):
            return
        self.shown = percent
        filled = self.WIDTH * percent // 100
        bar = "#" * filled + "." * (self.WIDTH - filled)
        line = f"{self.label} [{bar}] {percent:3d}%  {_size(done)}/{_size(self.total)}"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.shown >= 0:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------- output


def format_table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "no adapters"
    rows = [("NAME", "RANK", "ALPHA", "TARGETS", "SIZE", "PINNED")]
    for r in records:
        rows.append(
            (
                r["name"],
                str(r["rank"]),
                f"{r['alpha']:g}",
                ",".join(r["target_modules"]),
                _size(r["size_bytes"]),
                "yes" if r.get("pinned") else "no",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
