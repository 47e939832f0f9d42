"""The ingress's Backend over the replicas' Serve deployment handle.

Each request is one streaming call of `ReplicaDeployment.generate`, tagged with its adapter
as the multiplexed model id so AffinityRequestRouter can route on it ("" for the base model:
Serve wants a string). Errors the replica raises (AdapterNotFound, RequestError, ...) arrive
wrapped in a RayTaskError and are re-raised as themselves. A replica that dies before its
first chunk is replaced by another try on another replica (Serve's router stops choosing a
dead replica). One that dies after chunks were sent is resumed on another replica after
the tokens the client already holds (`resume_after`: the new replica recomputes prompt +
those tokens, and its draws go on from the same seed and position), so the client sees one
uninterrupted stream; ReplicaFailed only when every resume failed too.

Replica stats for /metrics come from the ingress asking, at scrape time, every replica at
once through the same handle (`DeploymentHandle.broadcast`, ray-project/ray#61472): it works
with any number of replicas and ingresses, each ingress sees every live replica, and a
replica that is gone drops out with the handle's view. The alternatives do not reach
/metrics on a real cluster: routing stats arrive only inside the handle's request router
(private to Serve), a replica cannot address the ingress replicas, and Ray's own metrics
export goes to each node's metrics agent, not to this app.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import RayServeException

from loraplex.replica.protocol import GenerateChunk, GenerateRequest, ReplicaFailed, ResumeAfter

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

log = logging.getLogger(__name__)


class ServeBackend:
    """retries               further tries, on another replica, while no chunk was sent
    resumes               further tries after a chunk was sent: the request resumes on
                          another replica after the tokens the client already holds
    first_chunk_timeout_s  bound on the wait for the first chunk (queueing, routing, adapter
                           load and prefill); None waits as long as Serve does, which is
                           forever while the deployment has no replica
    stats_timeout_s        bound on `replica_stats` (a /metrics scrape waits for it)"""

    def __init__(
        self,
        handle: DeploymentHandle,
        *,
        retries: int = 1,
        resumes: int = 2,
        first_chunk_timeout_s: float | None = None,
        stats_timeout_s: float = 2.0,
    ):
        assert retries >= 0 and resumes >= 0
        assert first_chunk_timeout_s is None or first_chunk_timeout_s > 0
        assert stats_timeout_s > 0
        self.handle = handle
        self.retries = retries
        self.resumes = resumes
        self.resumed = 0  # streams resumed on another replica so far (metrics, tests)
        self.first_chunk_timeout_s = first_chunk_timeout_s
        self.stats_timeout_s = stats_timeout_s

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """`stats()` of every running replica, asked of all at once (Serve's broadcast, which
        reaches each replica the handle's router knows, not one chosen by routing), by the
        id each reports. Within `stats_timeout_s`, or nothing (the wait is for all together);
        a replica that fails is left out."""
        try:
            results = await self.handle.broadcast("stats").results_async(
                timeout_s=self.stats_timeout_s, return_exceptions=True
            )
        except (TimeoutError, RayServeException) as e:
            log.warning("no replica stats: %s", e)
            return {}
        for error in (r for r in results if isinstance(r, BaseException)):
            log.warning("a replica's stats failed: %r", error)
        return {r["replica"]: r for r in results if isinstance(r, dict)}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        request = _with_seed(request)
        handle = self.handle.options(stream=True, multiplexed_model_id=request["adapter"] or "")
        sent_tokens: list[int] = []  # what the client holds, if a replica dies mid-stream
        sent_text: list[str] = []
        tries = resumes = 0
        last_finished = False  # the last chunk the client got ended the request
        while True:
            started = bool(sent_tokens or sent_text)
            call = (
                _resumed(request, sent_tokens, "".join(sent_text), resumes) if started else request
            )
            finished = False
            stream = handle.generate.remote(call)
            chunks = aiter(stream)
            try:
                async with asyncio.timeout(self.first_chunk_timeout_s):
                    item = await anext(chunks, None)
                while item is not None:
                    sent_tokens += item["new_token_ids"]
                    sent_text.append(item["new_text"])
                    last_finished = item["finished"]
                    yield item
                    item = await anext(chunks, None)
                finished = True
                return
            except RayTaskError as e:  # the replica raised: hand on its own exception
                cause = e.cause if isinstance(e.cause, Exception) else None
                if isinstance(cause, RayActorError):  # failed reaching a dead actor itself
                    error: RayActorError = cause
                elif cause is not None:
                    raise cause from None
                else:
                    raise
            except RayActorError as e:  # ActorDiedError, ActorUnavailableError
                error = e
            except TimeoutError:  # first_chunk_timeout_s (a replica's own comes as RayTaskError)
                if sent_tokens or sent_text:
                    raise
                raise TimeoutError(
                    f"request {request['request_id']}: no replica sent a first chunk within "
                    f"{self.first_chunk_timeout_s}s"
                ) from None
            finally:
                # the caller stopped early, or it failed: abort it there. Not after the
                # replica's last chunk, where the caller stops reading too: that request is
                # over, and a cancel costs an actor call in each process (every request did)
                if not finished and not last_finished:
                    stream.cancel()
            if last_finished:  # the replica died after its last chunk: nothing is missing
                return
            most = request["params"].get("max_tokens")
            if most is not None and len(sent_tokens) >= most:
                # it died with every token sent but before its closing chunk: close it here
                yield GenerateChunk(
                    request_id=request["request_id"],
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason="length",
                    num_prompt_tokens=len(request["prompt_token_ids"]),
                    num_output_tokens=len(sent_tokens),
                )
                return
            if sent_tokens or sent_text:  # resume it elsewhere after what the client holds
                if resumes == self.resumes:
                    raise ReplicaFailed(
                        f"request {request['request_id']}: the replica failed after streaming "
                        f"began, and {resumes} resumes on other replicas failed too: {error}"
                    ) from error
                if resumes == 0:  # streams, not tries: a resume may reach the dead replica
                    self.resumed += 1
                resumes += 1
                log.warning(
                    "request %s: its replica failed after %d tokens (%s); resuming elsewhere",
                    request["request_id"],
                    len(sent_tokens),
                    error,
                )
            elif tries == self.retries:
                raise ReplicaFailed(
                    f"request {request['request_id']}: the replica failed on {tries + 1} tries: "
                    f"{error}"
                ) from error
            else:
                tries += 1


def _with_seed(request: GenerateRequest) -> GenerateRequest:
    """The request with a seed of its own if it has none: a resumed request then continues
    its random draws exactly (each draw depends on the seed and its position only)."""
    if request["params"].get("seed") is not None:
        return request
    return {**request, "params": {**request["params"], "seed": secrets.randbits(63)}}


def _resumed(request: GenerateRequest, tokens: list[int], text: str, n: int) -> GenerateRequest:
    """The request to send another replica after the client got `tokens` (and `text`) from
    one that died: the replica recomputes prompt + tokens and goes on from there. Its id
    differs (a half-dead replica may still hold the old one until it aborts it)."""
    return {
        **request,
        "request_id": f"{request['request_id']}.resume{n + 1}",
        "resume_after": ResumeAfter(token_ids=list(tokens), text=text),
    }
