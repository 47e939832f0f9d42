"""The registry's domain errors at the HTTP edge: one status code per kind (the ingress gives
the same codes OpenAI's body), the headers that go with it, and the tenant API's body
`{"detail": message}` (FastAPI's own shape, so its 415 and 422 read alike)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from loraplex.registry.errors import (
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    RegistryError,
    RegistryUnavailable,
    TooLarge,
    Unacceptable,
    Unauthenticated,
)

_STATUS: dict[type[RegistryError], int] = {
    Invalid: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    Unacceptable: 422,
    RegistryUnavailable: 503,
}

_DESCRIPTIONS: dict[int | str, str] = {
    400: "Unreadable input: bad JSON, corrupt safetensors header or archive, forbidden path.",
    401: "Missing or unknown API key.",
    403: "A key of the wrong kind for this route.",
    404: "No such tenant or adapter (another tenant's adapter is reported the same way).",
    409: "Name taken, or the tenant's adapter quota is reached.",
    413: "Over a size limit (upload, adapter, header, archive).",
    415: "Neither multipart/form-data nor application/json.",
    422: "Adapter not accepted: rank, targets, tensor names or shapes, dtype, options.",
    503: "etcd unreachable: the write was not made; retry.",
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
    if isinstance(error, RegistryUnavailable):
        return {"Retry-After": str(error.retry_after_s)}
    return None


def error_response(error: RegistryError) -> JSONResponse:
    """The tenant API's answer to a domain error."""
    message = error.message
    if isinstance(error, RegistryUnavailable):
        message = f"registry unavailable, nothing was changed; retry later ({error})"
    return JSONResponse({"detail": message}, status_code(error), headers=error_headers(error))


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of a route that may answer `codes`."""
    return {code: {"description": _DESCRIPTIONS[code]} for code in codes}


class RegistryRoute(APIRoute):
    """Answers the registry's domain errors, raised by a route or its dependencies, with the
    tenant API's body, wherever the router is mounted."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RegistryError as e:
                return error_response(e)

        return handle
