"""An untrusted container of an adapter: a tar.gz upload, extracted without escapes or bombs
(a registration path: `paths.py`). Refusals are `AdapterRejected`: `Invalid` (unreadable or
forbidden), `TooLarge`, `Unacceptable` (pickle weights)."""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from loraplex.adapter_format import (
    ADAPTER_FILES,
    CONFIG_FILE,
    PICKLE_WEIGHTS_FILE,
    WEIGHTS_FILE,
    shown,
)
from loraplex.errors import Invalid, TooLarge, Unacceptable
from loraplex.registry.tar_reader import (
    BLOCK,
    EXTENDED_HEADERS_PER_ENTRY,
    MAX_EXTENDED_HEADER_BYTES,
    TarFormatError,
    TarReader,
    TarTooLarge,
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
    headers' sizes can make it write or buffer more; every header's size is checked before
    the header is read (`tar_reader`). Output names are fixed, so nothing lands outside
    `dest`; on refusal, files written so far are removed."""
    # Tar framing: per member a 512-byte header, up to four capped extended headers, padding;
    # two end blocks, and records padded to 10 KiB by most writers.
    per_member = 2 * BLOCK + EXTENDED_HEADERS_PER_ENTRY * (MAX_EXTENDED_HEADER_BYTES + BLOCK)
    framing = limits.max_members * per_member + (20 << 10)
    stream = _ChunkStream(_decompressed(fileobj, limits.max_total_bytes, framing))
    written: list[Path] = []
    try:
        _extract_members(TarReader(stream), dest, limits, written)
        missing = [name for name in ADAPTER_FILES if not (dest / name).is_file()]
        if missing:
            raise Invalid(
                f"archive lacks {', '.join(missing)}; it must hold {CONFIG_FILE} and {WEIGHTS_FILE}"
            )
    except BaseException as e:
        for path in written:
            path.unlink(missing_ok=True)
        if isinstance(e, TarTooLarge):
            raise TooLarge(f"archive refused: {e}") from None
        if isinstance(e, TarFormatError | zlib.error | EOFError):
            raise Invalid(f"archive is not a valid tar.gz: {e}") from None
        raise
    return dest


def _extract_members(
    reader: TarReader, dest: Path, limits: ArchiveLimits, written: list[Path]
) -> None:
    total = 0
    top: str | None = None
    for count, member in enumerate(reader.entries(), start=1):
        if count > limits.max_members:
            raise TooLarge(
                f"archive has more than {limits.max_members} members; expected {CONFIG_FILE} and {WEIGHTS_FILE}"
            )
        name = shown(member.name)
        parts = _member_parts(member.name)
        if member.kind == "dir":
            if len(parts) > 1:
                raise Invalid(
                    f"archive member {name}: nested folders are not accepted; files must sit at the top level or in one folder"
                )
            top = _same_folder(member.name, top, parts[0] if parts else None)
            continue
        if member.kind != "file":
            kind = {"symlink": "a symlink", "hard link": "a hard link"}.get(
                member.kind, "a device or fifo" if member.kind in ("device", "fifo") else None
            )
            raise Invalid(
                f"archive member {name} is {kind}; only regular files are accepted"
                if kind
                else f"archive member {name} has unsupported tar {member.kind}; only regular files are accepted"
            )
        filename = parts[-1] if parts else ""
        if filename == PICKLE_WEIGHTS_FILE:
            raise Unacceptable(
                f"archive member {name}: pickle weights are refused; use {WEIGHTS_FILE}"
            )
        if filename not in ADAPTER_FILES or len(parts) > 2:
            raise Invalid(
                f"archive member {name} is not accepted; an archive holds only {CONFIG_FILE} and {WEIGHTS_FILE}, optionally inside one folder"
            )
        top = _same_folder(member.name, top, parts[0] if len(parts) == 2 else "")
        target = dest / filename
        if target.exists():
            raise Invalid(f"archive holds {filename} twice")
        if total + member.size > limits.max_total_bytes:
            raise TooLarge(f"archive contents exceed {limits.max_total_bytes} bytes")
        written.append(target)
        total += _copy_member(reader, target)


def _same_folder(name: str, top: str | None, folder: str | None) -> str | None:
    """The one folder (or "" for the top level) all files share; None until the first."""
    if folder is None or top is None or folder == top:
        return top if folder is None else folder
    raise Invalid(
        f"archive member {shown(name)}: files must sit together at the top level or in one folder"
    )


def _member_parts(name: str) -> tuple[str, ...]:
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise Invalid(
            f"archive member {shown(name)} has an absolute path; only relative names are accepted"
        )
    if "\\" in name:
        raise Invalid(
            f"archive member {shown(name)} contains a backslash; use '/' separated relative names"
        )
    parts = tuple(p for p in PurePosixPath(name).parts if p != ".")
    if ".." in parts:
        raise Invalid(f"archive member {shown(name)} contains '..'; path traversal is refused")
    return parts


def _copy_member(reader: TarReader, target: Path) -> int:
    """The current entry's data into a new file (its size was checked against the limit)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    copied = 0
    with os.fdopen(os.open(target, flags, 0o644), "wb") as out:
        while chunk := reader.read_data(1 << 20):
            copied += len(chunk)
            out.write(chunk)
    return copied
