"""The ASGI types, the lifespan answer and the capped body reader shared by every ingero HTTP app (agent API,
tools API, dashboard)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ingero.errors import BodyTooLargeError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the server's start-up and shutdown (nothing to set up)."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Receive, limit: int, too_large: str, gone: Callable[[], Exception]) -> bytes:
    """The request's body, refused with ``BodyTooLargeError(too_large)`` from the chunk that takes it past
    ``limit`` bytes (the rest is never read); ``gone()`` is raised if the client disconnects first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise gone()
        if msg["type"] != "http.request":
            continue
        part: bytes = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise BodyTooLargeError(too_large)
        chunks.append(part)
        if not msg.get("more_body", False):
            return b"".join(chunks)
