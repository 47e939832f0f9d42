"""Registration by path: copy a PEFT folder that lies under an allowed root into staging.

Rule: tenant T may register only from `<allowed root>/T/` — its own subtree of each root —
so that no tenant can register another's files by guessing their path. The subtree's own
folder belongs to the operator and may be a link; below it, every component is opened
relative to the descriptor of its parent with O_NOFOLLOW, and a symlink met on the way is
read and followed by this code, never by the kernel, and only while it stays inside the
subtree (Hugging Face caches link snapshot files to blobs in the same cache). The files are
then read from the descriptors opened, so a link swapped in after a check changes nothing:
there is no second lookup by name. The caller runs this in a worker process (blocking I/O).
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from pathlib import Path

from loraplex.adapter_format import ADAPTER_FILES, PICKLE_WEIGHTS_FILE, WEIGHTS_FILE, shown
from loraplex.errors import Invalid, TooLarge, Unacceptable

_MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup
_COPY_CHUNK = 1 << 20


def copy_from_path(path: str, roots: list[str], tenant: str, dest: Path, max_bytes: int) -> None:
    """Copy the PEFT folder `path` (in `tenant`'s subtree of one of `roots`) to `dest`.
    Copying first means the bytes validated are the bytes stored."""
    subtree, parts = _tenant_subtree(path, roots, tenant)
    try:
        folder = subtree.open(parts, directory=True)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ELOOP):
            raise Invalid(f"path {shown(path)} cannot be opened: {e.strerror}") from None
        raise Invalid(
            f"path {shown(path)} is not a folder; expected a PEFT adapter folder"
        ) from None
    os.close(folder)
    opened: dict[str, int] = {}
    try:
        for name in (*ADAPTER_FILES, PICKLE_WEIGHTS_FILE):
            try:
                opened[name] = subtree.open([*parts, name], directory=False)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise Invalid(f"{name} in {shown(path)} cannot be opened ({e.strerror})") from None
            if not stat.S_ISREG(os.fstat(opened[name]).st_mode):
                raise Invalid(f"{name} in {shown(path)} is not a regular file")
        if WEIGHTS_FILE not in opened and PICKLE_WEIGHTS_FILE in opened:
            raise Unacceptable(
                f"{PICKLE_WEIGHTS_FILE} (pickle) is refused; save the adapter with safetensors ({WEIGHTS_FILE})",
            )
        present = {name: fd for name, fd in opened.items() if name in ADAPTER_FILES}
        size = sum(os.fstat(fd).st_size for fd in present.values())
        if size > max_bytes:
            raise TooLarge(f"adapter is {size} bytes; the limit is {max_bytes} (max_adapter_bytes)")
        dest.mkdir()
        for name, fd in present.items():
            _copy(fd, dest / name, max_bytes)
    finally:
        for fd in opened.values():
            os.close(fd)


def _tenant_subtree(path: str, roots: list[str], tenant: str) -> tuple[_Subtree, list[str]]:
    """The subtree of `tenant` that `path` names, and the components of `path` below it."""
    if not roots:
        raise Invalid(
            "registration by path is disabled: the server has no allowed_roots configured"
        )
    if not path or "\x00" in path or not path.startswith("/"):
        raise Invalid(f"path {shown(path)} must be an absolute path")
    components = path.split("/")[1:]
    for root in roots:
        for spelling in dict.fromkeys((os.path.abspath(root), os.path.realpath(root))):
            prefix = [*spelling.split("/")[1:], tenant]
            if prefix[0] == "":  # the root is "/"
                prefix = prefix[1:]
            if components[: len(prefix)] == prefix:
                try:
                    subtree = _Subtree(os.path.join(spelling, tenant))
                except OSError:
                    continue
                return subtree, components[len(prefix) :]
    raise Invalid(
        f"path {shown(path)} is not in your folder of an allowed root: tenant {tenant!r} may "
        f"register only from <allowed root>/{tenant}/ (ask the operator for the allowed roots)"
    )


class _Subtree:
    """A folder that lookups below it cannot leave, symlinks included."""

    def __init__(self, folder: str) -> None:
        self.real = os.path.realpath(folder)
        fd = os.open(self.real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.close(fd)

    def open(self, parts: list[str], *, directory: bool) -> int:
        """A descriptor of `parts` below the folder (O_RDONLY, non-blocking, so a fifo cannot
        hang the reader); OSError if it does not exist or leads outside."""
        floor = os.open(self.real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        stack = [floor]
        pending = deque(parts)
        links = 0
        try:
            while pending:
                part = pending.popleft()
                if part in ("", "."):
                    continue
                if part == "..":
                    if len(stack) == 1:
                        raise OSError(errno.EXDEV, "it leads outside the tenant's folder")
                    os.close(stack.pop())
                    continue
                last = not pending
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                if directory or not last:
                    flags |= os.O_DIRECTORY
                try:
                    stack.append(os.open(part, flags, dir_fd=stack[-1]))
                    continue
                except OSError as e:
                    target = _link_target(part, stack[-1])
                    if target is None:
                        raise e from None
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many symbolic links")
                if target.startswith("/"):
                    below = _below(target, self.real)
                    if below is None:
                        raise OSError(errno.EXDEV, "a link in it leads outside the tenant's folder")
                    while len(stack) > 1:
                        os.close(stack.pop())
                    target = below
                pending.extendleft(reversed(target.split("/")))
            return stack.pop()
        finally:
            for fd in stack:
                os.close(fd)


def _link_target(name: str, dir_fd: int) -> str | None:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None


def _below(target: str, folder: str) -> str | None:
    """`target` relative to `folder` if it lies inside it (lexically), else None."""
    if target == folder:
        return "."
    if target.startswith(folder.rstrip("/") + "/"):
        return target[len(folder.rstrip("/")) + 1 :]
    return None


def _copy(fd: int, target: Path, max_bytes: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    copied = 0
    with (
        os.fdopen(os.dup(fd), "rb") as source,
        os.fdopen(os.open(target, flags, 0o644), "wb") as out,
    ):
        while chunk := source.read(_COPY_CHUNK):
            copied += len(chunk)
            if copied > max_bytes:  # the file grew after it was measured
                raise TooLarge(f"adapter exceeds {max_bytes} bytes (max_adapter_bytes)")
            out.write(chunk)
