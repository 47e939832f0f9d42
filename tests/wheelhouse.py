"""A wheel cache made from this Python's installed distributions, so that `pip install`
on `ray up`'s nodes finds Ray, torch and the rest on disk instead of downloading them
again (this machine's pip keeps no HTTP cache).

Each distribution a requirement needs (extras and markers followed through the installed
metadata) is packed back into a wheel from the files its RECORD lists: the package files
as they are, scripts that are not entry points under `.data/scripts`, other files outside
site-packages under `.data/data`. Entries are stored, not compressed: the nodes read them
from this disk.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as metadata
import io
import re
import sys
import sysconfig
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

_SKIPPED_INFO = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions `requirements` need, by canonical name; LookupError
    naming a requirement nothing installed satisfies."""
    found: dict[str, metadata.Distribution] = {}
    extras: dict[str, set[str]] = {}
    pending = [Requirement(r) for r in requirements]
    while pending:
        requirement = pending.pop()
        name = canonical(requirement.name)
        wanted = set(requirement.extras) | {""}
        if name in found and wanted <= extras[name]:
            continue
        try:
            dist = found.get(name) or metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise LookupError(f"{requirement} is not installed in {sys.prefix}") from None
        if not requirement.specifier.contains(dist.version, prereleases=True):
            raise LookupError(f"{requirement} is wanted, {sys.prefix} has {name} {dist.version}")
        found[name] = dist
        extras[name] = extras.get(name, set()) | wanted
        for line in dist.requires or []:
            needed = Requirement(line)
            if needed.marker is None or any(
                needed.marker.evaluate({"extra": extra}) for extra in extras[name]
            ):
                pending.append(needed)
    return found


def repack(dist: metadata.Distribution, dest: Path) -> Path:
    """`dist` as a wheel in `dest`, from its installed files."""
    site = Path(dist.locate_file(""))
    prefix = Path(sysconfig.get_paths()["data"])
    scripts = {
        ep.name for ep in dist.entry_points if ep.group in ("console_scripts", "gui_scripts")
    }
    info = next(f for f in dist.files if f.parent.name.endswith(".dist-info")).parent.name
    wheel_info = (site / info / "WHEEL").read_text()
    tags = [
        line.split(":", 1)[1].strip().split("-")
        for line in wheel_info.splitlines()
        if line.startswith("Tag:")
    ]
    tag = "-".join(".".join(dict.fromkeys(part[i] for part in tags)) for i in range(3))
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    data = f"{name}-{dist.version}.data"
    path = dest / f"{name}-{dist.version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for file in dist.files:
            source = (site / file).resolve()
            if "__pycache__" in file.parts or not source.is_file():
                continue
            if file.parts[0] == info:
                if file.name in _SKIPPED_INFO:
                    continue
                target = str(file.as_posix())
            elif file.parts[0] != "..":
                target = file.as_posix()
            else:
                outside = source.relative_to(prefix)
                if outside.parts[0] == "bin":
                    if outside.name in scripts:
                        continue  # pip writes entry points anew
                    target = f"{data}/scripts/{outside.name}"
                else:
                    target = f"{data}/data/{outside.as_posix()}"
            content = source.read_bytes()
            entry = zipfile.ZipInfo(target, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = (source.stat().st_mode & 0xFFFF) << 16  # keeps +x
            wheel.writestr(entry, content)
            digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=")
            record.append((target, f"sha256={digest.decode()}", str(len(content))))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*record, (f"{info}/RECORD", "", "")])
        wheel.writestr(f"{info}/RECORD", text.getvalue())
    return path


def build(requirements: list[str], dest: Path) -> list[Path]:
    """Wheels for `requirements` and all they need, from what this Python has installed."""
    dest.mkdir(parents=True, exist_ok=True)
    return [repack(dist, dest) for dist in closure(requirements).values()]
