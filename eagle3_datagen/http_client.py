"""HTTP/1.1 to one server over keep-alive connections, parsed in C (httptools): the OpenAI-protocol client's transport.

Why not aiohttp: its per-request work in Python is most of what a generation client spends CPU on
(`benchmarks/generation_utilization.py --phases clients` compares the two).

It does only what the client needs: one server, whole bodies framed by Content-Length or chunked encoding, no
redirects, cookies, proxies or compression. Concurrency is bounded by the caller (the in-flight budget): one
connection per request in flight, kept for the next. TLS trusts the system's certificates (or SSL_CERT_FILE).
"""

from __future__ import annotations

import asyncio
import math
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from eagle3_datagen.errors import Eagle3Error

# idle connections are dropped before the server's keep-alive ends (vLLM's uvicorn: 5 s), so a request is rarely
# sent on a connection the server is closing; when one is, it is sent again once on a new connection
KEEPALIVE_S = 3.0
CONNECT_TIMEOUT_S = 10.0
DEADLINE_GRAIN_S = 0.5  # requests whose deadlines fall in the same half second share one timer
USER_AGENT = "eagle3-datagen"


class ConnectionLost(Eagle3Error, ConnectionError):
    """The connection ended before the whole response arrived."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered  # some of the response had arrived: the server did take the request


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time; `exchange` sends a request and waits for its response."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[Response] | None = None
        self._chunks: list[bytes] = []
        self._answered = False
        self._keep_alive = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(ConnectionLost(f"malformed HTTP response: {error}", answered=True))

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()
        response = Response(self.parser.get_status_code(), b"".join(self._chunks))
        self._chunks = []
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        cause = f": {exc!r}" if exc else ""
        self._fail(ConnectionLost(f"the server closed the connection before its response ended{cause}",
                                  self._answered))

    def time_out(self) -> None:
        self._fail(TimeoutError("no response before the request's deadline"))

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes) -> Response:
        assert self.transport is not None and self._waiter is None
        self._answered = False
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        response = await self._waiter
        if not self._keep_alive:
            self.close()
        return response


class _Deadlines:
    """Times out exchanges still waiting at their deadline with one timer per DEADLINE_GRAIN_S of deadlines, not one
    per request (asyncio.timeout: a handle pushed on the loop's heap, then cancelled, a large share of its calls)."""

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[asyncio.TimerHandle, set[_Connection]]] = {}

    def watch(self, connection: _Connection, deadline: float) -> int:
        key = math.ceil(deadline / DEADLINE_GRAIN_S)
        bucket = self._buckets.get(key)
        if bucket is None:
            timer = asyncio.get_running_loop().call_at(key * DEADLINE_GRAIN_S, self._expire, key)
            bucket = self._buckets[key] = (timer, set())
        bucket[1].add(connection)
        return key

    def unwatch(self, connection: _Connection, key: int) -> None:
        bucket = self._buckets.get(key)
        if bucket is None:
            return
        bucket[1].discard(connection)
        if not bucket[1]:
            bucket[0].cancel()
            del self._buckets[key]

    def _expire(self, key: int) -> None:
        for connection in self._buckets.pop(key)[1]:
            connection.time_out()

    def close(self) -> None:
        for timer, _ in self._buckets.values():
            timer.cancel()
        self._buckets.clear()


class HTTPConnections:
    """Requests to the server at `base_url` (http or https; a path prefix is kept), with `headers` on each.

    A request that fails leaves its connection closed: a cancelled one (a run stopped) closes it, which makes vLLM
    abort the generation.
    """

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        fixed = {"Host": parts.netloc.rsplit("@", 1)[-1], "User-Agent": USER_AGENT, **headers}
        self._headers = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._idle: list[_Connection] = []  # the most recently used last: it is taken first
        self._deadlines = _Deadlines()

    async def request(self, method: str, path: str, timeout_s: float, body: bytes | None = None,
                      content_type: str = "application/json") -> Response:
        """Send one request and read its whole response; OSError (ConnectionLost among them) or TimeoutError, at
        most DEADLINE_GRAIN_S after `timeout_s`."""
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._headers}"
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        request = (head + "\r\n").encode("latin-1") + (body or b"")
        now = asyncio.get_running_loop().time()
        deadline = now + timeout_s
        connection = self._take_idle(now)
        if connection is not None:
            try:
                return await self._exchange(connection, request, deadline)
            except ConnectionLost as lost:
                if lost.answered:
                    raise
                # the server closed it as it was reused: the request never reached it
        return await self._exchange(await self._connect(deadline), request, deadline)

    async def _exchange(self, connection: _Connection, request: bytes, deadline: float) -> Response:
        key = self._deadlines.watch(connection, deadline)
        try:
            response = await connection.exchange(request)
        except BaseException:
            connection.close()
            raise
        finally:
            self._deadlines.unwatch(connection, key)
        if not connection.closed:
            connection.idle_since = asyncio.get_running_loop().time()
            self._idle.append(connection)
        return response

    def _take_idle(self, now: float) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.close()
        return None

    async def _connect(self, deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(min(deadline, loop.time() + CONNECT_TIMEOUT_S)):
            _, connection = await loop.create_connection(
                _Connection, self._host, self._port, ssl=self._tls,
                server_hostname=self._host if self._tls else None)
        return connection

    def close(self) -> None:
        """Close every idle connection (those in use close when their request ends or is cancelled)."""
        for connection in self._idle:
            connection.close()
        self._idle.clear()
        self._deadlines.close()
