"""A reader for the tar format that reads each header's size before it reads the header, so
that no header can cost more than its cap in memory or time.

Python's `tarfile` reads a PAX or GNU long-name header whole, whatever size it declares, and
before CPython 3.11.10 / 3.12.6 parses PAX headers with a regex that is quadratic in their
size (CVE-2024-6232: a 297-byte tar.gz froze the process for 37 s). An adapter archive holds
two regular files, so this reader knows only what real writers put around such files: POSIX
ustar headers, PAX extended headers (`x`, and `g` which is skipped), GNU long names (`L`,
`K`). Everything else is reported as what it is, for the caller to refuse.

Layout of a 512-byte header (POSIX.1-2001 ustar; GNU tar differs only past `magic`)::

    name[100] mode[8] uid[8] gid[8] size[12] mtime[12] chksum[8] typeflag[1]
    linkname[100] magic[6] version[2] uname[32] gname[32] devmajor[8] devminor[8]
    prefix[155] pad[12]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

BLOCK = 512
MAX_EXTENDED_HEADER_BYTES = 64 << 10  # one PAX record set: a path, times, ids, a few xattrs
MAX_LONG_NAME_BYTES = 4 << 10  # PATH_MAX
EXTENDED_HEADERS_PER_ENTRY = 4  # g, x, L, K at most before one entry

_KINDS = {
    b"0": "file",
    b"\0": "file",
    b"7": "file",  # contiguous file: a regular file to every reader
    b"5": "dir",
    b"1": "hard link",
    b"2": "symlink",
    b"3": "device",
    b"4": "device",
    b"6": "fifo",
}


class TarFormatError(ValueError):
    """The bytes are not a tar archive this reader accepts (message says why)."""


class TarTooLarge(ValueError):
    """A header declares more bytes than its cap."""


class Readable(Protocol):
    def read(self, size: int) -> bytes: ...


@dataclass(frozen=True, slots=True)
class TarEntry:
    name: str  # as written (PAX path or GNU long name when present); undecodable bytes escaped
    kind: str  # file, dir, hard link, symlink, device, fifo, or "type X" for anything else
    size: int  # bytes of data that follow the header


class TarReader:
    """`entries()` yields each entry after its headers; read its data with `read_data` (all
    of it, or the rest is skipped before the next header)."""

    def __init__(self, stream: Readable) -> None:
        self._stream = stream
        self._unread = 0  # data bytes of the current entry not yet read
        self._padding = 0

    def entries(self) -> Iterator[TarEntry]:
        while True:
            self._skip_rest()
            entry = self._next_entry()
            if entry is None:
                return
            self._unread, self._padding = entry.size, -entry.size % BLOCK
            yield entry

    def read_data(self, size: int) -> bytes:
        """Up to `size` bytes of the current entry's data; b"" at its end."""
        data = self._exact(min(size, self._unread), "an entry's data")
        self._unread -= len(data)
        return data

    def _skip_rest(self) -> None:
        while self._unread:
            self.read_data(1 << 20)
        if self._padding:
            self._exact(self._padding, "padding")
            self._padding = 0

    def _next_entry(self) -> TarEntry | None:
        path: str | None = None
        size: int | None = None
        for _ in range(EXTENDED_HEADERS_PER_ENTRY + 1):
            block = self._exact(BLOCK, "a header", end_ok=True)
            if not block or block == bytes(BLOCK):
                return None  # end of archive (two zero blocks, or none: lenient like tar)
            _check_checksum(block)
            typeflag, declared = block[156:157], _number(block[124:136], "size")
            if typeflag in (b"x", b"g"):
                records = self._extended(declared, MAX_EXTENDED_HEADER_BYTES, "PAX header")
                if typeflag == b"x":
                    fields = _pax_records(records)
                    path = fields.get("path", path)
                    if "size" in fields:
                        size = _decimal(fields["size"], "PAX size")
                continue
            if typeflag in (b"L", b"K"):
                data = self._extended(declared, MAX_LONG_NAME_BYTES, "GNU long-name header")
                if typeflag == b"L":
                    path = _text(data.split(b"\0", 1)[0])
                continue
            kind = _KINDS.get(typeflag, f"type {typeflag.decode('latin-1')!r}")
            name = path if path is not None else _header_name(block)
            return TarEntry(name, kind, size if size is not None else declared)
        raise TarFormatError(
            f"more than {EXTENDED_HEADERS_PER_ENTRY} extended headers before one entry"
        )

    def _extended(self, declared: int, cap: int, what: str) -> bytes:
        if declared > cap:
            raise TarTooLarge(f"a {what} of {declared} bytes exceeds the limit of {cap}")
        data = self._exact(declared, what)
        self._exact(-declared % BLOCK, "padding")
        return data

    def _exact(self, n: int, what: str, *, end_ok: bool = False) -> bytes:
        data = self._stream.read(n) if n else b""
        if len(data) != n and not (end_ok and not data):
            raise TarFormatError(f"archive ends inside {what}")
        return data


def _check_checksum(block: bytes) -> None:
    stored = _number(block[148:156], "checksum")
    unsigned = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
    signed = unsigned - 2 * sum(b for b in block[:148] + block[156:] if b > 127)
    if stored not in (unsigned, signed):
        raise TarFormatError("a header's checksum does not match (not a tar archive?)")


def _number(field: bytes, what: str) -> int:
    """An octal field, or GNU's base-256 (first byte 0x80, big-endian after it)."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    if not all(48 <= b <= 55 for b in digits):
        raise TarFormatError(f"a header's {what} field is not an octal number")
    return int(digits, 8)


def _decimal(text: str, what: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise TarFormatError(f"{what} {text[:20]!r} is not a decimal number")
    return int(text)


def _header_name(block: bytes) -> str:
    name = block[0:100].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\0":  # POSIX: a prefix extends the name (GNU uses the bytes)
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return _text(name)


def _pax_records(data: bytes) -> dict[str, str]:
    """`"%d %s=%s\\n" % (length, keyword, value)` records, parsed in one linear pass."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 21)
        length_text = data[pos:space] if space > pos else b""
        if not length_text.isdigit():
            raise TarFormatError("a PAX record does not start with its length")
        end = pos + int(length_text)
        record = data[space + 1 : end]
        if end > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise TarFormatError("a PAX record is malformed")
        keyword, _, value = record[:-1].partition(b"=")
        fields[_text(keyword)] = _text(value)
        pos = end
    return fields


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")
