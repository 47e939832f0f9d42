"""The registry's domain errors at the HTTP edge: one status code per kind (the ingress gives
the same codes OpenAI's body), the headers that go with it, and the tenant API's body
`{"detail": message}` (FastAPI's own shape, so its 415 and 422 read alike)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from loraplex.errors import (
    Busy,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    RegistryError,
    RegistryUnavailable,
    StagingFull,
    TimedOut,
    TooLarge,
    TooManyUploads,
    Unacceptable,
    Unauthenticated,
)

log = logging.getLogger(__name__)

_STATUS: dict[type[RegistryError], int] = {
    Invalid: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    TimedOut: 408,
    Conflict: 409,
    TooLarge: 413,
    Unacceptable: 422,
    TooManyUploads: 429,
    StagingFull: 503,
    RegistryUnavailable: 503,
}

_DESCRIPTIONS: dict[int | str, str] = {
    400: "Unreadable input: bad JSON, corrupt safetensors header or archive, forbidden path.",
    401: "Missing or unknown API key.",
    403: "A key of the wrong kind for this route.",
    405: "Method not allowed; `Allow` lists the path's methods.",
    408: "The request body paused longer than body_idle_timeout_s, or took longer than "
    "body_timeout_s in all: nothing was written.",
    404: "No such tenant or adapter (another tenant's adapter is reported the same way).",
    409: "Name taken, or the tenant's adapter quota is reached.",
    413: "Over a size limit (upload, adapter, header, archive).",
    415: "Neither multipart/form-data nor application/json.",
    422: "Adapter not accepted: rank, targets, tensor names or shapes, dtype, options.",
    429: "The tenant has max_uploads_per_tenant registrations in flight; retry after "
    "`Retry-After` seconds.",
    503: "etcd unreachable, or the staging space in use by other uploads: nothing was "
    "written; retry after `Retry-After` seconds.",
}


def status_code(error: RegistryError) -> int:
    """The HTTP status of a domain error: that of its class, or of the nearest base listed."""
    for kind in type(error).__mro__:
        if kind in _STATUS:
            return _STATUS[kind]
    raise AssertionError(f"{type(error).__name__} has no HTTP status")


def error_headers(error: RegistryError) -> dict[str, str] | None:
    if isinstance(error, Unauthenticated):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(error, RegistryUnavailable | Busy):
        return {"Retry-After": str(error.retry_after_s)}
    return None


def error_response(error: RegistryError) -> JSONResponse:
    """The tenant API's answer to a domain error."""
    message = error.message
    if isinstance(error, RegistryUnavailable):
        log.warning("registry unavailable: %s", error)  # the endpoint is the operator's
        message = "registry unavailable, nothing was changed; retry later"
    return JSONResponse({"detail": message}, status_code(error), headers=error_headers(error))


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of a route that may answer `codes`."""
    return {code: {"description": _DESCRIPTIONS[code]} for code in codes}


class RegistryRoute(APIRoute):
    """Answers the registry's domain errors, raised by a route or its dependencies, with the
    tenant API's body, wherever the router is mounted; and 405 with every method of the path
    in `Allow` (Starlette names only the methods of the first route it found for the path).
    `admit` runs before FastAPI reads and parses a declared body (and before the
    dependencies): the place for checks that must come first."""

    async def admit(self, request: Request) -> None:
        """Nothing here; a subclass checks what must pass before the body is read."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.methods and scope["method"] not in self.methods:
            allow = ", ".join(path_methods(scope, self.path_format))
            response = JSONResponse(
                {"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": allow}
            )
            await response(scope, receive, send)
            return
        await super().handle(scope, receive, send)

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                await self.admit(request)
                return await handler(request)
            except RegistryError as e:
                return error_response(e)

        return handle


def path_methods(scope: Scope, path_format: str) -> list[str]:
    """The methods of every route of the app serving `scope` at `path_format`."""
    routes = scope["app"].router.routes if "app" in scope else []
    methods = {
        method
        for route in routes
        if isinstance(route, APIRoute) and route.path_format == path_format
        for method in route.methods or ()
    }
    return sorted(methods)
