"""A request body read under a cap, for routes that check their caller's key first: the
caller's `Content-Length` is refused at once when it exceeds the cap, and a body sent without
one (chunked) stops being read as soon as it passes the cap, so memory stays bounded by the
cap whatever a client sends. FastAPI reads a declared body before it solves dependencies;
a route class calls `read_capped` in its `handle` (after the key check) and the handler then
parses the bytes kept on the request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from loraplex import strict_json
from loraplex.errors import Invalid, TimedOut, TooLarge
from loraplex.json_process import JsonProcess

# Bodies past this are parsed off the event loop (a child process, or a worker thread).
_PARSE_ON_LOOP_BYTES = 64 << 10


def check_declared_length(request: Request, max_bytes: int, setting: str) -> None:
    """TooLarge when the request's Content-Length exceeds `max_bytes` (nothing is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(
            f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes ({setting})"
        )


@dataclass(frozen=True)
class BodyTimeouts:
    """How long a body may pause between bytes (`idle_s`) and take in all (`total_s`)."""

    idle_s: float
    total_s: float


async def receive(request: Request, timeouts: BodyTimeouts | None) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; TimedOut when it pauses longer than
    `timeouts.idle_s` or lasts longer than `timeouts.total_s`. A stalled body would otherwise
    hold its upload slot and staging bytes for as long as the client keeps it open."""
    if timeouts is None:
        async for chunk in request.stream():
            yield chunk
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeouts.total_s
    chunks = aiter(request.stream())
    while True:
        left = deadline - loop.time()
        wait = min(timeouts.idle_s, left)
        try:
            chunk = await asyncio.wait_for(anext(chunks), max(wait, 0.0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            if wait < timeouts.idle_s:
                raise TimedOut(
                    f"request body still arriving after {timeouts.total_s:g} s (body_timeout_s)"
                ) from None
            raise TimedOut(
                f"request body paused for {timeouts.idle_s:g} s (body_idle_timeout_s)"
            ) from None
        yield chunk


async def read_capped(
    request: Request,
    max_bytes: int,
    setting: str,
    timeouts: BodyTimeouts | None = None,
    parser: JsonProcess | None = None,
) -> bytes:
    """The whole body, at most `max_bytes` of it (TooLarge past that, naming `setting`), kept
    on the request so that `request.body()` (FastAPI's body parsing) returns it; TimedOut
    past `timeouts`. `parser`: where a JSON body over 64 KiB is parsed (else a thread)."""
    check_declared_length(request, max_bytes, setting)
    body = bytearray()
    async for chunk in receive(request, timeouts):
        body += chunk
        if len(body) > max_bytes:
            raise TooLarge(f"request body exceeds the limit of {max_bytes} bytes ({setting})")
    data = bytes(body)
    request._body = data  # Starlette's cache of the body: body() and stream() return it
    if _is_json(request.headers.get("content-type")):
        await parse_json(request, data, parser)
    return data


async def parse_json(request: Request, data: bytes, parser: JsonProcess | None = None) -> None:
    """Parse `data` as standard JSON (`loraplex.strict_json`) into Starlette's cache, which
    FastAPI's body parsing reads: Invalid for NaN, Infinity, numbers out of range, duplicate
    keys, lone surrogates, or (with `parser`) an array longer than it allows. Text that is
    not JSON at all is left for FastAPI to refuse."""
    try:
        if len(data) > _PARSE_ON_LOOP_BYTES and parser is not None:
            value = await parser.loads(data)
        elif len(data) > _PARSE_ON_LOOP_BYTES:
            value = await asyncio.to_thread(strict_json.loads, data)
        else:
            value = strict_json.loads(data)
    except strict_json.NotStrictJSON as e:
        field = e.path[0] if e.path and isinstance(e.path[0], str) else None
        raise Invalid(str(e), field) from None
    except RecursionError:
        raise Invalid("request body: JSON nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return
    request._json = value


def _is_json(content_type: str | None) -> bool:
    """FastAPI parses a body as JSON without a content type, or with any .../json or +json."""
    if not content_type:
        return True
    subtype = content_type.split(";")[0].strip().lower().partition("/")[2]
    return subtype == "json" or subtype.endswith("+json")
