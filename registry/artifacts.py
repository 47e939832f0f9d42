"""Content-addressed adapter artifacts under one root (a local folder, or a shared volume).

Layout::

    <root>/sha256/<digest>/adapter_config.json
    <root>/sha256/<digest>/adapter_model.safetensors
    <root>/tmp/<random>/            writes in progress, detached artifacts being deleted

An artifact appears under `sha256/` only by a rename of a complete, fsynced folder, so a
reader never sees a partial artifact. etcd records reference an artifact only after it is
complete; what no record references is an orphan that `gc` removes. All methods block on
file I/O: call them from async code through `asyncio.to_thread`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapter_format import ADAPTER_FILES, WEIGHTS_FILE, frame_digest

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    digest: str
    path: str  # relative to the artifact root: "sha256/<digest>"
    created: bool  # False when an identical artifact was already stored (deduplicated)
    weights_sha256: str  # sha256 of adapter_model.safetensors alone (what `sha256sum` prints)


class ArtifactStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._objects = self.root / "sha256"
        self._tmp = self.root / "tmp"
        self._objects.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def relative_path(digest: str) -> str:
        return f"sha256/{_checked(digest)}"

    def path_of(self, relative: str) -> Path:
        """Absolute folder of an artifact named by a record's `artifact` field."""
        kind, _, digest = relative.partition("/")
        if kind != "sha256":
            raise ValueError(f"artifact path {relative!r} must look like 'sha256/<digest>'")
        return self._objects / _checked(digest)

    def exists(self, digest: str) -> bool:
        return (self._objects / _checked(digest)).is_dir()

    def digests(self) -> list[str]:
        return sorted(p.name for p in self._objects.iterdir() if _DIGEST.match(p.name))

    def put_dir(self, src_dir: str | os.PathLike[str]) -> StoredArtifact:
        """Copy the adapter files of `src_dir` in, hashing while copying; reuse an identical
        artifact if one is stored. Atomic: temp folder, fsync, rename."""
        work = self._new_tmp()
        try:
            digest = hashlib.sha256()
            file_digests = {}
            for name in ADAPTER_FILES:
                file_digests[name] = _copy_hashed(Path(src_dir) / name, work / name, name, digest)
            _fsync_dir(work)
            hexdigest = digest.hexdigest()

            def stored(created: bool) -> StoredArtifact:
                path = self.relative_path(hexdigest)
                return StoredArtifact(hexdigest, path, created, file_digests[WEIGHTS_FILE])

            final = self._objects / hexdigest
            if final.is_dir():
                return stored(created=False)
            try:
                os.rename(work, final)
            except OSError:
                if not final.is_dir():
                    raise
                # A concurrent put of the same content won the rename: same bytes, reuse them.
                return stored(created=False)
            _fsync_dir(self._objects)
            return stored(created=True)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)

    def detach(self, digest: str) -> Path | None:
        """Atomically take an artifact out of `sha256/` (readers stop finding it); returns
        where it went, or None if it was absent. `reattach` or `purge` it afterwards."""
        detached = self._tmp / f"detached-{_checked(digest)}-{uuid.uuid4().hex}"
        try:
            os.rename(self._objects / digest, detached)
        except FileNotFoundError:
            return None
        return detached

    def reattach(self, detached: Path, digest: str) -> None:
        """Undo `detach`. If the artifact was stored again meanwhile (same bytes), keep that."""
        try:
            os.rename(detached, self._objects / _checked(digest))
        except OSError:
            if not self.exists(digest):
                raise
            self.purge(detached)

    def purge(self, detached: Path) -> None:
        assert detached.parent == self._tmp, detached
        shutil.rmtree(detached, ignore_errors=True)

    def delete(self, digest: str) -> bool:
        detached = self.detach(digest)
        if detached is not None:
            self.purge(detached)
        return detached is not None

    def orphans(self, referenced: set[str]) -> list[str]:
        """Stored digests that no record references."""
        return [digest for digest in self.digests() if digest not in referenced]

    def gc(self, referenced: set[str], *, min_age_s: float = 3600.0) -> list[str]:
        """Delete unreferenced artifacts and leftover temp folders older than `min_age_s`.

        The age guard spares a registration in flight: its artifact is stored before its etcd
        record commits. (A registration also re-stores its artifact if it finds it gone after
        committing, so a too-eager gc is repaired, not fatal.) Returns what was removed:
        digests and temp folder names."""
        cutoff = time.time() - min_age_s
        removed = []
        for digest in self.orphans(referenced):
            if _mtime(self._objects / digest) <= cutoff and self.delete(digest):
                removed.append(digest)
        for stale in self._tmp.iterdir():
            if _mtime(stale) <= cutoff:
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(f"tmp/{stale.name}")
        return removed

    def _new_tmp(self) -> Path:
        work = self._tmp / uuid.uuid4().hex
        work.mkdir()
        return work


def _checked(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return digest


def _copy_hashed(src: Path, dst: Path, name: str, digest: hashlib._Hash) -> str:
    """Copy `src` to a new file `dst`, feeding `digest` (framed) as it goes; returns the
    file's own sha256."""
    own = hashlib.sha256()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with src.open("rb") as source, os.fdopen(os.open(dst, flags, 0o444), "wb") as out:
        size = os.fstat(source.fileno()).st_size
        frame_digest(digest, name, size)
        copied = 0
        while chunk := source.read(_COPY_CHUNK):
            digest.update(chunk)
            own.update(chunk)
            out.write(chunk)
            copied += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    if copied != size:
        raise OSError(f"{src} changed size while being copied")
    return own.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")
