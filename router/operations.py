"""The ingress's operator routes: `/health` and `/metrics` (Prometheus)."""

# No `from __future__ import annotations`: FastAPI resolves the routes' annotations.
from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from loraplex.router.context import Ingress

router = APIRouter(tags=["operations"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(ingress: Ingress) -> Response:
    """Prometheus text format: this ingress's request figures, and each replica's stats as
    the replicas report them now."""
    ingress.metrics.set_replicas(await ingress.backend.replica_stats(), ingress.backend.resumed)
    return Response(ingress.metrics.render(), media_type=CONTENT_TYPE_LATEST)
