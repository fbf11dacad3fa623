"""The HTTP/1.1 the fan-out speaks, and nothing more: one request out, one answer in, on a trio stream.

A request is a method, a target, a few headers and maybe a JSON body. An answer is a status line,
headers (at most :data:`MAX_HEADER_BYTES`) and a body framed by ``Content-Length``, ``chunked`` or the
end of the connection. Every body byte is handed to ``take`` before it is kept, which raises to stop
the read (the per-answer cap and the fan-out's shared budget live in the caller); a declared
``Content-Length`` past the cap stops the read before any body byte is read.

Failures are typed: :class:`Malformed` (not HTTP/1.1), :class:`CutOff` (the connection ended inside an
answer), :class:`ClosedEarly` (it ended before the first byte — on a kept-alive connection: stale, retry).
This replaced ``h11`` on the fan-out's path: its event machinery cost more per node than the rest of
the client, and its import a tenth of the CLI's start-up.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

MAX_HEADER_BYTES = 64 * 1024
READ_CHUNK = 256 * 1024
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?")
_FORBIDDEN = re.compile(r"[\r\n\x00]")


class Malformed(Exception):
    """The bytes are not an HTTP/1.1 answer."""


class CutOff(Exception):
    """The connection ended inside an answer."""


class ClosedEarly(Exception):
    """The connection ended before the answer's first byte."""


class TooLarge(Exception):
    """The answer is (or says it is) larger than the per-answer cap."""

    def __init__(self, size: int) -> None:
        super().__init__(f"answer of at least {size} bytes")
        self.size = size


def encode_request(method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """The request's bytes; header names and values may not carry CR, LF or NUL (no header injection)."""
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in headers:
        if _FORBIDDEN.search(name) or _FORBIDDEN.search(value):
            raise ValueError(f"header {name!r} holds a line break or NUL")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class Answer:
    """What was read of one answer (also when the read stopped early)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0  # body bytes kept
    got_any: bool = False  # any byte of this answer arrived
    reusable: bool = False  # the connection may carry the next request


class Reader:
    """Reads answers from one connection (it keeps the bytes that arrive past an answer)."""

    __slots__ = ("buf", "stream")

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self, answer: Answer) -> bool:
        """Read more into the buffer; False at the end of the connection."""
        data = await self.stream.receive_some(READ_CHUNK)
        if not data:
            return False
        answer.got_any = True
        self.buf += data
        return True

    async def read(
        self, answer: Answer, take: Callable[[int], None], max_body: int, on_head: Callable[[], None]
    ) -> None:
        """Read one answer into ``answer``; ``on_head`` runs when its status line and headers are in."""
        while True:  # 1xx answers precede the real one
            await self._head(answer)
            if answer.status >= 200:
                break
        on_head()
        h = answer.headers
        keep_alive = "close" not in h.get("connection", "").lower()
        if "chunked" in h.get("transfer-encoding", "").lower():
            await self._chunked(answer, take, max_body)
            answer.reusable = keep_alive
        elif "content-length" in h:
            try:
                length = int(h["content-length"])
            except ValueError:
                raise Malformed("Content-Length is not a number") from None
            if length < 0:
                raise Malformed("negative Content-Length")
            if length > max_body:
                raise TooLarge(length)
            await self._exactly(answer, length, take)
            answer.reusable = keep_alive
        elif answer.status in (204, 304):
            answer.reusable = keep_alive
        else:  # delimited by the end of the connection
            await self._to_eof(answer, take, max_body)

    async def _head(self, answer: Answer) -> None:
        start = 0
        while (end := self.buf.find(b"\r\n\r\n", start)) < 0:
            if len(self.buf) > MAX_HEADER_BYTES:
                raise Malformed(f"headers longer than {MAX_HEADER_BYTES} bytes")
            start = max(0, len(self.buf) - 3)
            if not await self._fill(answer):
                if answer.got_any or self.buf:
                    raise CutOff("the connection ended inside the answer's headers")
                raise ClosedEarly("the connection ended before the answer")
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        lines = head.split(b"\r\n")
        m = _STATUS_LINE.fullmatch(lines[0])
        if m is None:
            raise Malformed("no HTTP/1.1 status line")
        answer.status = int(m.group(1))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise Malformed("a header line without 'name: value'")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            if key == "content-length" and key in headers and headers[key] != text:
                raise Malformed("two different Content-Length headers")
            headers[key] = f"{headers[key]}, {text}" if key in headers and key != "content-length" else text
        answer.headers = headers

    def _keep(self, answer: Answer, data: bytes, take: Callable[[int], None]) -> None:
        take(len(data))  # raises to stop: the caller's caps
        answer.chunks.append(data)
        answer.size += len(data)

    async def _exactly(self, answer: Answer, n: int, take: Callable[[int], None]) -> None:
        while n > 0:
            if not self.buf and not await self._fill(answer):
                raise CutOff(f"the connection ended {n} bytes before the end of the answer")
            part = bytes(self.buf[:n])
            del self.buf[: len(part)]
            n -= len(part)
            self._keep(answer, part, take)

    async def _line(self, answer: Answer) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEADER_BYTES:
                raise Malformed("a chunk header or trailer line is too long")
            if not await self._fill(answer):
                raise CutOff("the connection ended inside a chunked answer")
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    async def _chunked(self, answer: Answer, take: Callable[[int], None], max_body: int) -> None:
        while True:
            size_text = (await self._line(answer)).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise Malformed("a chunk size that is not hexadecimal") from None
            if size == 0:
                while await self._line(answer):  # trailers, up to the empty line
                    pass
                return
            if answer.size + size > max_body:
                raise TooLarge(answer.size + size)
            await self._exactly(answer, size, take)
            if await self._line(answer):
                raise Malformed("chunk data longer than its size")

    async def _to_eof(self, answer: Answer, take: Callable[[int], None], max_body: int) -> None:
        while True:
            if self.buf:
                part = bytes(self.buf)
                self.buf.clear()
                if answer.size + len(part) > max_body:
                    raise TooLarge(answer.size + len(part))
                self._keep(answer, part, take)
            if not await self._fill(answer):
                return
