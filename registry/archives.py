"""Untrusted containers of an adapter: a tar.gz upload, extracted without escapes or bombs,
and a registration path, confined to the operator's allowed roots. Refusals are
`AdapterRejected`: `Invalid` (unreadable or forbidden), `TooLarge`, `Unacceptable` (pickle
weights)."""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from loraplex.registry.errors import Invalid, TooLarge, Unacceptable
from loraplex.registry.validation import (
    ADAPTER_FILES,
    CONFIG_FILE,
    PICKLE_WEIGHTS_FILE,
    WEIGHTS_FILE,
)

_STEP_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class ArchiveLimits:
    max_members: int = 8  # headers read (folders included) before giving up
    max_total_bytes: int = 1 << 30  # bytes extracted (file contents), summed

    def __post_init__(self) -> None:
        assert self.max_members >= 2 and self.max_total_bytes >= 1


def _decompressed(fileobj: IO[bytes], limit: int, framing: int) -> Iterator[bytes]:
    """gunzip `fileobj` in steps of at most 64 KiB of output (so a tiny input cannot inflate
    to gigabytes in memory); refuse once the output passes limit + framing."""
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip framing
    produced, data = 0, b""
    while not decompressor.eof:
        if not data:
            data = fileobj.read(64 << 10)
        if data:
            out = decompressor.decompress(data, _STEP_BYTES)
            data = decompressor.unconsumed_tail
        else:  # the input is all read: take what zlib still holds
            out = decompressor.flush()
            if not decompressor.eof:
                raise Invalid("archive is not a complete gzip stream (truncated upload?)")
        produced += len(out)
        if produced > limit + framing:
            raise TooLarge(f"archive expands past {limit} bytes; refusing to decompress further")
        yield out


class _ChunkStream:
    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._buffer = chunks, bytearray()

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buffer) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buffer += chunk
        n = len(self._buffer) if size < 0 else min(size, len(self._buffer))
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


def safe_extract_tar_gz(fileobj: IO[bytes], dest: Path, limits: ArchiveLimits) -> Path:
    """Extract a tar.gz holding adapter_config.json and adapter_model.safetensors (at the top
    level or inside one folder) into `dest` (an empty folder) and return `dest`.

    Only those two regular files are accepted: links, devices, absolute paths, `..`, any other
    member and duplicates are refused. Decompression is streamed and stops once the output
    passes the byte limit (tar framing included), so neither the gzip ratio nor the tar
    headers' sizes can make it write or buffer more. Output names are fixed, so nothing lands
    outside `dest`; on refusal, files written so far are removed."""
    # Tar framing: a 512-byte header per member, padding to 512, two end blocks, and records
    # padded to 10 KiB by most writers.
    framing = limits.max_members * 1024 + (20 << 10)
    stream = _ChunkStream(_decompressed(fileobj, limits.max_total_bytes, framing))
    written: list[Path] = []
    try:
        _extract_members(stream, dest, limits, written)
        missing = [name for name in ADAPTER_FILES if not (dest / name).is_file()]
        if missing:
            raise Invalid(
                f"archive lacks {', '.join(missing)}; it must hold {CONFIG_FILE} and {WEIGHTS_FILE}"
            )
    except BaseException as e:
        for path in written:
            path.unlink(missing_ok=True)
        if isinstance(e, tarfile.TarError | zlib.error | EOFError | OSError):
            raise Invalid(f"archive is not a valid tar.gz: {e}") from None
        raise
    return dest


def _extract_members(
    stream: _ChunkStream, dest: Path, limits: ArchiveLimits, written: list[Path]
) -> None:
    total = 0
    top: str | None = None
    with tarfile.open(fileobj=stream, mode="r|") as archive:  # type: ignore[call-overload]
        for count, member in enumerate(archive, start=1):
            if count > limits.max_members:
                raise TooLarge(
                    f"archive has more than {limits.max_members} members; expected {CONFIG_FILE} and {WEIGHTS_FILE}"
                )
            parts = _member_parts(member.name)
            if member.isdir():
                if len(parts) > 1:
                    raise Invalid(
                        f"archive member {member.name!r}: nested folders are not accepted; files must sit at the top level or in one folder"
                    )
                top = _same_folder(member.name, top, parts[0] if parts else None)
                continue
            if not member.isfile():
                kind = (
                    "a symlink"
                    if member.issym()
                    else "a hard link"
                    if member.islnk()
                    else "a device or fifo"
                )
                raise Invalid(
                    f"archive member {member.name!r} is {kind}; only regular files are accepted"
                )
            filename = parts[-1] if parts else ""
            if filename == PICKLE_WEIGHTS_FILE:
                raise Unacceptable(
                    f"archive member {member.name!r}: pickle weights are refused; use {WEIGHTS_FILE}",
                )
            if filename not in ADAPTER_FILES or len(parts) > 2:
                raise Invalid(
                    f"archive member {member.name!r} is not accepted; an archive holds only {CONFIG_FILE} and {WEIGHTS_FILE}, optionally inside one folder"
                )
            top = _same_folder(member.name, top, parts[0] if len(parts) == 2 else "")
            target = dest / filename
            if target.exists():
                raise Invalid(f"archive holds {filename} twice")
            if total + member.size > limits.max_total_bytes:
                raise TooLarge(f"archive contents exceed {limits.max_total_bytes} bytes")
            source = archive.extractfile(member)
            assert source is not None
            written.append(target)
            total += _copy_bounded(source, target, limits.max_total_bytes - total)


def _same_folder(name: str, top: str | None, folder: str | None) -> str | None:
    """The one folder (or "" for the top level) all files share; None until the first."""
    if folder is None or top is None or folder == top:
        return top if folder is None else folder
    raise Invalid(
        f"archive member {name!r}: files must sit together at the top level or in one folder"
    )


def _member_parts(name: str) -> tuple[str, ...]:
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise Invalid(
            f"archive member {name!r} has an absolute path; only relative names are accepted"
        )
    if "\\" in name:
        raise Invalid(
            f"archive member {name!r} contains a backslash; use '/' separated relative names"
        )
    parts = tuple(p for p in PurePosixPath(name).parts if p != ".")
    if ".." in parts:
        raise Invalid(f"archive member {name!r} contains '..'; path traversal is refused")
    return parts


def _copy_bounded(source: IO[bytes], target: Path, budget: int) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    copied = 0
    with os.fdopen(os.open(target, flags, 0o644), "wb") as out:
        while chunk := source.read(1 << 20):
            copied += len(chunk)
            if copied > budget:
                raise TooLarge("archive contents exceed the extraction limit")
            out.write(chunk)
    return copied


# ---------------------------------------------------------------- registration by path


def resolve_under_roots(path: str | os.PathLike[str], allowed_roots: list[str]) -> Path:
    """The real path of an adapter folder, if it lies inside one of `allowed_roots`.

    Symlinks are resolved first, so a link pointing out of a root is refused; the adapter
    files inside the folder must resolve inside a root too (Hugging Face caches link
    snapshot files to blobs in the same cache). Whether a path outside the roots exists is
    never revealed."""
    raw = os.fspath(path)
    if not allowed_roots:
        raise Invalid(
            "registration by path is disabled: the server has no allowed_roots configured"
        )
    if not raw or "\x00" in raw:
        raise Invalid("path must be a non-empty absolute path")
    if not os.path.isabs(raw):
        raise Invalid(f"path {raw!r} must be absolute")
    roots = [os.path.realpath(root) for root in allowed_roots]
    real = os.path.realpath(raw)
    if not _inside_any(real, roots):
        raise Invalid(
            f"path {raw!r} is not inside the allowed roots {list(allowed_roots)} (symlinks resolved)"
        )
    if not os.path.isdir(real):
        raise Invalid(f"path {raw!r} is not a folder; expected a PEFT adapter folder")
    for name in (*ADAPTER_FILES, PICKLE_WEIGHTS_FILE):
        file_path = os.path.join(real, name)
        if os.path.lexists(file_path) and not _inside_any(os.path.realpath(file_path), roots):
            raise Invalid(f"{name} in {raw!r} links outside the allowed roots")
    return Path(real)


def _inside_any(real: str, roots: list[str]) -> bool:
    return any(os.path.commonpath([root, real]) == root for root in roots)
