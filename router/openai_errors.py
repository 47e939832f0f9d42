"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: every error of the
inference routes answers with it, as the response before any output was sent, or as one SSE
event after."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from loraplex.adapter_format import shown
from loraplex.errors import Invalid, RegistryError, RegistryUnavailable
from loraplex.registry.api_errors import error_headers, status_code
from loraplex.router.tenant_limiter import RateLimited

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What the OpenAI client expects of a non-2xx answer, and of an SSE error event."""

    error: ErrorDetail


class OpenAIError(Exception):
    """An error answered with OpenAI's body: as the response (before any output was sent) or
    as one SSE event (after)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers

    def body(self) -> ErrorResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        detail = ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorResponse(error=detail)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), self.status, headers=self.headers)


def model_not_found(model: str) -> OpenAIError:
    """The one answer for a name that is not the caller's: unknown, deleted, or another
    tenant's adapter all read the same, so names never leak across tenants."""
    return OpenAIError(
        404, f"model {shown(model)} does not exist", code="model_not_found", param="model"
    )


def invalid_request(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """One 400 from pydantic's errors of a request body, naming up to three problems:
    `temperature: Input should be greater than or equal to 0`."""
    problems, params = [], []
    for error in errors:
        loc = [str(part) for part in error["loc"][1:]]  # drop "body"
        if error["type"] == "json_invalid":
            return OpenAIError(400, f"the body is not valid JSON: {error['ctx']['error']}")
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "this parameter is not supported by this server"
        problems.append(f"{'.'.join(loc)}: {message}" if loc else message)
        params.append(loc[0] if loc else None)
    if not problems:
        return OpenAIError(400, "invalid request")
    code = "unsupported_parameter" if "not supported" in problems[0] else "invalid_value"
    return OpenAIError(400, "; ".join(problems[:3]), code=code, param=params[0])


def rate_limited(e: RateLimited) -> OpenAIError:
    """429, as OpenAI answers a client over its rate limits; 503 when the limits could not
    be checked (the tenant ledger did not answer). Either way with Retry-After."""
    headers = {"Retry-After": str(e.retry_after_s)}
    code = "rate_limit_exceeded" if e.status == 429 else "service_unavailable"
    return OpenAIError(e.status, e.message, code=code, headers=headers)


_REGISTRY_CODES = {401: "invalid_api_key", 403: "permission_denied"}


def registry_error(e: RegistryError) -> OpenAIError:
    """A registry refusal (the caller's key, etcd) with the registry's status code."""
    message = e.message
    if isinstance(e, RegistryUnavailable):
        log.warning("registry unavailable: %s", e)  # the endpoint is the operator's
        message = "registry unavailable; retry later"
    status = status_code(e)
    param = e.field if isinstance(e, Invalid) else None
    return OpenAIError(
        status, message, code=_REGISTRY_CODES.get(status), param=param, headers=error_headers(e)
    )
