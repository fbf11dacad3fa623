"""The fan-out's HTTP client: one ``httpx.AsyncClient`` per node on trio, one shared SSL context.

:class:`NodeTransport` keeps one :class:`httpx.AsyncClient` per node (its own pool: HTTP/1.1, at most
``per_node`` connections; one shared pool grows costly at 128+ origins), every client built on the one
:class:`ssl.SSLContext` of the fan-out (``verify=ctx``: no certifi bundle is loaded) with
``trust_env=False`` and explicit :class:`httpx.Timeout`\\ s. A context that verifies against the system
store gets that store (~25 ms to parse) right before the first TLS handshake (``before_tls``): a fan-out
whose nodes all refuse never loads it. Each answer is streamed
(``client.stream`` + ``aiter_raw``) within a per-answer cap and a byte budget shared by the whole
fan-out (:class:`~ingero.fleet.budget.AnswerBudget`), charged chunk by chunk as the bytes arrive; a
declared ``Content-Length`` past the cap stops the answer before its body is read. A node's client can
be dropped the moment that node is done (:meth:`NodeTransport.release`).

A request that finds its node's connection busy waits up to ``patience`` seconds for it before the pool
opens the second — so a clock-skew sample rides the query's connection when the query is quick (no
second TLS handshake) and gets its own when it is slow or hung (skew never waits on a slow query).

Every :class:`Response` carries ``sent_ns`` (wall clock when httpcore starts writing the request's
bytes), ``first_byte_ns`` (when the status line and headers arrived) and ``received_ns`` (after its
last byte), the later two as ``sent_ns`` plus a monotonic interval: the NTP ``t1``/``t4`` without
client-side queueing or parsing in them, taken from httpcore's ``trace`` extension.

Failures are typed (:class:`TransportFailure` and its subclasses), raised ``from`` httpx's exception
(whose chain holds the ssl/OS/trio error), so that :func:`ingero.fleet.outcome.classify` decides by type
and never by message text. httpx is imported on the first fan-out, not with this module.
"""

from __future__ import annotations

import contextlib
import re
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ingero.fleet.budget import MAX_ANSWER_BYTES, AnswerBudget, BudgetExceeded

if TYPE_CHECKING:
    import httpx

Origin = tuple[str, str, int]
Headers = Sequence[tuple[str, str]]
_FORBIDDEN = re.compile(r"[\r\n\x00]")


# --- requests and answers ----------------------------------------------------------------------


@dataclass
class Request:
    """One request to one node: ``origin`` is (scheme, host, port), ``target`` the path and query;
    ``headers`` are this request's own (the node's client adds the fan-out's common ones)."""

    method: str
    origin: Origin
    target: str
    headers: Headers = ()
    body: bytes = b""


@dataclass
class Response:
    """One complete answer, with the wall-clock stamps the skew estimate needs."""

    status: int
    headers: Mapping[str, str]  # case-insensitive (httpx.Headers)
    content: bytes
    sent_ns: int
    first_byte_ns: int
    received_ns: int


def check_headers(headers: Headers) -> None:
    """Header names and values may not carry CR, LF or NUL (no header injection)."""
    for name, value in headers:
        if _FORBIDDEN.search(name) or _FORBIDDEN.search(value):
            raise ValueError(f"header {name!r} holds a line break or NUL")


# --- typed failures ------------------------------------------------------------------------------


class TransportFailure(Exception):
    """Base of the transport's own failures."""


class ConnectFailed(TransportFailure):
    """TCP or TLS could not be set up; the chain holds the OSError/ssl error."""


class ConnectTimedOut(TransportFailure):
    """TCP connect plus TLS handshake (or the wait for a pooled connection) took longer than the timeout."""


class SendFailed(TransportFailure):
    """The request could not be written, and no answer came."""


class SendTimedOut(TransportFailure):
    """Writing the request took too long (the agent does not read)."""


class ClosedBeforeAnswer(TransportFailure):
    """The agent closed a fresh connection before a complete answer head.

    Under TLS 1.3 an mTLS agent that rejects the client's certificate does so *after* the client
    considers the handshake done: the connection then just closes. ``tls`` says whether it was TLS.
    """

    def __init__(self, message: str, *, tls: bool) -> None:
        super().__init__(message)
        self.tls = tls


class AnswerCutOff(TransportFailure):
    """The connection ended in the middle of an answer's body."""

    def __init__(self, message: str, *, bytes_read: int) -> None:
        super().__init__(message)
        self.bytes_read = bytes_read


class MalformedAnswer(TransportFailure):
    """The bytes that came back are not an HTTP/1.1 answer head."""


class ReadBroke(TransportFailure):
    """The connection failed (reset, ...) while reading the answer."""


class ReadTimedOut(TransportFailure):
    """No answer bytes within the read timeout."""


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


class _OverCap(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(f"answer of at least {size} bytes")
        self.size = size


class _StaleConnectionError(Exception):
    """A reused connection turned out closed before any answer: safe to retry on a new one."""


# --- one exchange: where it got to, and its stamps ---------------------------------------------

_CONNECT, _SEND, _HEAD, _BODY = range(4)


class _Exchange:
    """httpcore's ``trace`` callback for one request: the stage reached, a fresh connection or not,
    and the monotonic stamps around the bytes on the wire."""

    __slots__ = ("fresh", "head_pc", "owner", "sent_ns", "sent_pc", "size", "stage")

    def __init__(self, owner: NodeTransport) -> None:
        self.owner = owner
        self.fresh = False
        self.stage = _CONNECT
        self.sent_ns = self.sent_pc = self.head_pc = 0
        self.size = 0  # body bytes read

    async def trace(self, name: str, info: Mapping[str, Any]) -> None:
        if name == "http11.send_request_headers.started":
            self.sent_pc = time.perf_counter_ns()
            self.sent_ns = time.time_ns()
            self.stage = _SEND
        elif name == "http11.receive_response_headers.started":
            self.stage = _HEAD
        elif name == "http11.receive_response_headers.complete":
            self.head_pc = time.perf_counter_ns()
            self.stage = _BODY
        elif name == "connection.connect_tcp.started":
            self.fresh = True
            self.owner.connections_opened += 1
        elif name == "connection.start_tls.started":
            self.owner.before_handshake()

    def wall(self, pc: int) -> int:
        """Wall-clock nanoseconds of the monotonic stamp ``pc`` (0 when the request never went out)."""
        return self.sent_ns + (pc - self.sent_pc) if self.sent_ns else 0


# --- one node's client -------------------------------------------------------------------------


class _Node:
    """One node's ``AsyncClient``, its requests in flight and the URLs of its few paths."""

    __slots__ = ("busy", "client", "idle", "origin", "urls")

    def __init__(self, client: httpx.AsyncClient, origin: Origin) -> None:
        self.client = client
        self.origin = origin
        self.busy = 0
        self.idle = trio.Event()
        self.urls: dict[str, httpx.URL] = {}

    def url(self, target: str) -> httpx.URL:
        url = self.urls.get(target)
        if url is None:
            import httpx

            scheme, host, port = self.origin
            url = self.urls[target] = httpx.URL(scheme=scheme, host=host, port=port, raw_path=target.encode("ascii"))
        return url

    async def turn(self, patience: float) -> None:
        """Wait up to ``patience`` for the node's requests in flight to end, then go."""
        if self.busy:
            with trio.move_on_after(patience):
                await self.idle.wait()
        self.busy += 1

    def done(self) -> None:
        self.busy -= 1
        if not self.busy:
            self.idle.set()
            self.idle = trio.Event()


async def _close(client: httpx.AsyncClient) -> None:
    with (
        trio.CancelScope(shield=True),
        trio.move_on_after(1),
        contextlib.suppress(Exception),  # a peer that is gone: nothing left to close cleanly
    ):
        await client.aclose()


# httpcore's optional HTTP/2 and SOCKS support: the fan-out speaks HTTP/1.1 only (http2=False).
_UNUSED_EXTRAS = ("h2", "socksio")


def _load_httpx() -> None:
    """Import httpx and httpcore, the latter without its optional extras when nothing loaded them yet:
    h2/hpack/socksio are ~30 ms of CPU at start-up (a fifth of ``import trio, ssl, httpx``). They stay
    importable afterwards: hypercorn imports h2 as usual, and httpcore imports its HTTP/2 connection when
    a client (not the fan-out's) asks for HTTP/2."""
    import sys

    if "httpcore" not in sys.modules:
        blocked = [name for name in _UNUSED_EXTRAS if name not in sys.modules]
        for name in blocked:
            sys.modules[name] = None  # type: ignore[assignment]  # import fails: httpcore's optional path
        try:
            import httpcore  # noqa: F401
        finally:
            for name in blocked:
                if sys.modules.get(name, "") is None:
                    del sys.modules[name]
    import httpx  # noqa: F401


class NodeTransport:
    """httpx on trio, one ``AsyncClient`` per node (see the module docstring)."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None,
        *,
        headers: Headers = (),
        timeout_s: float | None = None,
        per_node: int = 2,
        patience: float = 0.5,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        budget: AnswerBudget | None = None,
        before_tls: Callable[[], None] | None = None,
    ) -> None:
        _load_httpx()
        import httpx

        check_headers(headers)
        # Plain HTTP never uses it, but httpx would otherwise build (and load certifi into) one per client.
        self.ssl_context = ssl_context if ssl_context is not None else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.per_node = max(1, per_node)
        self.patience = patience
        self.max_answer_bytes = max_answer_bytes
        self.budget = budget if budget is not None else AnswerBudget()
        self.connections_opened = 0
        self._before_tls = before_tls  # runs once, right before the first TLS handshake
        self._headers = httpx.Headers({"accept-encoding": "identity", **dict(headers)})
        self._timeout = httpx.Timeout(timeout_s)
        self._limits = httpx.Limits(max_connections=self.per_node, max_keepalive_connections=self.per_node)
        self._nodes: dict[Origin, _Node] = {}

    def _node(self, origin: Origin) -> _Node:
        node = self._nodes.get(origin)
        if node is None:
            import httpx

            client = httpx.AsyncClient(
                verify=self.ssl_context,
                http1=True,
                http2=False,
                limits=self._limits,
                timeout=self._timeout,
                headers=self._headers,
                trust_env=False,
                follow_redirects=False,
            )
            node = self._nodes[origin] = _Node(client, origin)
        return node

    def before_handshake(self) -> None:
        if self._before_tls is not None:
            before, self._before_tls = self._before_tls, None
            before()

    async def request(self, request: Request) -> Response:
        """Send ``request`` on its node's client, after that node's requests in flight (up to ``patience``)."""
        check_headers(request.headers)
        node = self._node(request.origin)
        await node.turn(self.patience)
        try:
            try:
                return await self._exchange(node, request)
            except _StaleConnectionError:
                # A kept-alive connection the agent had closed meanwhile: nothing was answered; retry once.
                try:
                    return await self._exchange(node, request)
                except _StaleConnectionError as e:
                    raise ClosedBeforeAnswer("the agent closed the connection without answering", tls=False) from e
        finally:
            node.done()

    async def _exchange(self, node: _Node, request: Request) -> Response:
        ex = _Exchange(self)
        chunks: list[bytes] = []
        try:
            async with node.client.stream(
                request.method,
                node.url(request.target),
                content=request.body or None,
                headers=request.headers,
                extensions={"trace": ex.trace},
            ) as resp:
                await self._read(resp, ex, chunks)
        except BaseException as e:
            self.budget.give_back(sum(map(len, chunks)))  # nothing of a failed answer is kept
            failure = self._failure(e, ex, tls=request.origin[0] == "https")
            if failure is e:
                raise
            raise failure from e
        received = ex.wall(time.perf_counter_ns())
        content = b"".join(chunks) if len(chunks) != 1 else chunks[0]
        return Response(resp.status_code, resp.headers, content, ex.sent_ns, ex.wall(ex.head_pc), received)

    async def _read(self, resp: httpx.Response, ex: _Exchange, chunks: list[bytes]) -> None:
        """Stream the body into ``chunks``, each charged to the cap and the shared budget as it arrives."""
        cap = self.max_answer_bytes
        declared = resp.headers.get("content-length")
        if declared is not None and int(declared) > cap:  # h11 admits only digits here
            raise _OverCap(int(declared))
        take = self.budget.take  # raises BudgetExceeded when the fan-out's budget is spent
        async for chunk in resp.aiter_raw():
            ex.size += len(chunk)
            if ex.size > cap:
                raise _OverCap(ex.size)
            take(len(chunk))
            chunks.append(chunk)

    def _failure(self, e: BaseException, ex: _Exchange, *, tls: bool) -> BaseException:
        """The typed failure for an exception that ended an exchange (others are returned as they are)."""
        import h11
        import httpx

        size = ex.size
        if isinstance(e, BudgetExceeded | _OverCap):
            shared = isinstance(e, BudgetExceeded)
            limit = e.limit if isinstance(e, BudgetExceeded) else self.max_answer_bytes
            what = "the fan-out's answer budget" if shared else "the per-answer cap"
            return AnswerTooLarge(
                f"{what} of {_mib(limit)} stops this answer at {_mib(size)}",
                limit=limit,
                shared=shared,
                bytes_read=size,
            )
        if isinstance(e, httpx.ConnectTimeout | httpx.PoolTimeout):
            return ConnectTimedOut("no connection in time")
        if isinstance(e, httpx.ConnectError):
            return ConnectFailed("cannot connect")
        if isinstance(e, httpx.WriteTimeout):
            return SendTimedOut("sending the request timed out")
        if isinstance(e, httpx.ReadTimeout):
            return ReadTimedOut("no answer in time")
        broken = isinstance(e, httpx.ReadError | httpx.WriteError | httpx.RemoteProtocolError)
        if broken and not ex.fresh and ex.stage < _BODY and not _in_chain(e, ssl.SSLError | h11.RemoteProtocolError):
            return _StaleConnectionError()
        if isinstance(e, httpx.RemoteProtocolError):
            if ex.stage == _BODY:
                return AnswerCutOff(f"the agent closed the connection mid-answer ({size} bytes read)", bytes_read=size)
            if _in_chain(e, h11.RemoteProtocolError):  # h11 read bytes that are not an answer head
                return MalformedAnswer("the answer is not valid HTTP/1.1")
            return ClosedBeforeAnswer("the agent closed the connection without answering", tls=tls)
        if isinstance(e, httpx.WriteError):
            return SendFailed("sending the request failed")
        if isinstance(e, httpx.ReadError):
            return ReadBroke("the connection broke mid-answer")
        return e

    @property
    def open_nodes(self) -> int:
        """Nodes this transport currently keeps a client for."""
        return len(self._nodes)

    async def release(self, origin: Origin) -> None:
        """Close a node's client (its pool and connections) and forget it."""
        node = self._nodes.pop(origin, None)
        if node is not None:
            await _close(node.client)

    async def aclose(self) -> None:
        nodes, self._nodes = self._nodes, {}
        for node in nodes.values():
            await _close(node.client)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _in_chain(exc: BaseException, kind: type[BaseException] | Any) -> bool:
    return any(isinstance(e, kind) for e in _chain(exc))


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.0f} MiB" if n >= 1024 * 1024 else f"{n} bytes"
