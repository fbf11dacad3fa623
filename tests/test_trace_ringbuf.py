"""The bulk ring-buffer reader on memory laid out like the kernel's BPF ring buffer.

(The same reader on the real kernel ring buffer is exercised by the bpf tests.)
"""

from __future__ import annotations

import numpy as np

from ingero.agent.trace.ringbuf import BUSY_BIT, DISCARD_BIT, EVENT_DTYPE, EVENT_SIZE, HEADER_SIZE, RingReader

SIZE = 4096  # data bytes (a power of two)


class Ring:
    """Producer side: writes records the way the kernel does (data area mapped twice in a row)."""

    def __init__(self) -> None:
        self.cons = np.zeros(1, dtype=np.uint64)
        self.prod = np.zeros(1, dtype=np.uint64)
        self.data = np.zeros(2 * SIZE, dtype=np.uint8)
        self.reader = RingReader.over_memory(self.cons, self.prod, self.data, SIZE)
        self.seq = 0

    def _put(self, pos: int, raw: bytes) -> None:
        for i, b in enumerate(raw):
            p = (pos + i) % SIZE
            self.data[p] = b
            self.data[p + SIZE] = b

    def push(self, n: int = 1, *, flags: int = 0, length: int = EVENT_SIZE) -> list[int]:
        """Append n records (ts = a running sequence number); returns their header positions."""
        positions = []
        for _ in range(n):
            pos = int(self.prod[0])
            ev = np.zeros(1, dtype=EVENT_DTYPE)
            ev["ts"] = self.seq
            ev["pid"] = 4242
            ev["source"], ev["op"] = 4, 1
            body = ev.tobytes()[:length] + b"\0" * max(0, length - EVENT_SIZE)
            header = np.array([length | flags, 0], dtype=np.uint32).tobytes()
            self._put(pos, header + body)
            self.prod[0] = pos + ((length + HEADER_SIZE + 7) & ~7)
            positions.append(pos)
            self.seq += 1
        return positions

    def commit(self, pos: int) -> None:
        """Clear the BUSY bit of the record at ``pos`` (the kernel's bpf_ringbuf_submit)."""
        p = pos % SIZE
        word = int(self.data[p : p + 4].view(np.uint32)[0]) & ~BUSY_BIT
        self._put(pos, np.array([word], dtype=np.uint32).tobytes())


def test_reads_every_record_and_advances_the_consumer() -> None:
    ring = Ring()
    ring.push(10)
    ev = ring.reader.read()
    assert ev["ts"].tolist() == list(range(10))
    assert set(ev["pid"].tolist()) == {4242}
    assert int(ring.cons[0]) == int(ring.prod[0]) == 10 * (EVENT_SIZE + HEADER_SIZE)
    assert ring.reader.read().size == 0


def test_stops_at_a_record_still_being_written() -> None:
    ring = Ring()
    ring.push(3)
    (busy,) = ring.push(1, flags=BUSY_BIT)
    ring.push(2)
    assert ring.reader.read()["ts"].tolist() == [0, 1, 2]
    assert int(ring.cons[0]) == busy  # not past the busy one
    ring.commit(busy)
    assert ring.reader.read()["ts"].tolist() == [3, 4, 5]


def test_skips_discarded_and_odd_sized_records() -> None:
    ring = Ring()
    ring.push(2)
    ring.push(1, flags=DISCARD_BIT)
    ring.push(1, length=24)
    ring.push(2)
    assert ring.reader.read()["ts"].tolist() == [0, 1, 4, 5]
    assert ring.reader.odd_records == 2
    assert int(ring.cons[0]) == int(ring.prod[0])


def test_records_wrapping_around_the_end_are_whole() -> None:
    ring = Ring()
    per = EVENT_SIZE + HEADER_SIZE
    total = 0
    for _ in range(5):  # 5 x 50 records of 72 bytes through a 4 KiB ring: wraps several times
        ring.push(50)
        ev = ring.reader.read()
        assert ev["ts"].tolist() == list(range(total, total + 50))
        assert set(ev["source"].tolist()) == {4}
        total += 50
    assert int(ring.cons[0]) == total * per > 4 * SIZE


def test_max_records_leaves_the_rest_for_the_next_read() -> None:
    ring = Ring()
    ring.push(20)
    assert ring.reader.read(max_records=8)["ts"].tolist() == list(range(8))
    assert ring.reader.read()["ts"].tolist() == list(range(8, 20))


def test_peek_leaves_the_records_for_read_and_gives_only_new_ones_next_time() -> None:
    ring = Ring()
    ring.push(3)
    seen, pos = ring.reader.peek(0)
    assert seen["ts"].tolist() == [0, 1, 2]
    assert int(ring.cons[0]) == 0  # nothing consumed
    ring.push(2)
    seen, pos = ring.reader.peek(pos)
    assert seen["ts"].tolist() == [3, 4]  # only what came since the last look
    assert ring.reader.peek(pos)[0].size == 0
    assert ring.reader.read()["ts"].tolist() == [0, 1, 2, 3, 4]  # read still gets every record
    ring.push(1)
    assert ring.reader.peek(0)[0]["ts"].tolist() == [5]  # never behind the consumer
