"""Registration input, staged outside the artifact root: a multipart body parsed as it
arrives (file parts straight to disk, size limits enforced while reading), a bounded JSON
body, and the PEFT folder assembled from the parts or an archive (a path under an allowed root:
`paths.py`). `assemble_upload` blocks on untrusted input: run it through `run_isolated`."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

from loraplex import strict_json
from loraplex.adapter_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    shown,
)
from loraplex.errors import Invalid, TooLarge, Unacceptable
from loraplex.registry.admission import Reservation
from loraplex.registry.archives import ArchiveLimits, safe_extract_tar_gz
from loraplex.registry.models import NAME_PATTERN
from loraplex.registry.request_body import (
    BodyTimeouts,
    check_declared_length,
    read_capped,
    receive,
)

MAX_JSON_BYTES = 64 << 10
MAX_FORM_FIELD_BYTES = 1 << 10
MAX_BOUNDARY_CHARS = 70  # RFC 2046's limit; clients send 32-40
_FLUSH_BYTES = 1 << 20
_UNPARSED = object()


@dataclass
class UploadForm:
    """Fields of a registration upload; file parts go straight to `work` on disk."""

    work: Path
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    filenames: dict[str, str] = field(default_factory=dict)
    _open: list[IO[bytes]] = field(default_factory=list)
    _pending: list[tuple[IO[bytes], bytes]] = field(default_factory=list)
    pending_bytes: int = 0
    _header_name: bytes = b""
    _header_value: bytes = b""
    _disposition: bytes = b""
    _name: str = ""
    _file: IO[bytes] | None = None
    _value: bytearray = field(default_factory=bytearray)

    TEXT_FIELDS = ("name", "pinned")
    FILE_FIELDS = ("adapter_config", "adapter_model", "archive")

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value_data,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self._disposition, self._file, self._value = b"", None, bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        accepted = ", ".join(self.TEXT_FIELDS + self.FILE_FIELDS)
        if name not in self.TEXT_FIELDS + self.FILE_FIELDS:
            raise Invalid(f"unexpected form field {shown(name)}; accepted: {accepted}")
        if name in self.fields or name in self.files:
            raise Invalid(f"form field {shown(name)} sent twice")
        self._name = name
        if name in self.FILE_FIELDS:
            path = self.work / f"{name}.upload"
            self._file = path.open("xb")
            self._open.append(self._file)
            self.files[name] = path
            self.filenames[name] = options.get(b"filename", b"").decode("utf-8", "replace")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._file is not None:
            self._pending.append((self._file, bytes(data[start:end])))
            self.pending_bytes += end - start
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FORM_FIELD_BYTES:
            raise TooLarge(f"form field {self._name!r} exceeds {MAX_FORM_FIELD_BYTES} bytes")

    def _part_end(self) -> None:
        if self._file is None:
            try:
                self.fields[self._name] = self._value.decode("utf-8")
            except UnicodeDecodeError:
                raise Invalid(f"form field {self._name!r} is not UTF-8") from None

    def flush(self) -> None:
        for file, data in self._pending:
            file.write(data)
        self._pending.clear()
        self.pending_bytes = 0

    def close(self) -> None:
        self.flush()
        for file in self._open:
            file.close()


async def receive_multipart(
    request: Request,
    work: Path,
    max_bytes: int,
    staging: Reservation,
    timeouts: BodyTimeouts | None = None,
) -> UploadForm:
    """Parse a multipart body as it arrives, writing file parts to `work`; stops with 413 once
    `max_bytes` have been received, whatever Content-Length claimed. Every byte is reserved
    in `staging` before it is written."""
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise Invalid("multipart/form-data body without a boundary")
    if len(boundary) > MAX_BOUNDARY_CHARS:
        raise Invalid(
            f"multipart boundary of {len(boundary)} characters; at most {MAX_BOUNDARY_CHARS} "
            "(RFC 2046)"
        )
    check_declared_length(request, max_bytes, "max_upload_bytes")
    form = UploadForm(work)
    parser = MultipartParser(boundary, form.callbacks())
    received = 0
    try:
        async for chunk in receive(request, timeouts):
            received += len(chunk)
            staging.take(len(chunk))
            if received > max_bytes:
                raise TooLarge(f"upload exceeds {max_bytes} bytes (max_upload_bytes)")
            parser.write(chunk)
            if form.pending_bytes >= _FLUSH_BYTES:  # one thread hop per MiB, not per chunk
                await asyncio.to_thread(form.flush)
        parser.finalize()
        if parser.state != MultipartState.END:  # finalize() does not check it
            raise Invalid("multipart body ended before its closing boundary (truncated upload)")
    except FormParserError as e:
        raise Invalid(f"malformed multipart body: {e}") from None
    finally:
        await asyncio.to_thread(form.close)
    return form


async def read_json(
    request: Request, model: type[BaseModel], timeouts: BodyTimeouts | None = None
) -> Any:
    """A JSON body of at most MAX_JSON_BYTES as `model`: read (and, with a JSON content type,
    parsed strictly) by `read_capped`, as every JSON body of the tenant API is; Invalid if it
    is not JSON, Unacceptable if it is not `model`."""
    data = await read_capped(request, MAX_JSON_BYTES, "JSON bodies of the tenant API", timeouts)
    value = getattr(request, "_json", _UNPARSED)  # read_capped parsed a JSON content type
    if value is _UNPARSED:
        try:
            value = strict_json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # NotStrictJSON too
            raise Invalid(f"request body is not valid JSON: {str(e)[:200]}") from None
    try:
        return model.model_validate(value)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()
        )
        raise Unacceptable(f"invalid request body: {problems}") from None


def assemble_upload(
    files: dict[str, Path], filenames: dict[str, str], dest: Path, limits: ArchiveLimits
) -> None:
    """Turn the uploaded parts (`UploadForm.files` and `.filenames`) into a PEFT folder at
    `dest` (blocking, and an archive is untrusted: run in a worker process)."""
    dest.mkdir()
    if "archive" in files:
        if "adapter_config" in files or "adapter_model" in files:
            raise Invalid(
                "send either 'archive' or the files 'adapter_config' and 'adapter_model', not both",
            )
        with files["archive"].open("rb") as archive:
            safe_extract_tar_gz(archive, dest, limits)
        return
    missing = [name for name in ("adapter_config", "adapter_model") if name not in files]
    if missing:
        raise Invalid(
            f"missing file field(s) {missing}; send 'adapter_config' ({CONFIG_FILE}) and "
            f"'adapter_model' ({WEIGHTS_FILE}), or one 'archive' (tar.gz)",
        )
    if filenames.get("adapter_model", "").endswith((".bin", ".pt", ".pth")):
        raise Unacceptable(
            f"{shown(filenames['adapter_model'])}: pickle weights are refused; upload {WEIGHTS_FILE}",
        )
    os.replace(files["adapter_config"], dest / CONFIG_FILE)
    os.replace(files["adapter_model"], dest / WEIGHTS_FILE)


STAGING_PREFIX = "loraplex-upload-"
_STAGED_BY = re.compile(re.escape(STAGING_PREFIX) + r"(\d+)-")


@asynccontextmanager
async def staging(staging_dir: str | None) -> AsyncIterator[Path]:
    """A fresh folder for one registration, removed with everything in it afterwards. Its
    name carries this process's id, so that `sweep_staging` can tell a leaked one."""
    prefix = f"{STAGING_PREFIX}{os.getpid()}-"
    work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=prefix, dir=staging_dir))
    try:
        yield work
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)


def form_name(form: UploadForm) -> str:
    name = form.fields.get("name")
    if name is None:
        raise Unacceptable("form field 'name' is required")
    return check_name(name)


def form_bool(form: UploadForm, field_name: str) -> bool:
    return bool(form_optional_bool(form, field_name))


def form_optional_bool(form: UploadForm, field_name: str) -> bool | None:
    """The field's value, None when it was not sent."""
    if field_name not in form.fields:
        return None
    value = form.fields[field_name].strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise Unacceptable(f"form field {field_name!r} must be true or false, found {shown(value)}")
    return value in ("true", "1")


def check_name(name: str) -> str:
    if not re.fullmatch(NAME_PATTERN, name):
        raise Unacceptable(f"adapter name {shown(name)} must match {NAME_PATTERN}")
    return name


def sweep_staging(staging_dir: str | None) -> list[Path]:
    """Remove the staging folders of processes that no longer run (an API process killed
    mid-upload leaves tenants' bytes behind); returns them. Folders of live processes,
    this one's or another API process's on the same disk, stay."""
    root = Path(staging_dir or tempfile.gettempdir())
    swept = []
    for entry in root.glob(STAGING_PREFIX + "*"):
        match = _STAGED_BY.match(entry.name)
        if match is None or _alive(int(match.group(1))) or not entry.is_dir():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        swept.append(entry)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
