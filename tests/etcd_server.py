"""A real etcd for the registry tests: loopback, free ports, a temporary data dir.

Import the fixtures into a test module (`from etcd_server import etcd_server_fixture`: the
fixture is named `etcd_server`); a test that needs etcd and finds no binary is skipped with
the way to install one.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aetcd
import pytest

from loraplex.registry.etcd_client import EtcdSettings
from loraplex.registry.etcd_process import INSTALL_HINT, EtcdProcess, find_etcd_binary


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


class EtcdServer(EtcdProcess):
    """EtcdProcess plus what tests need: settings for it, compaction, and optionally a
    TLS client port that requires client certificates."""

    def __init__(self, data_dir: Path, *, tls: TlsFiles | None = None, **kwargs):
        super().__init__(data_dir, **kwargs)
        self.tls = tls

    def settings(self, timeout_s: float = 2.0) -> EtcdSettings:
        return EtcdSettings(endpoints=[self.endpoint], timeout_s=timeout_s)

    def command(self) -> list[str]:
        command = super().command()
        if self.tls is None:
            return command
        client = f"http://{self.endpoint}"
        command = [f"https://{self.endpoint}" if arg == client else arg for arg in command]
        return command + [
            "--cert-file", str(self.tls.server_cert),
            "--key-file", str(self.tls.server_key),
            "--trusted-ca-file", str(self.tls.ca),
            "--client-cert-auth",
        ]  # fmt: skip

    def _healthy(self) -> bool:
        if self.tls is None:
            return super()._healthy()
        context = ssl.create_default_context(cafile=self.tls.ca)
        context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with socket.create_connection((self.host, self.client_port), timeout=1.0) as raw:
                with context.wrap_socket(raw, server_hostname=self.host):
                    return True
        except OSError:
            return False

    async def compact(self, revision: int) -> None:
        """Drop the history below `revision` (watches starting earlier get 'compacted')."""
        host, _, port = self.endpoint.rpartition(":")
        async with aetcd.Client(host=host, port=int(port), timeout=5) as client:
            await client.compact(revision, physical=True)


def start_etcd(
    data_dir: Path, *, extra_args: tuple[str, ...] = (), tls: TlsFiles | None = None
) -> EtcdServer:
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(f"no etcd server binary; install one: {INSTALL_HINT}")
    server = EtcdServer(data_dir, binary=binary, tls=tls, extra_args=extra_args)
    server.start()
    return server


def write_test_pki(folder: Path) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def issue(name, key, issuer_name, issuer_key, *, ca=False, usage=None, ip=False):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if ip:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            builder = builder.add_extension(san, critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem, cert, key):
        cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_path, key_path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loraplex test CA")])
    ca_cert = issue("loraplex test CA", ca_key, ca_name, ca_key, ca=True)
    server_key, client_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    server = issue(
        "etcd", server_key, ca_name, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH, ip=True
    )
    client = issue("root", client_key, ca_name, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    ca_path, _ = write("ca", ca_cert, ca_key)
    return TlsFiles(
        ca_path, *write("server", server, server_key), *write("client", client, client_key)
    )


@pytest.fixture(name="etcd_server")
def etcd_server_fixture(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd for this test, stopped at its end whatever the test did to it."""
    server = start_etcd(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.stop(kill=True)


@pytest.fixture(name="shared_etcd_server", scope="module")
def shared_etcd_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for a module whose tests neither stop it nor depend on its revisions."""
    server = start_etcd(tmp_path_factory.mktemp("etcd") / "data")
    try:
        yield server
    finally:
        server.stop(kill=True)


class TcpProxy:
    """Loopback TCP forwarder to `upstream` ("host:port"). `cut()` drops every connection and
    refuses new ones until `restore()`: a client's link to etcd fails while etcd itself stays
    up for everyone else."""

    def __init__(self, upstream: str):
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut = False
        self.endpoint = ""

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.endpoint = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def cut(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        self._cut = False

    async def close(self) -> None:
        await self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            _pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True
        )
        self._writers -= {writer, up_writer}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()
