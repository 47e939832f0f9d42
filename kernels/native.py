"""The compiled CPU loops, one library: LoRA's shrink and expand (lora_cpu.c,
lora_native.py), decode attention over the paged pool (attention_cpu.c,
attention_native.py) and the step's small ops (small_ops_cpu.c, small_ops_native.py).

It is built on first use with the C compiler at hand (`$CC`, else cc or gcc:
`-O3 -march=native`, OpenMP where torch's runtime is GNU's, whose team it then shares)
into the cache folder, keyed by the sources, the flags, the compiler and the CPU, and
checked once against the torch references. Without a compiler, or where a check fails,
`library()` is None and `kernels: auto` keeps the torch path (`unavailable()` says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from loraplex.cache import cache_dir
from loraplex.kernels import attention_native, lora_native, small_ops_native

log = logging.getLogger(__name__)

# each source's module declares its functions' argument types and checks them
PARTS = (
    ("lora_cpu.c", lora_native),
    ("attention_cpu.c", attention_native),
    ("small_ops_cpu.c", small_ops_native),
)
SOURCES = tuple(Path(__file__).with_name(name) for name, _ in PARTS)
HEADERS = (Path(__file__).with_name("cpu_math.h"),)  # included by the sources
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
_why_not: list[str] = []


def unavailable() -> str | None:
    """Why `library()` is None (None when it loaded)."""
    library()
    return _why_not[0] if _why_not else None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled loops, built on first use; None (logged once) where they cannot be."""
    try:
        lib = ctypes.CDLL(str(_build()))
        for _, part in PARTS:
            part.declare(lib)
        for _, part in PARTS:
            part.check(lib)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why_not.append(str(e))
        log.warning("the compiled CPU loops are unavailable, torch ops instead: %s", e)
        return None
    return lib


def compiler() -> str | None:
    """The C compiler the library is built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compiler() -> str:
    cc = compiler()
    if not cc:
        raise RuntimeError("no C compiler (set $CC, or install gcc)")
    return cc


def _openmp_flag() -> str:
    """-fopenmp where this process runs GNU's OpenMP (torch's wheels ship it): the library
    then shares its runtime and its threads. With another runtime a second one would
    oversubscribe the cores (replica/cpu_threads.py), so the loops run on one thread."""
    maps = Path("/proc/self/maps")
    gnu = maps.exists() and "/libgomp" in maps.read_text()
    return "-fopenmp" if gnu else "-fopenmp-simd"


def _build() -> Path:
    cc = _compiler()
    flags = (*FLAGS, _openmp_flag())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(flags).encode()):
        key.update(part)
    key.update(version.stdout.encode())
    key.update(_cpu().encode())
    out = cache_dir() / "native" / f"cpu_loops-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # built beside, then renamed: processes building at once each load a whole file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, *map(str, SOURCES)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared between
    machines must not hand one CPU another's instructions)."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        lines = info.read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    return platform.processor() or platform.machine()
