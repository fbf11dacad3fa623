"""The fan-out's httpx transport: per-node HTTP/1.1 keep-alive connections over trio, one SSL context.

``httpx``'s default transport keeps every node's connections in one pool and scans the whole pool
(including a readability poll per idle connection) on every request and every response; with
hundreds of nodes that is quadratic and dominates a fan-out. :class:`NodeTransport` is an
:class:`httpx.AsyncBaseTransport` that keeps a tiny pool per node (a dict lookup), speaks HTTP/1.1
with ``h11`` directly on ``trio`` streams (TLS from the one shared :class:`ssl.SSLContext`), reads each
answer whole (capped), and can drop a node's connections the moment that node is done.

Per node at most ``per_node`` connections (2): the first request opens one; a request that finds it
busy waits up to ``patience`` seconds for it before opening the second — so clock-skew samples ride
the query's connection when the query is quick (no second TLS handshake) and get their own when it
is slow or hung (skew never waits on a slow query).

Every answer carries ``extensions["ingero.sent_ns"]`` (wall clock just before the request's bytes
were written) and ``["ingero.received_ns"]`` (the same clock plus a monotonic interval, after its
last byte): the NTP ``t1``/``t4`` without client-side queueing or parsing in them.

Errors are httpx's own exception types, raised ``from`` the underlying ssl/OS/trio error, so that
:func:`ingero.fleet.outcome.classify` sees the whole chain.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import trio

Origin = tuple[str, str, int]
MAX_ANSWER_BYTES = 64 * 1024 * 1024
READ_CHUNK = 256 * 1024


class _Conn:
    """One keep-alive HTTP/1.1 connection."""

    __slots__ = ("h11", "stream", "used")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
        self.used = False

    async def aclose(self) -> None:
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(1),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
        ):
            await self.stream.aclose()


@dataclass
class _NodePool:
    per_node: int
    idle: list[_Conn] = field(default_factory=list)
    total: int = 0  # open connections, busy or idle, plus ones being opened
    freed: trio.Event = field(default_factory=trio.Event)

    async def acquire(self, patience: float) -> _Conn | None:
        """An idle connection, or None when the caller may open a new one (a slot is reserved)."""
        deadline = trio.current_time() + patience
        while True:
            if self.idle:
                return self.idle.pop()
            if self.total < self.per_node and (self.total == 0 or trio.current_time() >= deadline):
                self.total += 1
                return None
            ev = self.freed
            if self.total < self.per_node:
                with trio.move_on_at(deadline):
                    await ev.wait()
            else:
                await ev.wait()

    def give_back(self, conn: _Conn | None) -> None:
        """Return a reusable connection (or, with None, forget a closed one)."""
        if conn is not None:
            self.idle.append(conn)
        else:
            self.total -= 1
        self.freed.set()
        self.freed = trio.Event()


class NodeTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over trio with a small connection pool per node (see the module docstring)."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None,
        *,
        per_node: int = 2,
        patience: float = 0.5,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.ssl_context = ssl_context
        self.per_node = max(1, per_node)
        self.patience = patience
        self.max_answer_bytes = max_answer_bytes
        self._pools: dict[Origin, _NodePool] = {}
        self.connections_opened = 0

    @staticmethod
    def origin(url: httpx.URL) -> Origin:
        return (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = self.origin(request.url)
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _NodePool(self.per_node)
        timeouts: dict[str, Any] = request.extensions.get("timeout") or {}
        for attempt in (1, 2):
            conn = await pool.acquire(self.patience)
            reused = conn is not None
            try:
                if conn is None:
                    conn = await self._connect(origin, timeouts.get("connect"))
                response, reusable = await self._exchange(conn, request, timeouts)
            except _StaleConnectionError as e:
                # A kept-alive connection the agent had closed meanwhile: nothing was answered; retry once.
                pool.give_back(None)
                if conn is not None:
                    await conn.aclose()
                if attempt == 2 or not reused:
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.") from e
                continue
            except BaseException:
                pool.give_back(None)
                if conn is not None:
                    await conn.aclose()
                raise
            if reusable:
                pool.give_back(conn)
            else:
                pool.give_back(None)
                await conn.aclose()
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect(self, origin: Origin, connect_s: float | None) -> _Conn:
        scheme, host, port = origin
        self.connections_opened += 1
        try:
            with trio.fail_after(connect_s if connect_s is not None else float("inf")):
                stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
                if scheme == "https":
                    if self.ssl_context is None:
                        raise httpx.ConnectError("https without an SSL context")
                    tls = trio.SSLStream(stream, self.ssl_context, server_hostname=host, https_compatible=True)
                    try:
                        await tls.do_handshake()
                    except BaseException:
                        await _Conn(tls).aclose()
                        raise
                    stream = tls
        except trio.TooSlowError as e:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from e
        except (OSError, trio.BrokenResourceError) as e:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {e}") from e
        return _Conn(stream)

    async def _exchange(
        self, conn: _Conn, request: httpx.Request, timeouts: dict[str, Any]
    ) -> tuple[httpx.Response, bool]:
        c = conn.h11
        body = request.content
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"connection"]
        data = c.send(h11.Request(method=request.method, target=request.url.raw_path, headers=headers))
        if body:
            data += c.send(h11.Data(data=body))
        data += c.send(h11.EndOfMessage())
        write_t = timeouts.get("write")
        read_t = timeouts.get("read")
        sent_ns = time.time_ns()
        sent_pc = time.perf_counter_ns()
        fresh = not conn.used
        conn.used = True
        try:
            with trio.fail_after(write_t if write_t is not None else float("inf")):
                await conn.stream.send_all(data)
        except trio.TooSlowError as e:
            raise httpx.WriteTimeout("sending the request timed out") from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            if not fresh:
                raise _StaleConnectionError from e
            raise httpx.WriteError(f"sending the request failed: {e}") from e

        status = 0
        resp_headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        size = 0
        got_any = False
        try:
            with trio.fail_after(read_t if read_t is not None else float("inf")):
                while True:
                    event = c.next_event()
                    if event is h11.NEED_DATA:
                        chunk = await conn.stream.receive_some(READ_CHUNK)
                        if not chunk and not got_any:
                            if not fresh:
                                raise _StaleConnectionError
                            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
                        got_any = True
                        c.receive_data(bytes(chunk))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                        resp_headers = list(event.headers)
                    elif isinstance(event, h11.Data):
                        size += len(event.data)
                        if size > self.max_answer_bytes:
                            raise httpx.RemoteProtocolError(
                                f"answer larger than {self.max_answer_bytes // (1024 * 1024)} MiB; not read"
                            )
                        chunks.append(bytes(event.data))
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
                    # h11.InformationalResponse (1xx): keep reading
        except trio.TooSlowError as e:
            raise httpx.ReadTimeout("no complete answer in time") from e
        except h11.RemoteProtocolError as e:
            text = str(e)
            if "incomplete" in text.lower() or "closed" in text.lower():
                raise httpx.RemoteProtocolError(
                    f"peer closed connection without sending complete message body ({size} bytes read)"
                ) from e
            raise httpx.RemoteProtocolError(f"malformed answer: {text}") from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            if not got_any and not fresh:
                raise _StaleConnectionError from e
            raise httpx.ReadError(f"the connection broke: {e}") from e
        received_ns = sent_ns + (time.perf_counter_ns() - sent_pc)
        reusable = c.our_state is h11.DONE and c.their_state is h11.DONE
        if reusable:
            try:
                c.start_next_cycle()
            except h11.LocalProtocolError:
                reusable = False
        response = httpx.Response(
            status,
            headers=resp_headers,
            content=b"".join(chunks),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "ingero.sent_ns": sent_ns, "ingero.received_ns": received_ns},
        )
        return response, reusable

    @property
    def open_nodes(self) -> int:
        """Nodes this transport currently keeps a pool for."""
        return len(self._pools)

    async def release(self, url: httpx.URL | str) -> None:
        """Close a node's idle connections and forget it (its busy ones close when their request ends)."""
        pool = self._pools.pop(self.origin(httpx.URL(url)), None)
        if pool is not None:
            while pool.idle:
                await pool.idle.pop().aclose()

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            while pool.idle:
                await pool.idle.pop().aclose()


class _StaleConnectionError(Exception):
    """A reused connection turned out closed before any answer byte: safe to retry on a new one."""
