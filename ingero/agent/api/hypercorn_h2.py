"""A guard for hypercorn's HTTP/2: request data for a stream it already answered must not end the server.

hypercorn 0.18 (the latest release) looks a DATA frame's stream up without checking that it still exists
(``hypercorn/protocol/h2.py``, ``_handle_events``). A stream is gone once its response is sent, so a
request whose body arrives after the answer — any refusal sent before reading the body (401 before
login, 429) — raises ``KeyError`` there; under trio that error leaves the connection's task group, then
the listener's nursery, and the whole server exits: one request without credentials stopped the
dashboard (reported upstream as pgjones/hypercorn#197 and #329; the fixes, #312 and #334, are not
released). hypercorn already ignores ``StreamEnded`` for such a stream; :func:`install` does the same
for ``DataReceived``, as those fixes do, still acknowledging the data's flow-control window.
"""

from __future__ import annotations

from typing import Any

MARK = "_ingero_closed_stream_guard"


def install() -> None:
    """Patch hypercorn's HTTP/2 event loop once (idempotent): events go one at a time to hypercorn's own
    handler, except data for a stream it no longer has, which is acknowledged and dropped."""
    import h2.events
    from hypercorn.protocol.h2 import H2Protocol

    if getattr(H2Protocol, MARK, False):
        return

    original = H2Protocol._handle_events

    async def handle_events(self: Any, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                # the stream was answered and closed: nothing reads this body (h2 acknowledges a closed
                # stream's data on the connection's window only)
                self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            await original(self, [event])  # checked per event: an earlier one may close the stream

    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]
    setattr(H2Protocol, MARK, True)
