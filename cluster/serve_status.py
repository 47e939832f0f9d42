"""What Ray reports about the cluster and the app: the nodes alive, deployment states,
failed deployments' errors, each replica's routing stats (adapters per tier, queue, pool
pages) and the router's busiest adapters with their homes, for `loraplex status`."""

from __future__ import annotations

import logging
import re
from typing import Any

from loraplex.cluster.config import APP_NAME

REPLICA_DEPLOYMENT = "replica"


def status_text(value: Any) -> str:
    """A Serve status (an enum in some Ray versions, a string in others) as its name."""
    return str(getattr(value, "value", value))


def deployment_errors() -> str:
    """The last line of each failed deployment's message (its replica's exception)."""
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return ""
    found = []
    for name, dep in app.deployments.items():
        lines = [line.strip() for line in (dep.message or "").splitlines() if line.strip()]
        if lines and status_text(dep.status) != "HEALTHY":
            found.append(f"{name}: {lines[-1]}")
    return "; ".join(found)


_VERSION = re.compile(r"@([0-9a-f]{12})[0-9a-f]{52}\b")


def short_ids(text: str) -> str:
    """`text` with each 64-hex version id cut to its first 12 hex digits, as git shows a
    commit (`acme/sql@9c0d3e5b9c0d`); `loraplex status --full-ids` shows them whole."""
    return _VERSION.sub(r"@\1", text)


def serve_report(ray_address: str, full_ids: bool = False) -> list[str]:
    """Deployments and their replicas; per replica, its routing stats (adapters per tier,
    queue, pool pages), read from each replica actor; version ids cut (`short_ids`)
    unless `full_ids`."""
    import ray
    from ray import serve

    ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        lines = [node_line(ray.nodes())]
        app = serve.status().applications.get(APP_NAME)
        if app is None:
            return [*lines, f"serve:    application {APP_NAME!r} not deployed"]
        lines.append(
            f"app:      {APP_NAME} {status_text(app.status)}"
            + (f" ({app.message})" if app.message else "")
        )
        for name, dep in app.deployments.items():
            counts = ", ".join(
                f"{n} {status_text(s).lower()}" for s, n in dep.replica_states.items()
            )
            message = f"  {dep.message}" if dep.message else ""
            lines.append(f"  {name:<10} {status_text(dep.status):<10} {counts}{message}")
        lines = lines if full_ids else [short_ids(line) for line in lines]
        return lines + replica_table(ray, full_ids)
    finally:
        ray.shutdown()


def node_line(nodes: list[dict]) -> str:
    """The Ray nodes alive, by address, the head marked."""
    alive = sorted(
        node["NodeManagerAddress"]
        + (" (head)" if "node:__internal_head__" in node.get("Resources", {}) else "")
        for node in nodes
        if node.get("Alive")
    )
    return f"nodes:    {len(alive)} alive: {', '.join(alive)}"


def replica_table(ray, full_ids: bool = False) -> list[str]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#"
    names = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(prefix)
    )
    rows = [("replica", "queue", "pages free/total", "device", "host", "loading")]
    for name in names:
        try:
            stats = ray.get(
                ray.get_actor(name, namespace="serve").record_routing_stats.remote(), timeout=10
            )
        except Exception as e:
            rows.append(
                (name.removeprefix(prefix), f"unavailable: {type(e).__name__}", "", "", "", "")
            )
            continue
        total = stats.get("num_pages")
        pages = f"{stats.get('free_pages', '?')}/{total if total is not None else '?'}"
        rows.append(
            (
                name.removeprefix(prefix),
                str(stats.get("queue_len", "?")),
                pages,
                _names(stats.get("device_adapters")),
                _names(stats.get("host_adapters")),
                _names(stats.get("loading_adapters")),
            )
        )
    return table_lines(rows, full_ids)


def table_lines(rows: list[tuple[str, ...]], full_ids: bool = False) -> list[str]:
    """`rows` as aligned columns, version ids cut (`short_ids`) unless `full_ids` before the
    widths are measured: cut after, the columns were as wide as the whole ids."""
    if not full_ids:
        rows = [tuple(short_ids(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _names(adapters: list[str] | None) -> str:
    return ", ".join(adapters) if adapters else "-"


def adapter_homes_report(
    url: str, metrics_key: str | None = None, full_ids: bool = False
) -> list[str]:
    """The router's view of the busiest adapters, read from the ingress's /metrics (with
    `metrics_key` as the bearer): request rate and homes (the replicas it is routed to),
    the rest summed as "other"; version ids cut unless `full_ids`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
    try:
        r = httpx.get(f"{url}/metrics", headers=headers, timeout=5, trust_env=False)
    except httpx.HTTPError as e:
        return [f"adapters: unavailable ({type(e).__name__}: {e})"]
    if r.status_code != 200:
        return [f"adapters: unavailable (/metrics answered HTTP {r.status_code}: {r.text[:200]})"]
    text = r.text
    rates: dict[str, float] = {}
    homes: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            adapter = sample.labels.get("adapter")
            if sample.name == "loraplex_adapter_request_rate":
                rates[adapter] = sample.value
            elif sample.name == "loraplex_adapter_homes":
                counts[adapter] = int(sample.value)
            elif sample.name == "loraplex_adapter_home":
                homes.setdefault(adapter, []).append(sample.labels["replica"])
    if not rates:
        return ["adapters: no requests routed yet"]
    lines = ["adapters: busiest first (router's estimate), their homes"]
    ranked = sorted((a for a in rates if a != "other"), key=rates.__getitem__, reverse=True)
    for adapter in [*ranked, "other"]:
        where = ", ".join(sorted(homes.get(adapter, []))) or f"{counts.get(adapter, 0)} replicas"
        shown = adapter if full_ids else short_ids(adapter)
        lines.append(f"  {shown:<32} {rates.get(adapter, 0.0):8.2f}/s  {where}")
    return lines
