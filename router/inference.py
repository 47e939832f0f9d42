"""The OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions` and
`GET /v1/models`, in one module-level router whose handlers take the ingress's collaborators
from `app.state.ingress` (router/context.py).

Request path: Bearer key → tenant (from the headers, before the body is read); the tenant's
limits (requests in flight, tokens per minute); the body, read under `max_body_bytes`;
`model` → the base model or one version of one of the caller's adapters (the registry
watcher's snapshot: the version the name points to when the request arrives, or its canary
for the share of request ids the canary takes); the prompt's size; tokenize (on a worker
thread); check the context window and reserve the tokens; `backend.generate` → one JSON
body, or server-sent events (router/generation.py). The request runs to its end on the
version it was resolved to. router/limits.py lists the limits.

Every error these routes answer has OpenAI's body `{"error": {"message", "type", "param",
"code"}}`, in SSE streams too (one error event, then `[DONE]`): 400 for bad parameters (and
prompt + max_tokens over the context), 401 for a missing or unknown key, 403 for the admin
key, 404 `model 'x' does not exist` for an unknown model (another tenant's adapter included:
names never leak), 413 for a body or prompt over its limit, 429 (with Retry-After) for a
tenant over its limits, 500 when the backend fails, 503 (retry) when the replicas failed,
the request was aborted before it finished, or etcd is unreachable.
"""

# No `from __future__ import annotations`: FastAPI resolves the routes' annotations.
import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.errors import RegistryError
from loraplex.replica.protocol import GenerateRequest, ReplicaFailed, adapter_id, sampling_params
from loraplex.replica.tokenizer import ChatTemplateError
from loraplex.router.admission import admit, holding
from loraplex.router.context import Call, Caller, IngressContext
from loraplex.router.generation import (
    EventStream,
    Generation,
    close_stream,
    first_chunk,
    replica_failed,
    whole_response,
)
from loraplex.router.metrics import ANONYMOUS, RequestTimer
from loraplex.router.openai_errors import (
    ErrorResponse,
    OpenAIError,
    invalid_request,
    model_not_found,
    rate_limited,
    registry_error,
)
from loraplex.router.openai_requests import ChatCompletionRequest, CompletionRequest
from loraplex.router.openai_responses import (
    ChatCompletion,
    ChatFormat,
    Completion,
    CompletionFormat,
    ModelCard,
    ModelList,
    ResponseFormat,
)
from loraplex.router.tenant_limiter import OverLimit, RateLimited

log = logging.getLogger(__name__)


class OpenAIRoute(APIRoute):
    """Checks the caller's key and limits and reads the body under its cap before FastAPI
    parses it (router/admission.py); answers every error of its routes with OpenAI's error
    body."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        reads_body = self.body_field is not None

        async def handle(request: Request) -> Response:
            ticket = None
            try:
                ticket = await admit(request, reads_body)
                response = await handler(request)
            except OpenAIError as e:
                response = e.response()
            except RequestValidationError as e:
                response = invalid_request(e.errors()).response()
            except RegistryError as e:
                response = registry_error(e).response()
            except StarletteHTTPException as e:  # FastAPI's: a body that is not UTF-8 JSON
                response = OpenAIError(e.status_code, str(e.detail), headers=e.headers).response()
            except RateLimited as e:
                response = rate_limited(e).response()
            except BaseException:
                if ticket is not None:
                    ticket.release()
                raise
            return holding(response, ticket, request)

        return handle


router = APIRouter(route_class=OpenAIRoute, tags=["OpenAI-compatible"])
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 413, 429, 500, 503)
}


@router.post(
    "/v1/completions", response_model=None, responses={200: {"model": Completion}, **_ERRORS}
)
async def completions(body: CompletionRequest, request: Request, call: Caller) -> Response:
    """Text completion of a prompt (text or token ids); SSE when `stream` is true."""
    arrival = time.monotonic()
    fmt = CompletionFormat(_response_id("cmpl"), int(time.time()), body.model)
    prompt = body.prompt
    if isinstance(prompt, str):
        _check_prompt_bytes(call.ingress, len(prompt.encode()) + body.stop_bytes(), "prompt")
        ids = await asyncio.to_thread(call.ingress.tokenizer.encode, prompt)
    else:
        _check_prompt_bytes(call.ingress, body.stop_bytes(), "stop")
        ids = list(prompt)
    return await _generate(call, body, fmt, ids, body.max_tokens, arrival, request)


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletion}, **_ERRORS},
)
async def chat_completions(body: ChatCompletionRequest, request: Request, call: Caller) -> Response:
    """The assistant's next message, from the model's chat template; SSE when `stream`.
    Without a token limit it may use the rest of the context window."""
    arrival = time.monotonic()
    fmt = ChatFormat(_response_id("chatcmpl"), int(time.time()), body.model)
    ingress = call.ingress
    tokenizer = ingress.tokenizer
    if not tokenizer.has_chat_template:
        message = f"model {ingress.base_model_id!r} has no chat template; use /v1/completions"
        raise OpenAIError(400, message)
    limit = ingress.limits.max_messages
    if len(body.messages) > limit:
        message = f"{len(body.messages)} messages; at most {limit} (limits.max_messages)"
        raise OpenAIError(400, message, param="messages")
    messages = [m.for_template() for m in body.messages]
    text_bytes = sum(len(m["content"].encode()) for m in messages) + body.stop_bytes()
    _check_prompt_bytes(ingress, text_bytes, "messages")
    try:
        as_text = ingress.limits.special_tokens_in_messages == "text"
        ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, True, as_text)
    except ChatTemplateError as e:
        raise OpenAIError(400, str(e), param="messages") from None
    max_tokens = body.max_new_tokens or _default_max_tokens(ingress, len(ids), request)
    return await _generate(call, body, fmt, ids, max_tokens, arrival, request)


def _default_max_tokens(ingress: IngressContext, prompt_tokens: int, request: Request) -> int:
    """Without a token limit: the rest of the context window, and no more than the tenant's
    tokens per minute leave beside the prompt (at least 1: a prompt over it is refused)."""
    most = ingress.max_model_len - prompt_tokens
    ticket = getattr(request.state, "ticket", None)
    if ticket is not None and ticket.tokens_per_minute is not None:
        most = min(most, max(1, ticket.tokens_per_minute - prompt_tokens))
    return most


@router.get("/v1/models", responses={401: _ERRORS[401]})
async def models(call: Caller) -> ModelList:
    """The base model and the caller's adapters."""
    ingress, tenant = call.ingress, call.tenant
    base_id, started = ingress.base_model_id, ingress.started
    cards = [ModelCard(id=base_id, created=started, owned_by="loraplex", root=base_id)]
    registry = ingress.registry
    if registry is not None and tenant is not None:
        records = await registry.view.adapters(tenant)
        cards += [
            ModelCard(id=r.name, created=started, owned_by=tenant, root=base_id, parent=base_id)
            for r in records
            if r.name != base_id
        ]
    return ModelList(data=cards)


# ---------------------------------------------------------------- one generation


def _response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _resolve(
    ingress: IngressContext, model: str, tenant: str | None, request_id: str
) -> tuple[str | None, int | None]:
    """The adapter version to run `model` with (None: the base model), and the registry
    revision it was resolved at."""
    if model == ingress.base_model_id:
        return None, None
    registry = ingress.registry
    if registry is not None and tenant is not None:
        record = await registry.view.adapter(tenant, model)
        if record is not None:
            version = record.version_for(request_id)
            return adapter_id(tenant, model, version), record.updated_revision
    raise model_not_found(model)


def _check_prompt_bytes(ingress: IngressContext, size: int, param: str) -> None:
    """Before tokenizing: a prompt past max_prompt_bytes is refused unread."""
    limit = ingress.limits.max_prompt_bytes
    if size > limit:
        message = (
            f"the prompt (with its stop strings) is {size} bytes of text; at most {limit} "
            "(limits.max_prompt_bytes)"
        )
        raise OpenAIError(413, message, param=param)


def _check_context(max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
    window = f"this model's context window is {max_model_len} tokens"
    if prompt_tokens >= max_model_len:
        message = f"{window}; the prompt alone has {prompt_tokens} tokens"
    elif prompt_tokens + max_tokens > max_model_len:
        message = (
            f"{window}; the prompt has {prompt_tokens} tokens and max_tokens is "
            f"{max_tokens} ({prompt_tokens + max_tokens} in all)"
        )
    else:
        return
    raise OpenAIError(400, message, code="context_length_exceeded", param="max_tokens")


async def _generate(
    call: Call,
    body: CompletionRequest | ChatCompletionRequest,
    fmt: ResponseFormat,
    ids: list[int],
    max_tokens: int,
    arrival: float,
    request: Request,
) -> Response:
    ingress, tenant = call.ingress, call.tenant
    adapter, revision = await _resolve(ingress, body.model, tenant, fmt.id)
    if not ids:
        raise OpenAIError(400, "the prompt is empty", param="prompt")
    _check_context(ingress.max_model_len, len(ids), max_tokens)
    params = body.sampling_fields(max_tokens)
    call = GenerateRequest(
        request_id=fmt.id, prompt_token_ids=ids, adapter=adapter, params=params, tenant=tenant
    )
    if revision is not None:
        call["adapter_revision"] = revision
    try:
        sampling_params(call)
    except ValueError as e:
        raise OpenAIError(400, str(e)) from None
    ticket = getattr(request.state, "ticket", None)
    if ticket is not None:
        try:
            await ticket.reserve(len(ids) + max_tokens)  # RateLimited: over its tokens per minute
        except OverLimit as e:
            raise OpenAIError(
                400, e.message, code="tokens_per_minute", param="max_tokens"
            ) from None
    metrics = ingress.metrics
    tenant_label = tenant or ANONYMOUS
    metrics.tenant_requests.labels(tenant_label).inc()
    metrics.prompt_tokens.labels(tenant_label).inc(len(ids))
    timer = RequestTimer(metrics, tenant_label, arrival)
    gen = Generation(fmt, timer, len(ids), body.include_usage)
    request.state.generation = gen  # the tokens it used go back to its ticket
    chunks = ingress.backend.generate(call)
    try:
        first = await first_chunk(chunks, gen)
    except BaseException:
        await close_stream(chunks)
        timer.done()
        raise
    if body.stream:
        return EventStream(gen, first, chunks)
    try:
        return await whole_response(gen, first, chunks, request)
    except OpenAIError:
        raise
    except ReplicaFailed as e:
        raise replica_failed(e) from None
    except Exception as e:
        log.exception("request %s failed", fmt.id)
        raise OpenAIError(500, f"generation failed: {e!r}") from None
    finally:
        await close_stream(chunks)
        timer.done()
