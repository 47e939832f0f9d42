"""Peak resident memory of another process while something happens (Linux /proc): the
kernel's own high-water mark (VmHWM), reset first through clear_refs, so a peak between
two samples is not missed; where the reset is not allowed, samples of VmRSS every 2 ms."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(f"/proc/{pid}/status has no {field}")


def rss_mib(pid: int) -> float:
    return _status_kib(pid, "VmRSS") / 1024


def _reset_peak(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak RSS
    except OSError:
        return False
    return _status_kib(pid, "VmHWM") <= _status_kib(pid, "VmRSS") + 1024


@dataclass
class Growth:
    baseline_mib: float = 0.0
    peak_mib: float = 0.0

    @property
    def mib(self) -> float:
        return self.peak_mib - self.baseline_mib


@contextmanager
def peak_growth(pid: int) -> Iterator[Growth]:
    """How far the process's resident memory rose above where it was at the start."""
    growth = Growth(baseline_mib=rss_mib(pid))
    if _reset_peak(pid):
        yield growth
        growth.peak_mib = _status_kib(pid, "VmHWM") / 1024
        return
    stop = threading.Event()
    samples = [growth.baseline_mib]

    def sample() -> None:
        while not stop.is_set():
            samples.append(rss_mib(pid))
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield growth
    finally:
        stop.set()
        thread.join()
        growth.peak_mib = max(samples)
