"""common/startup_gc.py: a serving process's start-up objects frozen once, later garbage
still collected."""

import subprocess
import sys
import textwrap


def test_start_up_objects_are_frozen_and_garbage_made_after_is_still_collected():
    # In a fresh interpreter: frozen, this test session's own garbage would never be collected.
    code = textwrap.dedent(
        """
        import gc, weakref
        import torch  # what a replica imports before it starts serving
        from loraplex.startup_gc import freeze_startup_objects

        class Node:
            pass

        frozen = freeze_startup_objects()
        node = Node()
        node.self = node  # a reference cycle: only the collector frees it
        ref = weakref.ref(node)
        del node
        gc.collect()
        print(frozen, gc.get_freeze_count() == frozen, ref() is None)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert int(out[0]) > 10_000  # torch's and the interpreter's objects, out of every collection
    assert out[1] == "True"  # a full collection after start-up leaves them frozen
    assert out[2] == "True"  # and still frees a cycle made after start-up
