"""ServeBackend's calls on a deployment handle (router/serve_backend.py), on a stand-in
handle that records them: which streams it cancels. What Serve does with a call is tested
on a real local Ray in tests/test_serve_replica.py."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import RayActorError

from loraplex.replica.protocol import GenerateChunk, GenerateRequest
from loraplex.router.serve_backend import ServeBackend


class RecordedStream:
    def __init__(self, chunks: list[GenerateChunk], dies: bool = False):
        """dies: the replica dies after the chunks (a dead actor's error, as Ray raises)."""
        self.chunks = chunks
        self.dies = dies
        self.cancelled = False

    def __aiter__(self):
        return self._items()

    async def _items(self):
        for chunk in self.chunks:
            yield chunk
        if self.dies:
            raise RayActorError()

    def cancel(self) -> None:
        self.cancelled = True


class RecordingHandle:
    """`options(...).generate.remote(call)` answers each call with the next stream."""

    def __init__(self, streams: list[RecordedStream]):
        self.streams = streams
        self.generate = self

    def options(self, **_: Any) -> RecordingHandle:
        return self

    def remote(self, _call: GenerateRequest) -> RecordedStream:
        return self.streams.pop(0)


def chunk(ids: list[int], finished: bool) -> GenerateChunk:
    return GenerateChunk(
        request_id="r",
        new_token_ids=ids,
        new_text="x" * len(ids),
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=len(ids),
    )


def request() -> GenerateRequest:
    return GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], adapter=None, params={"max_tokens": 4}
    )


async def read(backend: ServeBackend, stop_after: int | None) -> list[GenerateChunk]:
    """The chunks a caller reads, closing the stream after `stop_after` of them (the ingress
    stops reading at the finished chunk, as `_events` does)."""
    out = []
    stream = backend.generate(request())
    async for c in stream:
        out.append(c)
        if c["finished"] or len(out) == stop_after:
            break
    await stream.aclose()
    return out


def test_a_stream_read_to_its_last_chunk_is_not_cancelled_one_left_early_is():
    done = RecordedStream([chunk([1, 2], False), chunk([3, 4], True)])
    left = RecordedStream([chunk([1, 2], False), chunk([3, 4], True)])
    backend = ServeBackend(RecordingHandle([done, left]))  # type: ignore[arg-type]

    assert [c["finished"] for c in asyncio.run(read(backend, None))] == [False, True]
    assert not done.cancelled  # over at the replica: nothing to abort

    assert len(asyncio.run(read(backend, 1))) == 1
    assert left.cancelled  # the caller went away mid-stream: the replica must stop


def test_a_stream_resumed_twice_counts_once_among_the_streams_resumed():
    """Its replica dies mid-stream, and the resume lands on the dead replica again (routers
    still count it in for a moment): the client gets every token once, and `resumed`, the
    ingress's count of streams resumed (its metric and the kill tests' bound), counts the
    stream once. It counted each try: a fresh-clone CI run read 5 resumed of the 3 streams
    the killed replica held."""
    first = RecordedStream([chunk([1, 2], False)], dies=True)
    dead_again = RecordedStream([], dies=True)
    rest = RecordedStream([chunk([3, 4], True)])
    backend = ServeBackend(RecordingHandle([first, dead_again, rest]))  # type: ignore[arg-type]

    chunks = asyncio.run(read(backend, None))
    assert [i for c in chunks for i in c["new_token_ids"]] == [1, 2, 3, 4]
    assert backend.resumed == 1
