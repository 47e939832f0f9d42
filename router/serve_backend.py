"""The ingress's Backend over the replicas' Serve deployment handle.

Each request is one streaming call of `ReplicaDeployment.generate`, tagged with its adapter
as the multiplexed model id so AffinityRequestRouter can route on it ("" for the base model:
Serve wants a string). Errors the replica raises (AdapterNotFound, RequestError, ...) arrive
wrapped in a RayTaskError and are re-raised as themselves. A replica that dies before its
first chunk is replaced by another try on another replica (Serve's router stops choosing a
dead replica); one that dies after a chunk was sent raises ReplicaFailed, since the client
already holds part of the output.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ray.exceptions import RayActorError, RayTaskError

from loraplex.replica.protocol import GenerateChunk, GenerateRequest, ReplicaFailed

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle


class ServeBackend:
    """retries               further tries, on another replica, while no chunk was sent
    first_chunk_timeout_s  bound on the wait for the first chunk (queueing, routing, adapter
                           load and prefill); None waits as long as Serve does, which is
                           forever while the deployment has no replica"""

    def __init__(
        self,
        handle: DeploymentHandle,
        *,
        retries: int = 1,
        first_chunk_timeout_s: float | None = None,
    ):
        assert retries >= 0
        assert first_chunk_timeout_s is None or first_chunk_timeout_s > 0
        self.handle = handle
        self.retries = retries
        self.first_chunk_timeout_s = first_chunk_timeout_s

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        handle = self.handle.options(stream=True, multiplexed_model_id=request["adapter"] or "")
        for attempt in range(self.retries + 1):
            sent = finished = False
            stream = handle.generate.remote(request)
            chunks = aiter(stream)
            try:
                async with asyncio.timeout(self.first_chunk_timeout_s):
                    item = await anext(chunks, None)
                while item is not None:
                    sent = True
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
                if sent:
                    raise
                raise TimeoutError(
                    f"request {request['request_id']}: no replica sent a first chunk within "
                    f"{self.first_chunk_timeout_s}s"
                ) from None
            finally:
                if not finished:  # the caller stopped early, or it failed: abort it there
                    stream.cancel()
            if sent or attempt == self.retries:
                what = "after streaming began" if sent else f"on {attempt + 1} tries"
                raise ReplicaFailed(
                    f"request {request['request_id']}: the replica failed {what}: {error}"
                ) from error
