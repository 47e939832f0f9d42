"""The registry's worker processes (registry/isolation.py): results and refusals cross back,
memory and time are bounded, a bug is reported as one, and the helper outlives a kill."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from loraplex.errors import AdapterRejected, Unacceptable
from loraplex.registry.api_errors import status_code
from loraplex.registry.isolation import WorkerFailed, WorkLimits, run_isolated

LIMITS = WorkLimits(timeout_s=30, memory_bytes=256 << 20)


def run(limits: WorkLimits, fn, *args):
    return asyncio.run(run_isolated(limits, fn, *args))


def test_the_result_comes_from_another_process():
    assert run(LIMITS, os.getpid) != os.getpid()


def test_a_refusal_crosses_back_as_itself():
    with pytest.raises(AdapterRejected) as info:
        run(LIMITS, _refuse)
    assert (status_code(info.value), info.value.message) == (422, "no thanks")


def _refuse() -> None:
    raise Unacceptable("no thanks")


def test_memory_past_the_limit_is_a_413():
    with pytest.raises(AdapterRejected, match="work_memory_bytes") as info:
        run(LIMITS, bytearray, 1 << 30)
    assert status_code(info.value) == 413


def test_time_past_the_limit_kills_the_worker():
    start = time.monotonic()
    with pytest.raises(AdapterRejected, match="took longer than 0.5 s") as info:
        run(WorkLimits(timeout_s=0.5, memory_bytes=256 << 20), time.sleep, 60)
    assert status_code(info.value) == 413 and time.monotonic() - start < 10
    assert run(LIMITS, os.getpid) != os.getpid(), "the helper serves on"


def test_a_bug_in_the_worker_is_not_a_refusal():
    with pytest.raises(WorkerFailed, match="ValueError"):
        run(LIMITS, int, "not a number")
