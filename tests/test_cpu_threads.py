"""Helper threads run torch's CPU ops serially, so that the engine's thread keeps the
process's OpenMP threads to itself (replica/cpu_threads.py says why: past one OpenMP
thread per CPU, GNU OpenMP wakes team threads through the kernel and every small op of a
step slows 2.6-5x).

Each case runs in a fresh interpreter with 2 intra-op threads: OpenMP teams, once made,
last as long as their thread, and the suite's own process runs with one thread.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

COMMON = """
import json, os, torch
torch.set_num_threads(2)
big = torch.randn(1 << 20)
big.add(1)  # the main thread's team (one more OpenMP thread)

def os_threads():
    return len(os.listdir("/proc/self/task"))
"""


def run(script: str, *args: str) -> dict:
    code = COMMON + textwrap.dedent(script)
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_thread_after_serial_torch_ops_adds_no_openmp_thread_and_leaves_the_others():
    """The control first: a plain thread's parallel-sized op adds a team thread (what slowed
    the engine); after serial_torch_ops the same op adds none, and the main thread still
    splits its ops over 2."""
    seen = run("""
        import threading, time
        from loraplex.replica.cpu_threads import serial_torch_ops

        alone = os_threads()  # the main thread and its team's

        def op_in_a_thread(serial):
            out = {}
            def body():
                if serial:
                    serial_torch_ops()
                out["threads"] = torch.get_num_threads()
                # a thread joined earlier can still be listed for a moment (seen under
                # load: counted here and gone by the count after, it read as 0 added)
                deadline = time.monotonic() + 10
                while os_threads() > alone + 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                before = os_threads()
                out["sum"] = float((big * 2).sum())
                out["added"] = os_threads() - before
            t = threading.Thread(target=body)
            t.start()
            t.join()
            return out

        # the serial case first: once the plain thread has ended, its team's thread exits
        # when it will, and counted during the serial op it read as -1 (CI, 2026-12-05)
        serial = op_in_a_thread(True)
        print(json.dumps({
            "serial": serial,
            "plain": op_in_a_thread(False),
            "main": torch.get_num_threads(),
            "expected_sum": float((big * 2).sum()),
        }))
    """)
    assert seen["plain"]["threads"] == 2 and seen["plain"]["added"] == 1, seen
    assert seen["serial"]["threads"] == 1 and seen["serial"]["added"] == 0, seen
    assert seen["main"] == 2, seen
    assert abs(seen["serial"]["sum"] - seen["expected_sum"]) < 1e-3 * abs(seen["expected_sum"])


def test_the_adapter_copy_and_read_threads_run_serially():
    seen = run("""
        from loraplex.replica.memory.transfer import CopyThread

        transfer = CopyThread(torch.device("cpu"))
        threads = {}
        out = torch.empty_like(big)
        transfer.submit("copy", 0, lambda: threads.update(copy=torch.get_num_threads()))
        transfer.submit("read", 0, lambda: threads.update(read=torch.get_num_threads()), False)
        transfer.wait(10)
        transfer.done()
        before = os_threads()
        transfer.submit("big", out.nbytes, lambda: out.copy_(big * 2))
        transfer.done()
        print(json.dumps(threads | {
            "added": os_threads() - before, "equal": bool(torch.equal(out, big * 2))
        }))
    """)
    assert seen == {"copy": 1, "read": 1, "added": 0, "equal": True}


def test_the_async_engine_is_built_on_its_stepping_thread_and_reads_adapters_serially(
    tmp_path: Path,
):
    """Built on the caller's thread (a worker of asyncio.to_thread in the Serve replica), the
    checkpoint's parallel ops left a second team behind for the replica's life."""
    seen = run(
        """
        import asyncio, sys, threading
        from pathlib import Path
        from loraplex.demo.synthetic import make_synthetic_assets
        from loraplex.replica import async_engine
        from loraplex.replica.config import EngineConfig

        assets = make_synthetic_assets(Path(sys.argv[1]))
        seen = {}

        class Spy(async_engine.LLMEngine):
            def __init__(self, cfg):
                seen["built_on"] = threading.current_thread().name
                super().__init__(cfg)

            def read_adapter(self, name, path):
                seen["read_threads"] = torch.get_num_threads()
                return super().read_adapter(name, path)

        async_engine.LLMEngine = Spy
        engine = async_engine.Engine(
            EngineConfig(model=str(assets.model), page_bytes=64 << 10, pool_bytes=512 << 16)
        )
        try:
            name = assets.adapter_names[0]
            asyncio.run(engine.add_adapter(name, assets.adapters_dir / name))
            seen["flushes_denormals"] = engine.flushes_denormals
        finally:
            engine.shutdown()
        print(json.dumps(seen))
        """,
        str(tmp_path),
    )
    assert seen == {"built_on": "loraplex-engine", "read_threads": 1, "flushes_denormals": True}


def test_a_thread_that_flushes_denormals_first_flushes_them_in_its_parallel_ops_too():
    """A float32 op on 2^18 denormal values (1e-39 x 2), split over the two threads of the
    calling thread's team. The main thread's team started before it flushed (COMMON): its
    own half is flushed, its worker's is not, and flush_denormals says so. A fresh thread
    that flushes first starts its team after: nothing is left."""
    out = run(
        """
        import threading
        from loraplex.replica.cpu_threads import flush_denormals

        probe = torch.full((1 << 18,), 1e-39)
        plain = int(torch.count_nonzero(probe * 2))
        late = flush_denormals()
        late_left = int(torch.count_nonzero(probe * 2))
        seen = {}

        def fresh():
            seen["first"] = flush_denormals()
            seen["first_left"] = int(torch.count_nonzero(probe * 2))

        thread = threading.Thread(target=fresh)
        thread.start()
        thread.join()
        print(json.dumps({"plain": plain, "late": late, "late_left": late_left, **seen}))
        """
    )
    assert out["plain"] == 1 << 18
    assert out["late"] is False and 0 < out["late_left"] < 1 << 18, out
    assert out["first"] is True and out["first_left"] == 0, out
