"""The client's HTTP transport against a loopback server that misbehaves at the connection level on purpose:
connections reused, closed by the server while idle or as a request arrives, chunked bodies, TLS, cancellation."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from eagle3_datagen.http_client import ConnectionLost, HTTPConnections

Handler = Callable[["Exchange"], Awaitable[None]]


class Exchange:
    """One request as the server read it, and the means to answer it."""

    def __init__(self, server: LoopbackServer, connection: int, head: str, body: bytes,
                 writer: asyncio.StreamWriter) -> None:
        self.server, self.connection, self.head, self.body, self.writer = server, connection, head, body, writer

    def answer(self, body: bytes = b'{"ok": true}', status: int = 200, extra: str = "") -> None:
        self.writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)


class LoopbackServer:
    """Reads requests on every connection and hands each to `handler`; counts connections and what they saw."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler, self.tls = handler, tls
        self.connections = 0
        self.requests: list[Exchange] = []
        self.ended: list[int] = []  # connections the client closed, in order

    async def __aenter__(self) -> LoopbackServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        connection = self.connections
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                               if line.lower().startswith("content-length:")), 0)
                exchange = Exchange(self, connection, head, await reader.readexactly(length), writer)
                self.requests.append(exchange)
                await self.handler(exchange)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.ended.append(connection)
        finally:
            writer.close()


async def answer(exchange: Exchange) -> None:
    exchange.answer()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_connections_are_kept_and_requests_carry_the_prefix_and_headers() -> None:
    async def test() -> None:
        async with LoopbackServer(answer) as server:
            http = HTTPConnections(f"http://127.0.0.1:{server.port}/prefix/", {"Authorization": "Bearer k"})
            for _ in range(20):
                assert (await http.request("POST", "/v1/chat/completions", 5, b"{}")).body == b'{"ok": true}'
            http.close()
        assert server.connections == 1
        head = server.requests[0].head
        assert head.startswith("POST /prefix/v1/chat/completions HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{server.port}\r\n" in head and "Authorization: Bearer k\r\n" in head
        assert server.requests[0].body == b"{}"

    run(test)


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def close_after_answer(exchange: Exchange) -> None:
        exchange.answer()
        await exchange.writer.drain()
        exchange.writer.close()

    async def test() -> None:
        async with LoopbackServer(close_after_answer) as server:
            http = HTTPConnections(f"http://127.0.0.1:{server.port}", {})
            for _ in range(3):
                assert (await http.request("GET", "/health", 5)).status == 200
                await asyncio.sleep(0.05)
            http.close()
        assert server.connections == 3

    run(test)


def test_a_request_on_a_connection_closed_as_it_arrives_is_sent_again_once() -> None:
    async def drop_every_second(exchange: Exchange) -> None:
        if len(exchange.server.requests) % 2 == 0:  # the keep-alive race: the server closes as the request comes
            exchange.writer.close()
        else:
            exchange.answer()

    async def test() -> None:
        async with LoopbackServer(drop_every_second) as server:
            http = HTTPConnections(f"http://127.0.0.1:{server.port}", {})
            assert (await http.request("POST", "/v1/chat/completions", 5, b"first")).status == 200
            assert (await http.request("POST", "/v1/chat/completions", 5, b"second")).status == 200
            http.close()
        assert [e.body for e in server.requests] == [b"first", b"second", b"second"]
        assert [e.connection for e in server.requests] == [1, 1, 2]

    run(test)


def test_a_new_connection_closed_without_an_answer_fails() -> None:
    async def drop(exchange: Exchange) -> None:
        exchange.writer.close()

    async def test() -> None:
        async with LoopbackServer(drop) as server:
            http = HTTPConnections(f"http://127.0.0.1:{server.port}", {})
            with pytest.raises(ConnectionLost) as lost:
                await http.request("POST", "/v1/chat/completions", 5, b"{}")
            assert not lost.value.answered
            http.close()
        assert len(server.requests) == 1  # not sent again: a new connection is no race

    run(test)


def test_chunked_bodies_are_joined_and_connection_close_is_honoured() -> None:
    async def chunked_then_close(exchange: Exchange) -> None:
        exchange.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for part in (b'{"choi', b'ces": [', b"]}"):
            exchange.writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            await exchange.writer.drain()
            await asyncio.sleep(0.01)
        exchange.writer.write(b"0\r\n\r\n")

    async def test() -> None:
        async with LoopbackServer(chunked_then_close) as server:
            http = HTTPConnections(f"http://127.0.0.1:{server.port}", {})
            for _ in range(2):
                assert (await http.request("GET", "/v1/models", 5)).body == b'{"choices": []}'
            http.close()
        assert server.connections == 2

    run(test)


def test_a_malformed_response_fails_as_answered() -> None:
    async def garbage(exchange: Exchange) -> None:
        exchange.writer.write(b"this is not HTTP\r\n\r\n")

    async def test() -> None:
        async with LoopbackServer(garbage) as server:
            http = HTTPConnections(f"http://127.0.0.1:{server.port}", {})
            with pytest.raises(ConnectionLost, match="malformed HTTP response") as lost:
                await http.request("GET", "/health", 5)
            assert lost.value.answered
            http.close()

    run(test)


def test_a_cancelled_or_timed_out_request_closes_its_connection() -> None:
    """vLLM aborts a generation whose connection closes: a stopped run must not leave the server working."""
    async def never(exchange: Exchange) -> None:
        pass

    async def test() -> None:
        async with LoopbackServer(never) as server:
            http = HTTPConnections(f"http://127.0.0.1:{server.port}", {})
            with pytest.raises(TimeoutError):
                await http.request("POST", "/v1/chat/completions", 0.2, b"{}")
            request = asyncio.create_task(http.request("POST", "/v1/chat/completions", 30, b"{}"))
            while len(server.requests) < 2:
                await asyncio.sleep(0.01)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            for _ in range(100):
                if len(server.ended) == 2:
                    break
                await asyncio.sleep(0.01)
            assert server.ended == [1, 2]
            http.close()

    run(test)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_https_verifies_the_server_against_the_trusted_certificates(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = _self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def test(trusted: bool) -> None:
        async with LoopbackServer(answer, tls) as server:
            http = HTTPConnections(f"https://localhost:{server.port}", {})
            try:
                if trusted:
                    assert (await http.request("GET", "/health", 5)).status == 200
                else:
                    with pytest.raises(ssl.SSLCertVerificationError):
                        await http.request("GET", "/health", 5)
            finally:
                http.close()

    run(lambda: test(trusted=False))
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # how a private CA is trusted, as with any OpenSSL client
    run(lambda: test(trusted=True))
