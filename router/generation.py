"""One generation's response: the first chunk (where the backend's refusals become HTTP
errors), then one JSON body or server-sent events, and the backend's stream closed however
the response ends, which aborts the request in the engine."""

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.replica.protocol import AdapterNotFound, GenerateChunk, ReplicaFailed
from loraplex.router.metrics import RequestTimer
from loraplex.router.openai_errors import OpenAIError, model_not_found
from loraplex.router.openai_responses import SSE_DONE, ResponseFormat, Usage, sse

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Generation:
    """What the response side needs of one request."""

    fmt: ResponseFormat
    timer: RequestTimer
    prompt_tokens: int
    include_usage: bool

    def saw(self, chunk: GenerateChunk) -> None:
        self.timer.saw(len(chunk["new_token_ids"]), chunk["num_output_tokens"])

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.timer.completion_tokens)


async def first_chunk(chunks: AsyncIterator[GenerateChunk], gen: Generation) -> GenerateChunk:
    """The first chunk; the backend's refusals (raised before any output) become HTTP errors."""
    try:
        chunk = await anext(chunks)
    except AdapterNotFound:
        raise model_not_found(gen.fmt.model) from None
    except ValueError as e:  # the engine's RequestError: the request cannot be served as given
        raise OpenAIError(400, str(e)) from None
    except StopAsyncIteration:
        raise OpenAIError(500, "the replica ended the request without output") from None
    except ReplicaFailed as e:  # on every try: a transient state of the cluster
        raise replica_failed(e) from None
    except TimeoutError:  # the backend's first-chunk bound: no replica served it in time
        raise OpenAIError(
            503, "no replica produced the first token in time; retry", headers={"Retry-After": "5"}
        ) from None
    except Exception as e:
        log.exception("request %s failed", gen.fmt.id)
        raise OpenAIError(500, f"generation failed: {e!r}") from None
    if chunk["finished"] and chunk["finish_reason"] == "error":
        raise _failed(chunk)
    return chunk


async def close_stream(stream: AsyncIterator[Any]) -> None:
    """Close a stream now, even inside a cancelled task. Closing the backend's stream aborts
    the request (an async generator's `finally` runs); other iterators have nothing to close."""
    if isinstance(stream, AsyncGenerator):
        with anyio.CancelScope(shield=True):
            await stream.aclose()


def _aborted() -> OpenAIError:
    return OpenAIError(
        503,
        "the request was aborted before it finished (its adapter was removed, or the replica "
        "is stopping); retry",
    )


def _failed(chunk: GenerateChunk) -> OpenAIError:
    """This request failed in the engine (its adapter's load, sampling, ...); the replica and
    its other requests go on."""
    return OpenAIError(500, chunk.get("error") or "generation failed for this request")


def _ending(chunk: GenerateChunk) -> OpenAIError | None:
    """The error a last chunk stands for, or None if the request finished normally."""
    if chunk["finish_reason"] == "abort":
        return _aborted()
    if chunk["finish_reason"] == "error":
        return _failed(chunk)
    return None


def replica_failed(e: ReplicaFailed) -> OpenAIError:
    return OpenAIError(503, f"{e}; retry", headers={"Retry-After": "1"})


def _cut_short() -> OpenAIError:
    return OpenAIError(500, "the replica ended the stream before the request finished")


async def whole_response(
    gen: Generation, first: GenerateChunk, chunks: AsyncIterator[GenerateChunk], request: Request
) -> Response:
    text: list[str] = []
    chunk: GenerateChunk | None = first
    while chunk is not None:
        gen.saw(chunk)
        text.append(chunk["new_text"])
        if chunk["finished"]:
            if (error := _ending(chunk)) is not None:
                raise error
            body = gen.fmt.whole("".join(text), chunk["finish_reason"], gen.usage())
            return JSONResponse(body.model_dump())
        if await request.is_disconnected():  # nobody will read the answer: stop generating
            return Response(status_code=499)
        chunk = await anext(chunks, None)
    raise _cut_short()


async def _events(
    gen: Generation, first: GenerateChunk, chunks: AsyncIterator[GenerateChunk]
) -> AsyncGenerator[str, None]:
    """The SSE body. An error after the first event becomes one error event, then [DONE]."""
    fmt = gen.fmt
    try:
        for head in fmt.head():
            yield sse(head)
        chunk: GenerateChunk | None = first
        while chunk is not None:
            gen.saw(chunk)
            if chunk["new_text"]:
                yield sse(fmt.piece(chunk["new_text"]))
            if chunk["finished"]:
                if (error := _ending(chunk)) is not None:
                    raise error
                yield sse(fmt.finish(chunk["finish_reason"]))
                if gen.include_usage:
                    yield sse(fmt.usage(gen.usage()))
                break
            chunk = await anext(chunks, None)
        else:
            raise _cut_short()
    except OpenAIError as e:
        yield sse(e.body())
    except ReplicaFailed as e:
        yield sse(replica_failed(e).body())
    except Exception as e:
        log.exception("request %s failed mid-stream", fmt.id)
        yield sse(OpenAIError(500, f"generation failed: {e!r}").body())
    yield SSE_DONE


class EventStream(StreamingResponse):
    """SSE that closes its event generator and the backend's stream however the response
    ends (finished, client gone, cancelled, or never started), so the request is aborted at
    once rather than whenever the garbage collector finds the generators."""

    media_type = "text/event-stream"

    def __init__(
        self, gen: Generation, first: GenerateChunk, chunks: AsyncIterator[GenerateChunk]
    ) -> None:
        self._events = _events(gen, first, chunks)
        self._chunks, self._timer = chunks, gen.timer
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._events, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_stream(self._events)
            await close_stream(self._chunks)
            self._timer.done()
