"""A request body read under a cap, for routes that check their caller's key first: the
caller's `Content-Length` is refused at once when it exceeds the cap, and a body sent without
one (chunked) stops being read as soon as it passes the cap, so memory stays bounded by the
cap whatever a client sends. FastAPI reads a declared body before it solves dependencies;
a route class calls `read_capped` in its `handle` (after the key check) and the handler then
parses the bytes kept on the request."""

from __future__ import annotations

from starlette.requests import Request

from loraplex.registry.errors import TooLarge


def check_declared_length(request: Request, max_bytes: int, setting: str) -> None:
    """TooLarge when the request's Content-Length exceeds `max_bytes` (nothing is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise TooLarge(
            f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes ({setting})"
        )


async def read_capped(request: Request, max_bytes: int, setting: str) -> bytes:
    """The whole body, at most `max_bytes` of it (TooLarge past that, naming `setting`), kept
    on the request so that `request.body()` (FastAPI's body parsing) returns it."""
    check_declared_length(request, max_bytes, setting)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise TooLarge(f"request body exceeds the limit of {max_bytes} bytes ({setting})")
    data = bytes(body)
    request._body = data  # Starlette's cache of the body: body() and stream() return it
    return data
