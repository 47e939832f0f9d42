"""The ingress's operator routes: `/health` and `/metrics` (Prometheus).

`/metrics` shows every tenant's name and token counts, so it answers only the bearer of the
metrics key or the admin key (401 otherwise); an ingress with neither
(no registry: the base model for anyone) serves it to anyone, and its only tenant label is
`anonymous`."""

# No `from __future__ import annotations`: FastAPI resolves the routes' annotations.
import hmac

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from loraplex.errors import RegistryError, Unauthenticated
from loraplex.registry.api_errors import error_response
from loraplex.registry.auth import bearer_token, hash_api_key
from loraplex.router.context import Ingress

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        401: {"description": "No key, or not the metrics key (nor the admin key)."},
    },
)
async def prometheus_metrics(request: Request, ingress: Ingress) -> Response:
    """Prometheus text format: this ingress's request figures (per tenant), and each
    replica's stats as the replicas report them now. Needs the metrics key (or the admin
    key) as a bearer token."""
    try:
        _check_metrics_key(ingress.metrics_keys, request.headers.get("authorization"))
    except RegistryError as e:
        return error_response(e)
    ingress.metrics.set_replicas(await ingress.backend.replica_stats(), ingress.backend.resumed)
    return Response(ingress.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _check_metrics_key(digests: frozenset[str], authorization: str | None) -> None:
    if not digests:
        return
    digest = hash_api_key(bearer_token(authorization))  # Unauthenticated without a key
    # every digest compared, in constant time: timing tells nothing of which key matched
    matches = [hmac.compare_digest(digest, d) for d in sorted(digests)]
    if not any(matches):
        raise Unauthenticated("/metrics needs the metrics key (or the admin key)")
