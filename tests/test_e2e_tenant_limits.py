"""Issue 27, item 5: a tenant's limits hold for the whole cluster, not per ingress replica.

`loraplex up` (a real etcd, a real local Ray head, Serve's proxy, two ingress replicas and one
replica of the demo model, on 127.0.0.1) in a subprocess, spoken to over HTTP. Serve's proxy
spreads requests over the two ingresses; their shares of each tenant's limits come from one
ledger actor (router/ledger_actor.py).

Requests in flight: a request holds its tenant's slot from the moment its headers are read
until its answer is sent, so a request whose body is held back holds one without the engine.
Before, each ingress counted alone: 8 held bodies of a tenant limited to 4 were all let in.

Tokens per minute: sequential completions of exactly 60 tokens (50 prompt ids, 10 tokens with
`ignore_eos`) at 1,200 a minute: the first 20 fit and are served; past them only what the
bucket refills during the run. Before, each ingress had a bucket of its own: about twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from test_e2e_cluster import cluster_up, yaml_config

from loraplex.demo.assets import DemoAssets
from loraplex.net import free_port

pytestmark = [pytest.mark.ray, pytest.mark.etcd]

MODEL_ID = "limits-demo"
IN_FLIGHT = 4
PER_MINUTE = 1200
PROMPT_IDS, MAX_TOKENS = 50, 10  # 60 tokens reserved, and used, per request
ANSWER_S = 5.0  # a refusal comes back within this; an admitted held body gets no answer


@pytest.fixture(scope="module")
def cluster(demo_assets: DemoAssets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("e2e_limits")
    config = yaml_config(
        root,
        {
            "model": str(demo_assets.model),
            "model_id": MODEL_ID,
            "engine": {"max_model_len": 256, "pool_mib": 32, "max_num_seqs": 8},
            "replicas": {"num_replicas": 1, "num_cpus": 1},
            "http": {"port": free_port(), "ingress_replicas": 2},
        },
    )
    state_dir = (root / "state").resolve()
    with cluster_up(config, state_dir) as (state, _):
        admin = {"Authorization": f"Bearer {(state_dir / 'admin_key').read_text().strip()}"}
        keys = {}
        with httpx.Client(base_url=state["url"], trust_env=False, timeout=30) as http:
            for name, limits in (
                ("slots", {"max_requests_in_flight": IN_FLIGHT}),
                ("minute", {"tokens_per_minute": PER_MINUTE}),
            ):
                r = http.post("/v1/tenants", json={"name": name}, headers=admin)
                assert r.status_code == 201, r.text
                keys[name] = r.json()["api_key"]
                r = http.put(f"/v1/tenants/{name}/limits", json=limits, headers=admin)
                assert r.status_code == 200, r.text
        time.sleep(2)  # the ingresses' registry watchers see the limits
        yield {"url": state["url"], **keys}


def _body(max_tokens: int = 1) -> bytes:
    prompt = list(range(100, 100 + PROMPT_IDS))
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return json.dumps(body).encode()


class HeldBody:
    """A completion whose headers and first half of body are sent, the rest held back."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key, self.body = urlsplit(url), key, _body()

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.url.hostname, self.url.port)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.url.netloc}\r\n"
            f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(self.body)}\r\nConnection: close\r\n\r\n"
        )
        self.writer.write(head.encode() + self.body[: len(self.body) // 2])
        await self.writer.drain()

    async def status_within(self, seconds: float) -> int | None:
        """The answer's status if one comes within `seconds` (None: still held)."""
        try:
            line = await asyncio.wait_for(self.reader.readline(), seconds)
        except TimeoutError:
            return None
        return int(line.split()[1])

    async def finish(self) -> int:
        self.writer.write(self.body[len(self.body) // 2 :])
        await self.writer.drain()
        status = await self.status_within(60)
        await asyncio.wait_for(self.reader.read(), 60)  # to the end: the slot is given back
        self.writer.close()
        assert status is not None
        return status


async def _hold(url: str, key: str, n: int) -> tuple[list[HeldBody], int]:
    """Opens `n` held bodies at once; those still held after ANSWER_S, and how many were
    answered (each a 429)."""
    held = [HeldBody(url, key) for _ in range(n)]
    await asyncio.gather(*(h.open() for h in held))
    statuses = await asyncio.gather(*(h.status_within(ANSWER_S) for h in held))
    assert set(statuses) <= {None, 429}, statuses
    for h, s in zip(held, statuses, strict=True):
        if s is not None:
            h.writer.close()
    return [h for h, s in zip(held, statuses, strict=True) if s is None], statuses.count(429)


def test_requests_in_flight_are_held_cluster_wide(cluster: dict):
    async def run() -> None:
        held, refused = await _hold(cluster["url"], cluster["slots"], 2 * IN_FLIGHT)
        assert (len(held), refused) == (IN_FLIGHT, IN_FLIGHT)  # it was 8 let in, 0 refused
        # a request that fits is let in at whichever ingress it reaches, each time one ends
        for _ in range(IN_FLIGHT):
            assert await held.pop(0).finish() == 200
            more, refused = await _hold(cluster["url"], cluster["slots"], 1)
            assert (len(more), refused) == (1, 0)
            held += more
        for h in held:
            assert await h.finish() == 200

    asyncio.run(run())


def test_tokens_per_minute_are_one_bucket_cluster_wide(cluster: dict):
    headers = {"Authorization": f"Bearer {cluster['minute']}", "Content-Type": "application/json"}
    statuses = []
    with httpx.Client(base_url=cluster["url"], trust_env=False, timeout=60) as http:
        started = time.monotonic()
        for _ in range(2 * PER_MINUTE // (PROMPT_IDS + MAX_TOKENS)):
            r = http.post("/v1/completions", content=_body(MAX_TOKENS), headers=headers)
            assert r.status_code in (200, 429), r.text
            if r.status_code == 200:
                assert r.json()["usage"]["total_tokens"] == PROMPT_IDS + MAX_TOKENS
            statuses.append(r.status_code)
        took = time.monotonic() - started
    fits = PER_MINUTE // (PROMPT_IDS + MAX_TOKENS)
    assert statuses[:fits] == [200] * fits  # a full minute's bucket: each of these fits
    # what the bucket could hold over the run: a minute's tokens and their refill
    most = PER_MINUTE * (1 + took / 60) // (PROMPT_IDS + MAX_TOKENS)
    assert statuses.count(200) <= most, (statuses, took)
