"""The fan-out's HTTP/1.1 client: per-node keep-alive connections over trio, one SSL context.

:class:`NodeTransport` keeps a tiny pool per node (a dict lookup), speaks HTTP/1.1
(:mod:`ingero.fleet.http1`) directly on ``trio`` streams (TLS from the one shared :class:`ssl.SSLContext`), reads each answer
whole — within a per-answer cap and a byte budget shared by the whole fan-out
(:class:`~ingero.fleet.budget.AnswerBudget`) — and can drop a node's connections the moment that node
is done. It replaced an ``httpx.AsyncClient`` on this transport: the client's request layers and
~40 ms of imports bought nothing the fan-out used (one method, a path, a JSON body, a few headers).

Per node at most ``per_node`` connections (2): the first request opens one; a request that finds it
busy waits up to ``patience`` seconds for it before opening the second — so a clock-skew sample rides
the query's connection when the query is quick (no second TLS handshake) and gets its own when it
is slow or hung (skew never waits on a slow query).

Every :class:`Response` carries ``sent_ns`` (wall clock just before the request's bytes were
written), ``first_byte_ns`` (when the status line and headers arrived) and ``received_ns`` (after its
last byte), the later two as ``sent_ns`` plus a monotonic interval: the NTP ``t1``/``t4`` without
client-side queueing or parsing in them.

Failures are typed (:class:`TransportFailure` and its subclasses), raised ``from`` the underlying
ssl/OS/trio error, so that :func:`ingero.fleet.outcome.classify` decides by type and never by message
text.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from dataclasses import dataclass, field

import trio

from ingero.fleet import http1
from ingero.fleet.budget import MAX_ANSWER_BYTES, AnswerBudget, BudgetExceeded

Origin = tuple[str, str, int]


# --- requests and answers ----------------------------------------------------------------------


@dataclass
class Request:
    """One request to one node: ``origin`` is (scheme, host, port), ``target`` the path and query."""

    method: str
    origin: Origin
    target: str
    headers: list[tuple[str, str]]
    body: bytes = b""


@dataclass
class Response:
    """One complete answer, with the wall-clock stamps the skew estimate needs."""

    status: int
    headers: dict[str, str]  # lower-case names
    content: bytes
    sent_ns: int
    first_byte_ns: int
    received_ns: int


# --- typed failures ------------------------------------------------------------------------------


class TransportFailure(Exception):
    """Base of the transport's own failures."""


class ConnectFailed(TransportFailure):
    """TCP or TLS could not be set up; ``__cause__`` holds the OSError/ssl error."""


class ConnectTimedOut(TransportFailure):
    """TCP connect plus TLS handshake took longer than the connect timeout."""


class SendFailed(TransportFailure):
    """The request could not be written."""


class SendTimedOut(TransportFailure):
    """Writing the request took too long (the agent does not read)."""


class ClosedBeforeAnswer(TransportFailure):
    """The agent closed a fresh connection before any answer byte.

    Under TLS 1.3 an mTLS agent that rejects the client's certificate does so *after* the client
    considers the handshake done: the connection then just closes. ``tls`` says whether it was TLS.
    """

    def __init__(self, message: str, *, tls: bool) -> None:
        super().__init__(message)
        self.tls = tls


class AnswerCutOff(TransportFailure):
    """The connection ended in the middle of an answer."""

    def __init__(self, message: str, *, bytes_read: int) -> None:
        super().__init__(message)
        self.bytes_read = bytes_read


class MalformedAnswer(TransportFailure):
    """The bytes that came back are not HTTP/1.1."""


class ReadBroke(TransportFailure):
    """The connection failed (reset, ...) while reading the answer."""


class ReadTimedOut(TransportFailure):
    """No complete answer within the read timeout."""


class AnswerTooLarge(TransportFailure):
    """The answer passed its per-answer cap, or the fan-out's shared byte budget ran out.

    ``limit`` is the cap that was hit, ``shared`` says whether it was the fan-out's budget.
    The bytes read so far are dropped at once.
    """

    def __init__(self, message: str, *, limit: int, shared: bool, bytes_read: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.shared = shared
        self.bytes_read = bytes_read


class _StaleConnectionError(Exception):
    """A reused connection turned out closed before any answer byte: safe to retry on a new one."""


# --- connections and pools ---------------------------------------------------------------------


class _Conn:
    """One keep-alive HTTP/1.1 connection."""

    __slots__ = ("reader", "stream", "tls", "used")

    def __init__(self, stream: trio.abc.Stream, tls: bool) -> None:
        self.stream = stream
        self.tls = tls
        self.reader = http1.Reader(stream)
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


def _deadline(seconds: float | None) -> float:
    return seconds if seconds is not None else float("inf")


class NodeTransport:
    """HTTP/1.1 over trio with a small connection pool per node (see the module docstring)."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None,
        *,
        per_node: int = 2,
        patience: float = 0.5,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        budget: AnswerBudget | None = None,
    ) -> None:
        self.ssl_context = ssl_context
        self.per_node = max(1, per_node)
        self.patience = patience
        self.max_answer_bytes = max_answer_bytes
        self.budget = budget if budget is not None else AnswerBudget()
        self._pools: dict[Origin, _NodePool] = {}
        self.connections_opened = 0

    async def request(self, request: Request, timeout_s: float | None = None) -> Response:
        """Send ``request`` on one of its node's connections; connect, send and read each within
        ``timeout_s`` (the fan-out's per-node deadline bounds the whole)."""
        origin = request.origin
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _NodePool(self.per_node)
        for attempt in (1, 2):
            conn = await pool.acquire(self.patience)
            reused = conn is not None
            try:
                if conn is None:
                    conn = await self._connect(origin, timeout_s)
                response, reusable = await self._exchange(conn, request, timeout_s)
            except _StaleConnectionError as e:
                # A kept-alive connection the agent had closed meanwhile: nothing was answered; retry once.
                pool.give_back(None)
                if conn is not None:
                    await conn.aclose()
                if attempt == 2 or not reused:
                    raise ClosedBeforeAnswer("the agent closed the connection without answering", tls=False) from e
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
        tls = scheme == "https"
        try:
            with trio.fail_after(_deadline(connect_s)):
                stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
                if tls:
                    if self.ssl_context is None:
                        raise ConnectFailed("https without an SSL context")
                    tls_stream = trio.SSLStream(stream, self.ssl_context, server_hostname=host, https_compatible=True)
                    try:
                        await tls_stream.do_handshake()
                    except BaseException:
                        await _Conn(tls_stream, tls).aclose()
                        raise
                    stream = tls_stream
        except trio.TooSlowError as e:
            raise ConnectTimedOut(f"connecting to {host}:{port} timed out") from e
        except (OSError, trio.BrokenResourceError) as e:
            raise ConnectFailed(f"cannot connect to {host}:{port}") from e
        return _Conn(stream, tls)

    async def _exchange(self, conn: _Conn, request: Request, timeout_s: float | None) -> tuple[Response, bool]:
        data = http1.encode_request(request.method, request.target, request.headers, request.body)
        sent_ns = time.time_ns()
        sent_pc = time.perf_counter_ns()
        fresh = not conn.used
        conn.used = True
        try:
            with trio.fail_after(_deadline(timeout_s)):
                await conn.stream.send_all(data)
        except trio.TooSlowError as e:
            raise SendTimedOut("sending the request timed out") from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            if not fresh:
                raise _StaleConnectionError from e
            raise SendFailed("sending the request failed") from e

        answer = http1.Answer()
        first_byte = [0]

        def on_head() -> None:
            first_byte[0] = sent_ns + (time.perf_counter_ns() - sent_pc)

        budget = self.budget
        try:
            with trio.fail_after(_deadline(timeout_s)):
                await conn.reader.read(answer, budget.take, self.max_answer_bytes, on_head)
        except BaseException as e:
            budget.give_back(answer.size)  # nothing of a failed answer is kept
            failure = self._failure(e, answer, fresh, conn.tls)
            if failure is e:
                raise
            raise failure from e
        received_ns = sent_ns + (time.perf_counter_ns() - sent_pc)
        chunks = answer.chunks
        response = Response(
            answer.status,
            answer.headers,
            b"".join(chunks) if len(chunks) != 1 else chunks[0],
            sent_ns,
            first_byte[0],
            received_ns,
        )
        return response, answer.reusable

    def _failure(self, e: BaseException, answer: http1.Answer, fresh: bool, tls: bool) -> BaseException:
        """The typed failure for an exception that ended a read (others are returned as they are)."""
        if isinstance(e, BudgetExceeded | http1.TooLarge):
            shared = isinstance(e, BudgetExceeded)
            limit = e.limit if isinstance(e, BudgetExceeded) else self.max_answer_bytes
            what = "the fan-out's answer budget" if shared else "the per-answer cap"
            return AnswerTooLarge(
                f"{what} of {_mib(limit)} stops this answer at {_mib(answer.size)}",
                limit=limit,
                shared=shared,
                bytes_read=answer.size,
            )
        if isinstance(e, trio.TooSlowError):
            return ReadTimedOut("no complete answer in time")
        if isinstance(e, http1.Malformed):
            return MalformedAnswer(f"the answer is not valid HTTP/1.1: {e}")
        if isinstance(e, http1.CutOff):
            return AnswerCutOff(
                f"the agent closed the connection mid-answer ({answer.size} bytes read)", bytes_read=answer.size
            )
        broken = isinstance(e, trio.BrokenResourceError | trio.ClosedResourceError | OSError)
        if (broken or isinstance(e, http1.ClosedEarly)) and not fresh and not answer.got_any:
            return _StaleConnectionError()
        if isinstance(e, http1.ClosedEarly):
            return ClosedBeforeAnswer("the agent closed the connection without answering", tls=tls)
        if broken:
            return ReadBroke("the connection broke mid-answer")
        return e

    @property
    def open_nodes(self) -> int:
        """Nodes this transport currently keeps a pool for."""
        return len(self._pools)

    async def release(self, origin: Origin) -> None:
        """Close a node's idle connections and forget it (its busy ones close when their request ends)."""
        pool = self._pools.pop(origin, None)
        if pool is not None:
            while pool.idle:
                await pool.idle.pop().aclose()

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            while pool.idle:
                await pool.idle.pop().aclose()


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.0f} MiB" if n >= 1024 * 1024 else f"{n} bytes"
