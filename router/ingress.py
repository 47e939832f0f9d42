"""The HTTP ingress: OpenAI-compatible inference over any `Backend`, `/v1/models`, the
registry's tenant API, `/metrics` and `/health`, in one FastAPI app.

Request path: Bearer key → tenant; `model` → the base model or one of the caller's adapters
(the registry watcher's snapshot); tokenize; check the context window; `backend.generate`
→ one JSON body, or server-sent events.

Inference routes answer 400 for bad parameters (and prompt + max_tokens over the context),
401 for a missing or unknown key, 403 for the admin key, 404 `model 'x' does not exist` for
an unknown model (another tenant's adapter included: names never leak), 500 when the backend
fails, 503 (retry) when the replicas failed, the request was aborted before it finished, or
etcd is unreachable. Their errors have OpenAI's body `{"error": {"message", "type", "param",
"code"}}`, in SSE streams too (one error event, then `[DONE]`); the mounted tenant API keeps
its own bodies.

A request ends in the backend as soon as its client is gone: closing the backend's stream
aborts it (for streams whatever way the response ends, for whole answers between chunks).
"""

# No `from __future__ import annotations`: FastAPI resolves the routes' annotations, and some
# are local names.
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from loraplex.registry.api import RegistryAPISettings, resolve_adapter, tenant_api
from loraplex.registry.artifacts import ArtifactStore
from loraplex.registry.auth import Authenticator
from loraplex.registry.store import RegistryStore, RegistryUnavailable
from loraplex.registry.watch import RegistryWatcher
from loraplex.replica.protocol import (
    Backend,
    GenerateRequest,
    ReplicaFailed,
    adapter_id,
    sampling_params,
)
from loraplex.replica.tokenizer import ChatTemplateError, Tokenizer
from loraplex.router.generation import (
    EventStream,
    Generation,
    close_stream,
    first_chunk,
    replica_failed,
    whole_response,
)
from loraplex.router.metrics import (
    ANONYMOUS,
    HTTPMetricsMiddleware,
    IngressMetrics,
    RequestTimer,
    RoutingSource,
)
from loraplex.router.openai_api import (
    ChatCompletion,
    ChatCompletionRequest,
    ChatFormat,
    Completion,
    CompletionFormat,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    ResponseFormat,
    invalid_request,
    model_not_found,
)

log = logging.getLogger(__name__)

__all__ = ["RegistryHandles", "build_ingress"]


@dataclass(frozen=True, slots=True)
class RegistryHandles:
    """The registry objects the ingress reads and its tenant API writes. The app owns their
    lifecycle: it starts the watcher at startup and stops watcher and store at shutdown, so
    pass them unstarted (etcd clients belong to the event loop that serves the app)."""

    store: RegistryStore
    watcher: RegistryWatcher | None  # None: every lookup reads etcd
    artifacts: ArtifactStore
    settings: RegistryAPISettings


_HTTP_CODES = {401: "invalid_api_key", 403: "permission_denied"}


class _OpenAIRoute(APIRoute):
    """Answers every error of its routes with OpenAI's error body."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as e:
                return e.response()
            except RequestValidationError as e:
                return invalid_request(e.errors()).response()
            except HTTPException as e:  # from the Authenticator
                code = _HTTP_CODES.get(e.status_code)
                error = OpenAIError(e.status_code, str(e.detail), code=code, headers=e.headers)
                return error.response()
            except RegistryUnavailable as e:
                message = f"registry unavailable; retry later ({e})"
                return OpenAIError(503, message, headers={"Retry-After": "5"}).response()

        return handle


# ---------------------------------------------------------------- the app


def build_ingress(
    backend: Backend,
    tokenizer: Tokenizer,
    *,
    base_model_id: str,
    max_model_len: int,
    registry: RegistryHandles | None,
    routing: RoutingSource | None = None,
) -> FastAPI:
    """The ingress app; `app.state.metrics` is its `IngressMetrics`. Without a registry,
    anyone may use the base model (no key needed) and there is no tenant API. An adapter
    named like the base model is shadowed by it. `routing`: the router's view of each
    adapter's rate and homes, for /metrics."""
    metrics = IngressMetrics(routing)
    auth = None
    if registry is not None:
        admin_key = registry.settings.admin_key.get_secret_value()
        auth = Authenticator(admin_key, registry.store, registry.watcher)
    started = int(time.time())

    async def caller(request: Request) -> str | None:
        """The tenant of the request's key; None when serving without a registry."""
        return None if auth is None else (await auth.require_tenant(request)).name

    Caller = Annotated[str | None, Depends(caller)]

    async def resolve(model: str, tenant: str | None) -> str | None:
        """The adapter id to run `model` with (None: the base model)."""
        if model == base_model_id:
            return None
        if registry is not None and tenant is not None:
            record = await resolve_adapter(registry.watcher or registry.store, tenant, model)
            if record is not None:
                return adapter_id(tenant, model)
        raise model_not_found(model)

    def check_context(prompt_tokens: int, max_tokens: int) -> None:
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

    async def generate(
        body: CompletionRequest | ChatCompletionRequest,
        fmt: ResponseFormat,
        ids: list[int],
        max_tokens: int,
        tenant: str | None,
        arrival: float,
        request: Request,
    ) -> Response:
        adapter = await resolve(body.model, tenant)
        if not ids:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        check_context(len(ids), max_tokens)
        params = body.sampling_fields(max_tokens)
        call = GenerateRequest(
            request_id=fmt.id, prompt_token_ids=ids, adapter=adapter, params=params
        )
        try:
            sampling_params(call)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        tenant_label = tenant or ANONYMOUS
        metrics.tenant_requests.labels(tenant_label).inc()
        metrics.prompt_tokens.labels(tenant_label).inc(len(ids))
        timer = RequestTimer(metrics, tenant_label, arrival)
        gen = Generation(fmt, timer, len(ids), body.include_usage)
        chunks = backend.generate(call)
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

    def response_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    openai = APIRouter(route_class=_OpenAIRoute, tags=["OpenAI-compatible"])
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 500, 503)
    }

    @openai.post(
        "/v1/completions", response_model=None, responses={200: {"model": Completion}, **errors}
    )
    async def completions(body: CompletionRequest, request: Request, tenant: Caller) -> Response:
        """Text completion of a prompt (text or token ids); SSE when `stream` is true."""
        arrival = time.monotonic()
        fmt = CompletionFormat(response_id("cmpl"), int(time.time()), body.model)
        prompt = body.prompt
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await generate(body, fmt, ids, body.max_tokens, tenant, arrival, request)

    @openai.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletion}, **errors},
    )
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, tenant: Caller
    ) -> Response:
        """The assistant's next message, from the model's chat template; SSE when `stream`.
        Without a token limit it may use the rest of the context window."""
        arrival = time.monotonic()
        fmt = ChatFormat(response_id("chatcmpl"), int(time.time()), body.model)
        if not tokenizer.has_chat_template:
            message = f"model {base_model_id!r} has no chat template; use /v1/completions"
            raise OpenAIError(400, message)
        try:
            ids = tokenizer.apply_chat_template([m.for_template() for m in body.messages])
        except ChatTemplateError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        max_tokens = body.max_new_tokens or max_model_len - len(ids)
        return await generate(body, fmt, ids, max_tokens, tenant, arrival, request)

    @openai.get("/v1/models", responses={401: errors[401]})
    async def models(tenant: Caller) -> ModelList:
        """The base model and the caller's adapters."""
        base = ModelCard(id=base_model_id, created=started, owned_by="loraplex", root=base_model_id)
        cards = [base]
        if registry is not None and tenant is not None:
            if registry.watcher is not None:
                records = registry.watcher.adapters(tenant)
            else:
                records = await registry.store.list_adapters(tenant)
            cards += [
                ModelCard(
                    id=r.name,
                    created=started,
                    owned_by=tenant,
                    root=base_model_id,
                    parent=base_model_id,
                )
                for r in records
                if r.name != base_model_id
            ]
        return ModelList(data=cards)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = registry.watcher if registry is not None else None
        if watcher is not None:
            await watcher.start()
        try:
            yield
        finally:
            if registry is not None:
                if watcher is not None:
                    await watcher.stop()
                await registry.store.close()

    app = FastAPI(
        title="loraplex",
        summary="OpenAI-compatible serving of one base model and many tenants' LoRA adapters.",
        version="1",
        lifespan=lifespan,
    )
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    app.include_router(openai)
    if registry is not None:
        r = registry
        app.include_router(tenant_api(r.store, r.watcher, r.artifacts, r.settings))

    @app.get("/health", tags=["operations"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["operations"], response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    return app
