"""Large request bodies parsed in a child process (loraplex/json_process.py): the same
value and the same refusals as `strict_json.loads`, arrays capped, nothing parsed by the
caller's interpreter, and a child that dies replaced without losing the body."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from loraplex import json_process, strict_json
from loraplex.json_process import JsonProcess, TooManyItems

CAP = 4096
WHY = " (the context window)"


def _run(coro_fn):
    async def main():
        parser = JsonProcess(CAP, WHY)
        try:
            return await coro_fn(parser)
        finally:
            await parser.close()

    return asyncio.run(main())


def test_a_body_parses_to_the_value_strict_json_gives():
    body = {
        "model": "m",
        "prompt": list(range(CAP)),
        "messages": [{"role": "user", "content": "naïve café 🚀 \u00e9" * 200}] * 3,
        "stop": ["\n", "END"],
        "x": {"nested": [[1, 2.5, None, True, "s"]]},
    }
    data = json.dumps(body).encode()

    async def parse(parser):
        return await parser.loads(data)

    assert _run(parse) == strict_json.loads(data) == body


def test_the_refusals_are_strict_jsons_and_an_over_long_array_names_its_place():
    cases = {
        b'{"a": NaN}': (strict_json.NotStrictJSON, "NaN"),
        b'{"a": 1, "a": 2}': (strict_json.NotStrictJSON, "duplicate key"),
        b'{"prompt": [1, 99999999999999999999999]}': (strict_json.NotStrictJSON, "64-bit"),
        b"{not json": (json.JSONDecodeError, ""),
        b"[" * 100_000 + b"]" * 100_000: (RecursionError, ""),
    }
    ids = json.dumps({"model": "m", "prompt": [7] * 2_000_000}).encode()  # ~6 MiB

    async def refusals(parser):
        seen = {}
        for data, (kind, text) in cases.items():
            with pytest.raises(kind) as e:
                await parser.loads(data)
            seen[data[:20]] = str(e.value)
            assert text in str(e.value)
        with pytest.raises(TooManyItems) as e:
            await parser.loads(ids)
        return seen, e.value

    seen, too_many = _run(refusals)
    assert too_many.path == ("prompt",) and too_many.count == 2_000_000
    assert str(too_many) == f"prompt: an array of 2000000 items; at most {CAP}{WHY}"
    assert seen[b'{"prompt": [1, 99999'].startswith("prompt.1: ")


def test_the_callers_interpreter_never_parses_a_body(monkeypatch: pytest.MonkeyPatch):
    """The parse runs in the child: with the parent's parser broken, bodies still parse
    (json.loads holds the GIL, so a thread in the caller would hold its event loop)."""
    data = json.dumps({"prompt": list(range(CAP))}).encode()

    def broken(*_):
        raise AssertionError("parsed in the caller's process")

    monkeypatch.setattr(strict_json, "loads", broken)
    monkeypatch.setattr(json_process, "loads_capped", broken)

    async def parse(parser):
        values = [await parser.loads(data) for _ in range(3)]
        return values, parser.pid

    values, pid = _run(parse)
    assert all(v == {"prompt": list(range(CAP))} for v in values) and pid is not None


def test_a_child_that_dies_is_replaced_and_its_body_still_parsed():
    data = json.dumps({"prompt": [1, 2, 3]}).encode()

    async def parse(parser):
        first = await parser.loads(data)
        old = parser.pid
        os.kill(old, signal.SIGKILL)
        while parser.pid is not None:  # reaped
            await asyncio.sleep(0.01)
        second = await parser.loads(data)  # a new child, or the thread if it died mid-way
        third = await parser.loads(data)
        return first, second, third, old, parser.pid

    first, second, third, old_pid, new_pid = _run(parse)
    assert first == second == third == {"prompt": [1, 2, 3]}
    assert new_pid != old_pid


def test_bodies_from_concurrent_requests_each_get_their_own_value():
    bodies = [json.dumps({"i": i, "prompt": [i] * 3000}).encode() for i in range(6)]

    async def parse(parser):
        return await asyncio.gather(*(parser.loads(b) for b in bodies))

    values = _run(parse)
    assert [v["i"] for v in values] == list(range(6))
    assert all(v["prompt"] == [v["i"]] * 3000 for v in values)


def test_a_child_that_cannot_parse_leaves_the_body_to_a_thread(monkeypatch: pytest.MonkeyPatch):
    """A child that exits at once (here: not Python at all) is a failed pipe, not a failed
    request: the body is parsed on the thread, refusals included."""
    monkeypatch.setattr(json_process.sys, "executable", "/bin/true")
    data = json.dumps({"prompt": [1, 2, 3]}).encode()

    async def parse(parser):
        value = await parser.loads(data)
        with pytest.raises(TooManyItems):
            await parser.loads(json.dumps({"prompt": [0] * (CAP + 1)}).encode())
        return value

    assert _run(parse) == {"prompt": [1, 2, 3]}
