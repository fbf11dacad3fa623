"""The fan-out's HTTP/1.1 reader on real socket pairs: framing, keep-alive, caps and every typed failure."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from ingero.fleet import http1

MAX = 1000


def read(*wire: bytes, max_body: int = MAX, answers: int = 1, budget: int = 10**9) -> list[http1.Answer]:
    """Send ``wire`` (each item one write, with a checkpoint between) on a socket pair, close, read."""
    taken = [0]

    def take(n: int) -> None:
        if taken[0] + n > budget:
            raise OverflowError("budget")
        taken[0] += n

    async def main() -> list[http1.Answer]:
        a, b = trio.socket.socketpair()
        server, client = trio.SocketStream(a), trio.SocketStream(b)
        out: list[http1.Answer] = []
        heads: list[int] = []
        async with trio.open_nursery() as nursery:

            async def write() -> None:
                for chunk in wire:
                    await server.send_all(chunk)
                    await trio.sleep(0)
                await server.aclose()

            nursery.start_soon(write)
            reader = http1.Reader(client)
            try:
                for _ in range(answers):
                    ans = http1.Answer()
                    out.append(ans)
                    await reader.read(ans, take, max_body, lambda: heads.append(1))
            finally:
                await client.aclose()
        assert len(heads) == len(out) or not out[-1].status
        return out

    return trio.run(main)


def body(a: http1.Answer) -> bytes:
    return b"".join(a.chunks)


def test_content_length_split_across_reads_and_keep_alive() -> None:
    first, second = read(
        b"HTTP/1.1 200 OK\r\nContent-Le", b"ngth: 5\r\nX-Ingero-Receive-Ns: 7\r\n\r\nhel", b"lo",
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}",
        answers=2,
    )  # fmt: skip
    assert (first.status, body(first), first.reusable) == (200, b"hello", True)
    assert first.headers["x-ingero-receive-ns"] == "7"
    assert (second.status, body(second), second.size) == (404, b"{}", 2)


def test_chunked_with_extensions_and_trailers_and_a_1xx_first() -> None:
    (a,) = read(
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"4;ext=1\r\nabcd\r\n", b"3\r\nefg\r\n0\r\nTrailer: x\r\n\r\n",
    )  # fmt: skip
    assert (a.status, body(a), a.reusable) == (200, b"abcdefg", True)


def test_connection_close_and_eof_delimited_bodies() -> None:
    (a,) = read(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
    assert a.reusable is False and body(a) == b"ok"
    (b,) = read(b"HTTP/1.1 200 OK\r\n\r\nuntil the ", b"end")
    assert b.reusable is False and body(b) == b"until the end"


@pytest.mark.parametrize(
    ("wire", "error"),
    [
        ((b"SSH-2.0-OpenSSH_9.2\r\n\r\n",), http1.Malformed),
        ((b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",), http1.Malformed),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",), http1.Malformed),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",), http1.Malformed),
        ((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",), http1.Malformed),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",), http1.CutOff),
        ((b"HTTP/1.1 200 OK\r\nContent-Le",), http1.CutOff),
        ((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",), http1.CutOff),
        ((), http1.ClosedEarly),
        ((b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n",), http1.TooLarge),  # declared: nothing read
        ((b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"3e8\r\n" + b"x" * 1000 + b"\r\n1\r\n"),
         http1.TooLarge),
        ((b"HTTP/1.1 200 OK\r\n\r\n", b"y" * 1500), http1.TooLarge),
        ((b"HTTP/1.1 200 OK\r\nX: " + b"h" * (http1.MAX_HEADER_BYTES + 10),), http1.Malformed),
    ],
)  # fmt: skip
def test_each_failure_is_typed(wire: tuple[bytes, ...], error: type[Exception]) -> None:
    with pytest.raises(BaseExceptionGroup) as info:
        read(*wire)
    assert info.group_contains(error), info.value


def test_every_body_byte_is_charged_before_it_is_kept() -> None:
    with pytest.raises(BaseExceptionGroup) as info:
        read(b"HTTP/1.1 200 OK\r\nContent-Length: 900\r\n\r\n", b"z" * 900, budget=500)
    assert info.group_contains(OverflowError)


@pytest.mark.parametrize("bad", ["a\r\nInjected: 1", "nul\x00"])
def test_request_headers_cannot_inject_lines(bad: str) -> None:
    ok: Callable[[], bytes] = lambda: http1.encode_request("GET", "/x", [("host", "h:1")], b"")  # noqa: E731
    assert ok() == b"GET /x HTTP/1.1\r\nhost: h:1\r\n\r\n"
    with pytest.raises(ValueError, match="line break or NUL"):
        http1.encode_request("GET", "/x", [("authorization", f"Bearer {bad}")], b"")
