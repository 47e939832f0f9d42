"""Connections to etcd for the store and the watcher: endpoints in order, TLS, user/password.

aetcd 1.0 opens plaintext channels only and to one host; `_Client` adds TLS, and
`EtcdConnection` picks the first endpoint whose channel becomes READY, starting from the
last one that worked. A request is sent at most once: failover happens while connecting,
never by re-sending a write that may have been applied.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import aetcd
import grpc
from aetcd import rpc
from aetcd import watcher as aetcd_watcher
from aetcd.exceptions import UnauthenticatedError
from pydantic import BaseModel, Field, field_validator, model_validator

from loraplex.errors import RegistryUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")

_CHANNEL_OPTIONS = {
    # A full read of 10,000 adapters is ~5 MB, past gRPC's 4 MB default.
    "grpc.max_receive_message_length": 256 * 1024 * 1024,
    # Notice a dead peer on an otherwise idle watch stream (etcd refuses pings < 5 s apart).
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    # gRPC's default backoff grows to 120 s: a restarted etcd would stay "down" for minutes.
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1_000,
}


class EtcdCredentials(BaseModel):
    """How to talk to etcd once reached: deadline, TLS and user. Shared by `EtcdSettings`
    and the cluster config's `etcd` section, which adds how endpoints are found."""

    timeout_s: float = Field(
        5.0, gt=0, le=300, description="Deadline of one registry call, connecting included."
    )
    ca_cert: str | None = Field(None, description="PEM CA bundle; setting it turns on TLS.")
    cert: str | None = Field(None, description="PEM client certificate for mutual TLS.")
    key: str | None = Field(None, description="PEM private key of `cert`.")
    username: str | None = Field(None, description="etcd user (etcd auth enabled).")
    password: str | None = Field(None, description="Password of `username`.")

    @model_validator(mode="after")
    def _pairs(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together: set both for mutual TLS, or neither")
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password go together: set both, or neither")
        return self

    def credentials(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in EtcdCredentials.model_fields}


class EtcdSettings(EtcdCredentials):
    """How to reach etcd (the registry's source of truth)."""

    endpoints: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:2379"],
        min_length=1,
        description="etcd client endpoints as host:port, tried in order; the first that "
        "connects is used until it fails.",
    )

    @field_validator("endpoints")
    @classmethod
    def _host_port(cls, endpoints: list[str]) -> list[str]:
        for endpoint in endpoints:
            match = _ENDPOINT.match(endpoint)
            if match is None or not 0 < int(match.group(2)) < 65536:
                raise ValueError(
                    f"etcd endpoint {endpoint!r}: expected host:port, e.g. 127.0.0.1:2379 "
                    "(no scheme; TLS is set by ca_cert / cert / key)"
                )
        return endpoints

    @property
    def tls(self) -> bool:
        return self.ca_cert is not None or self.cert is not None


def _read_credentials(settings: EtcdSettings) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(
        root_certificates=read(settings.ca_cert),
        private_key=read(settings.key),
        certificate_chain=read(settings.cert),
    )


class _Client(aetcd.Client):
    """aetcd.Client on a channel we build: TLS when configured, our channel options."""

    def __init__(
        self,
        endpoint: str,
        settings: EtcdSettings,
        credentials: grpc.ChannelCredentials | None,
    ):
        host, _, port = endpoint.rpartition(":")
        super().__init__(
            host=host,
            port=int(port),
            username=settings.username,
            password=settings.password,
            timeout=settings.timeout_s,
        )
        self.endpoint = endpoint
        self._credentials = credentials

    @property
    def ready(self) -> bool:
        return (
            self.channel is not None and self.channel.get_state() == grpc.ChannelConnectivity.READY
        )

    async def connect(self) -> None:
        # Replaces aetcd's connect (which always opens an insecure channel). Called once,
        # under EtcdConnection's lock, before any request.
        if self._connected.is_set():
            return
        options = list(_CHANNEL_OPTIONS.items())
        if self._credentials is None:
            self.channel = grpc.aio.insecure_channel(self.endpoint, options=options)
        else:
            self.channel = grpc.aio.secure_channel(
                self.endpoint, self._credentials, options=options
            )
        if self._username is not None:
            response = await rpc.AuthStub(self.channel).Authenticate(
                rpc.AuthenticateRequest(name=self._username, password=self._password),
                timeout=self._timeout,
            )
            self.metadata = (("token", response.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd_watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()

    async def close(self) -> None:
        # aetcd's close shuts its watcher down first, under the watcher's lock, which aetcd
        # holds across awaits that can wait forever (a cancel request put on a full queue of
        # 10 that no stream drains any more): bounded, then the channel is closed anyway,
        # which cancels every call on it, so nothing that stops ever hangs on a stuck stream.
        try:
            await asyncio.wait_for(super().close(), self._timeout)
        except TimeoutError:
            log.warning(
                "etcd client %s: the watch stream did not shut down within %gs; "
                "closing its channel",
                self.endpoint,
                self._timeout,
            )
            if self.channel is not None:
                await self.channel.close()
            self._init_channel_attrs()
            self._connected.clear()


async def _channel_ready(channel: grpc.aio.Channel, timeout: float) -> bool:
    """Whether `channel` reaches READY within `timeout`; False at once on a refused connect."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    state = channel.get_state(try_to_connect=True)
    while state != grpc.ChannelConnectivity.READY:
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            return False
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), remaining)
        except TimeoutError:
            return False
        state = channel.get_state(try_to_connect=True)
    return True


class EtcdConnection:
    """One aetcd client at a time, to the first endpoint that connects."""

    def __init__(self, settings: EtcdSettings):
        self.settings = settings
        self._index = 0
        self._client: _Client | None = None
        self._credentials: grpc.ChannelCredentials | None = None
        self._lock = asyncio.Lock()

    @property
    def endpoint(self) -> str:
        return self.settings.endpoints[self._index]

    async def client(self, timeout: float | None = None) -> _Client:
        """A client whose channel is READY; RegistryUnavailable if no endpoint connects in
        `timeout` (default settings.timeout_s), shared evenly between the endpoints."""
        client = self._client
        if client is not None and client.ready:
            return client
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.settings.timeout_s if timeout is None else timeout)
        try:  # callers queue here while one connects; each keeps its own deadline
            await asyncio.wait_for(self._lock.acquire(), max(deadline - loop.time(), 0.001))
        except TimeoutError:
            raise RegistryUnavailable(
                f"etcd unavailable: no connection to {self.endpoint} within "
                f"{self.settings.timeout_s:g}s"
            ) from None
        try:
            return await self._connect(deadline)
        finally:
            self._lock.release()

    async def _connect(self, deadline: float) -> _Client:
        loop = asyncio.get_running_loop()
        endpoints = self.settings.endpoints
        failures = []
        if self.settings.tls and self._credentials is None:
            self._credentials = await asyncio.to_thread(_read_credentials, self.settings)
        for tried in range(len(endpoints)):
            budget = (deadline - loop.time()) / (len(endpoints) - tried)
            try:
                if self._client is None or self._client.channel is None:
                    await self._drop()  # none yet, or its connect() was interrupted
                    client = _Client(self.endpoint, self.settings, self._credentials)
                    self._client = client
                    await asyncio.wait_for(client.connect(), max(budget, 0.001))
                if await _channel_ready(self._client.channel, budget):
                    return self._client
                failures.append(f"{self.endpoint}: not reachable")
            except (TimeoutError, grpc.RpcError, aetcd.ClientError) as e:
                failures.append(f"{self.endpoint}: {_describe(e)}")
            await self._drop()
            self._index = (self._index + 1) % len(endpoints)
        raise RegistryUnavailable(
            f"etcd unavailable (timeout {self.settings.timeout_s:g}s): " + "; ".join(failures)
        )

    async def request(
        self, call: Callable[[aetcd.Client], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """`call(client)` sent once within `timeout` (default settings.timeout_s), connecting
        first; every failure to reach etcd or to hear back in time is RegistryUnavailable."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.settings.timeout_s if timeout is None else timeout)
        for attempt in range(2):
            client = await self.client(deadline - loop.time())
            try:
                return await asyncio.wait_for(call(client), max(deadline - loop.time(), 0.001))
            except UnauthenticatedError as e:
                # aetcd never renews its auth token (etcd expires it, after 5 min by default):
                # the request was refused before it was applied, so log in again and resend.
                await self.reset(client)
                if attempt == 1:
                    raise RegistryUnavailable(f"etcd at {client.endpoint}: {e}") from e
            except aetcd.ConnectionFailedError as e:
                await self.reset(client)
                raise RegistryUnavailable(f"etcd at {client.endpoint}: {e}") from e
            except (TimeoutError, grpc.RpcError, aetcd.ClientError) as e:
                # Slow, or refused for another reason: the channel may be fine and shared by
                # other requests in flight; keepalive notices a dead one.
                raise RegistryUnavailable(f"etcd at {client.endpoint}: {_describe(e)}") from e
        raise AssertionError("unreachable")

    async def reset(self, client: _Client | None = None) -> None:
        """Forget the current client (only if it is still `client`, when given): the next call
        reconnects on a new channel, which connects at once where an old one may still sit
        in its reconnect backoff."""
        async with self._lock:
            if client is None or client is self._client:
                await self._drop()

    async def close(self) -> None:
        await self.reset()

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None and client.channel is not None:
            try:
                await client.close()
            except Exception as e:  # closing a broken channel must not mask the real error
                log.debug("closing etcd client %s: %r", client.endpoint, e)


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
