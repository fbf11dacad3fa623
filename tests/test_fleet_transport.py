"""The fan-out's httpx transport against a raw socket server that writes exact bytes: framing, keep-alive,
the caps while streaming, the skew stamps, header injection, the shared SSL context, and every typed
failure with the outcome kind and words it ends as."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from ingero.config import NodeSpec
from ingero.fleet import transport as tr
from ingero.fleet.budget import AnswerBudget
from ingero.fleet.client import FleetClient
from ingero.fleet.outcome import Kind, NodeFailure, classify
from ingero.fleet.settings import ClientSettings
from ingero.fleet.skew import RECEIVE_HEADER, TRANSMIT_HEADER
from tests.fleet_agents import AgentSpec, Pki, client_settings, closed_port, make_pki, node_specs, start_agents

MAX = 1000
Piece = bytes | float | Callable[[], bytes]  # bytes to write, seconds to wait, or bytes made at that moment


@dataclass
class Answer:
    """One answer, written piece by piece; the connection closes after it unless ``keep``."""

    pieces: tuple[Piece, ...]
    keep: bool = False


@dataclass
class Wire:
    """A raw HTTP server on 127.0.0.1: the n-th request (over all connections) gets ``answers[n]``."""

    answers: list[Answer]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buf = b""
        async with stream:
            while self.answers:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.requests.append(head)
                answer = self.answers.pop(0)
                for piece in answer.pieces:
                    if isinstance(piece, float):
                        await trio.sleep(piece)
                    else:
                        await stream.send_all(piece() if callable(piece) else piece)
                        await trio.sleep(0)
                if not answer.keep:
                    return


async def serve(wire: Wire, *, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
    await trio.serve_tcp(wire.serve, 0, host="127.0.0.1", task_status=task_status)


def exchange(
    wire: Wire, n: int = 1, *, max_body: int = MAX, budget: int = 10**9, timeout_s: float = 5.0
) -> tuple[list[tr.Response | BaseException], tr.NodeTransport]:
    """``n`` sequential GETs through one plaintext transport to ``wire``; each an answer or its exception."""
    out: list[tr.Response | BaseException] = []
    transport = tr.NodeTransport(None, timeout_s=timeout_s, max_answer_bytes=max_body, budget=AnswerBudget(budget))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(serve, wire)
            port = listener.socket.getsockname()[1]
            for _ in range(n):
                try:
                    out.append(await transport.request(tr.Request("GET", ("http", "127.0.0.1", port), "/x")))
                except Exception as e:
                    out.append(e)
            await transport.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return out, transport


def outcome(e: tr.Response | BaseException, *, tls: bool = False) -> NodeFailure:
    assert isinstance(e, BaseException), e
    return classify(e, 5.0, tls=tls)


def ok(r: tr.Response | BaseException) -> tr.Response:
    assert isinstance(r, tr.Response), repr(r)
    return r


def test_content_length_split_across_reads_and_keep_alive() -> None:
    wire = Wire([
        Answer((b"HTTP/1.1 200 OK\r\nContent-Le", b"ngth: 5\r\nX-Ingero-Receive-Ns: 7\r\n\r\nhel", b"lo"), keep=True),
        Answer((b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}",)),
    ])  # fmt: skip
    (first, second), transport = exchange(wire, 2)
    assert (ok(first).status, ok(first).content) == (200, b"hello")
    assert ok(first).headers["x-ingero-receive-ns"] == "7"
    assert (ok(second).status, ok(second).content) == (404, b"{}")
    assert wire.connections == transport.connections_opened == 1  # the second request rode the first's connection
    assert transport.budget.used == 7


def test_chunked_with_extensions_and_trailers_and_a_1xx_first() -> None:
    (a,), _ = exchange(
        Wire([Answer((
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"4;ext=1\r\nabcd\r\n", b"3\r\nefg\r\n0\r\nTrailer: x\r\n\r\n",
        ))])
    )  # fmt: skip
    assert (ok(a).status, ok(a).content) == (200, b"abcdefg")


def test_connection_close_and_eof_delimited_bodies() -> None:
    wire = Wire([
        Answer((b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",)),
        Answer((b"HTTP/1.1 200 OK\r\n\r\nuntil the ", b"end")),
    ])  # fmt: skip
    (a, b), transport = exchange(wire, 2)
    assert ok(a).content == b"ok" and ok(b).content == b"until the end"
    assert wire.connections == transport.connections_opened == 2


def test_a_kept_alive_connection_the_agent_closed_is_retried_not_an_outcome() -> None:
    wire = Wire([
        Answer((b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",), keep=True),
        Answer(()),  # the second request, on the kept-alive connection: closed unanswered (an idle timeout)
        Answer((b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]",)),  # ... its retry, on a new connection
        Answer(()),  # a fresh connection closed unanswered is the node's outcome
    ])  # fmt: skip
    (a, b, c), transport = exchange(wire, 3)
    assert (ok(a).content, ok(b).content) == (b"{}", b"[]")
    assert isinstance(c, tr.ClosedBeforeAnswer)
    assert wire.connections == transport.connections_opened == 3
    assert len(wire.requests) == 4


@pytest.mark.parametrize(
    ("pieces", "failure", "kind", "words"),
    [
        ((b"SSH-2.0-OpenSSH_9.2\r\n\r\n",), tr.MalformedAnswer, Kind.PROTOCOL, "not valid HTTP/1.1"),
        ((b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",), tr.MalformedAnswer, Kind.PROTOCOL, "not valid HTTP/1.1"),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",), tr.MalformedAnswer, Kind.PROTOCOL, "not valid HTTP"),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",), tr.MalformedAnswer, Kind.PROTOCOL,
         "not valid HTTP/1.1"),
        ((b"HTTP/1.1 200 OK\r\nX: " + b"h" * 200_000,), tr.MalformedAnswer, Kind.PROTOCOL, "not valid HTTP/1.1"),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",), tr.AnswerCutOff, Kind.PROTOCOL,
         "mid-answer (cut off after 5 bytes)"),
        ((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",), tr.AnswerCutOff, Kind.PROTOCOL,
         "mid-answer (cut off after 2 bytes)"),
        ((), tr.ClosedBeforeAnswer, Kind.PROTOCOL, "closed the connection without answering"),
        # a declared Content-Length past the cap: stopped before any body byte is read
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n",), tr.AnswerTooLarge, Kind.TOO_LARGE,
         "answer cut at 0 KiB: it would pass the per-answer cap"),
        ((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"3e8\r\n" + b"x" * 1000 + b"\r\n1\r\nx\r\n"),
         tr.AnswerTooLarge, Kind.TOO_LARGE, "per-answer cap"),
        ((b"HTTP/1.1 200 OK\r\n\r\n", b"y" * 1500), tr.AnswerTooLarge, Kind.TOO_LARGE, "per-answer cap"),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", 5.0), tr.ReadTimedOut, Kind.TIMEOUT,
         "no answer within 5s"),
    ],
)  # fmt: skip
def test_each_failure_is_typed_and_has_its_words(
    pieces: tuple[Piece, ...], failure: type[Exception], kind: Kind, words: str
) -> None:
    timeout_s = 0.3 if any(isinstance(p, float) for p in pieces) else 5.0
    (e,), transport = exchange(Wire([Answer(pieces)]), timeout_s=timeout_s)
    assert isinstance(e, failure), repr(e)
    got = outcome(e)
    assert got.kind is kind and words in got.reason.replace("0.3s", "5s"), got.reason
    assert transport.budget.used == 0  # nothing of a failed answer stays charged


def test_the_agent_closing_a_fresh_tls_connection_reads_as_a_certificate_refusal() -> None:
    e = tr.ClosedBeforeAnswer("closed", tls=True)
    assert classify(e, 5.0, tls=True).kind is Kind.TLS
    assert "requires a client certificate" in classify(e, 5.0, tls=True).reason
    assert "refused our client certificate" in classify(e, 5.0, tls=True, client_cert=True).reason


def test_every_body_byte_is_charged_to_the_shared_budget_while_it_streams() -> None:
    wire = Wire([Answer((b"HTTP/1.1 200 OK\r\nContent-Length: 900\r\n\r\n", b"z" * 300, 0.05, b"z" * 600))])
    (e,), transport = exchange(wire, budget=500)
    assert isinstance(e, tr.AnswerTooLarge) and e.shared and e.bytes_read == 900
    failure = outcome(e)
    assert failure.kind is Kind.TOO_LARGE and "the fan-out's shared answer budget" in failure.reason
    assert transport.budget.used == 0 and transport.budget.peak == 300  # the first 300 were charged, then given back


def test_skew_stamps_are_taken_around_the_bytes_on_the_wire() -> None:
    """t1 before the agent saw the request, t4 after its head was sent and before its slow body ended."""

    def head() -> bytes:
        now = str(time.time_ns()).encode()
        return (
            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n"
            + RECEIVE_HEADER.encode() + b": " + now + b"\r\n" + TRANSMIT_HEADER.encode() + b": " + now + b"\r\n\r\n"
        )  # fmt: skip

    (r,), _ = exchange(Wire([Answer((0.05, head, b"ab", 0.1, b"cd"))]))
    resp = ok(r)
    t2 = int(resp.headers[RECEIVE_HEADER])
    assert resp.sent_ns <= t2 <= resp.first_byte_ns <= resp.received_ns
    assert t2 - resp.sent_ns >= 50_000_000  # the agent's 50 ms pause is after t1 ...
    assert resp.received_ns - resp.first_byte_ns >= 100_000_000  # ... and the slow body after t4


@pytest.mark.parametrize("bad", ["a\r\nInjected: 1", "a\nInjected: 1", "nul\x00"])
def test_request_headers_cannot_inject_lines(bad: str) -> None:
    with pytest.raises(ValueError, match="line break or NUL"):
        tr.NodeTransport(None, headers=[("authorization", f"Bearer {bad}")])
    with pytest.raises(ValueError, match="line break or NUL"):
        tr.check_headers([("x-extra", bad)])
    wire = Wire([])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(serve, wire)
            node = NodeSpec("127.0.0.1", listener.socket.getsockname()[1])
            with pytest.raises(ValueError, match="line break or NUL"):
                FleetClient([node], ClientSettings(plaintext=True, token=bad))
            transport = tr.NodeTransport(None)
            with pytest.raises(ValueError, match="line break or NUL"):
                await transport.request(tr.Request("GET", ("http", node.host, node.port), "/x", [("x-extra", bad)]))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert wire.connections == 0  # nothing reached the wire


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_one_ssl_context_for_every_node_and_no_certifi_bundle(
    pki: Pki, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import certifi

    import ingero.tls.context

    built: list[Any] = []
    real = ingero.tls.context.client_ssl_context

    def counted(**kw: Any) -> Any:
        built.append(real(**kw))
        return built[-1]

    def no_certifi() -> str:
        raise AssertionError("certifi's bundle was loaded")

    monkeypatch.setattr(ingero.tls.context, "client_ssl_context", counted)
    monkeypatch.setattr(certifi, "where", no_certifi)
    specs = [AgentSpec(samples / f"sample-gpu-node-0{i}.db", f"gpu-node-0{i}") for i in (1, 2, 3)]
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nodes = node_specs(await start_agents(nursery, pki, specs))
            async with FleetClient(nodes, client_settings(pki)) as fc:
                seen["outcomes"] = await fc.request_all("GET", "/api/v1/health")
                clients = [n.client for n in fc.transport._nodes.values()]
                seen["contexts"] = {id(c._transport._pool._ssl_context) for c in clients}  # type: ignore[attr-defined]
                seen["trust_env"] = {c.trust_env for c in clients}
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert [o.kind for o in seen["outcomes"]] == [Kind.OK] * 3
    assert len(built) == 1 and seen["contexts"] == {id(built[0])}
    assert seen["trust_env"] == {False}


def test_the_system_store_is_loaded_once_right_before_the_first_handshake(
    pki: Pki, samples: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --ca-cert: the system store (here our CA, through OpenSSL's SSL_CERT_FILE) is parsed once, before
    the first handshake, and never for a fan-out whose nodes all refuse."""
    import ssl

    loads: list[object] = []
    real = ssl.SSLContext.load_default_certs

    def counted(self: ssl.SSLContext, purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH) -> None:
        loads.append(self)
        real(self, purpose)

    monkeypatch.setattr(ssl.SSLContext, "load_default_certs", counted)
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
    settings = client_settings(pki, ca_cert=None)
    specs = [AgentSpec(samples / f"sample-gpu-node-0{i}.db", f"gpu-node-0{i}") for i in (1, 2, 3)]
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nodes = node_specs(await start_agents(nursery, pki, specs))
            async with FleetClient([NodeSpec("127.0.0.1", closed_port())], settings) as fc:
                seen["refused"] = await fc.request_all("GET", "/api/v1/health")
                seen["loads_refused"] = len(loads)
            async with FleetClient(nodes, settings) as fc:
                seen["ok"] = await fc.request_all("GET", "/api/v1/health")
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert [o.kind for o in seen["refused"]] == [Kind.REFUSED] and seen["loads_refused"] == 0
    assert [o.kind for o in seen["ok"]] == [Kind.OK] * 3  # verified against the store loaded just in time
    assert len(loads) == 1


def test_httpcore_is_loaded_without_its_unused_http2_and_socks_extras() -> None:
    """A fresh process: a fan-out to a refused node imports httpcore without h2/socksio (start-up), and
    h2 stays importable afterwards (hypercorn's HTTP/2 in the same process)."""
    import json
    import subprocess
    import sys

    code = f"""
import json, sys
from ingero.config import NodeSpec
from ingero.fleet.operations import query_sync
from ingero.fleet.settings import ClientSettings
result = query_sync([NodeSpec("127.0.0.1", {closed_port()})], ClientSettings(), "SELECT 1")
loaded = {{m: m in sys.modules for m in ("httpcore", "h2", "socksio")}}
import h2.connection
print(json.dumps({{"kinds": [str(o.kind) for o in result.outcomes], "loaded": loaded}}))
"""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc == {"kinds": ["refused"], "loaded": {"httpcore": True, "h2": False, "socksio": False}}
