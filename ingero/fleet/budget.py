"""How much memory one fan-out may spend on the nodes' answers: a per-answer cap and a shared budget.

A per-node cap alone does not bound a fan-out: 1,000 nodes each sending just under the cap would
still exhaust the laptop. :class:`AnswerBudget` is one byte budget shared by every node of a fan-out.
The transport charges each chunk of an answer as it arrives (:meth:`AnswerBudget.take`); a node whose
chunk does not fit ends as its own ``too_large`` outcome, its bytes are given back at once, and the
other nodes go on. Bytes of answers that were kept stay charged until the fan-out ends (the merged
rows live that long).

JSON grows when parsed — ``[[0],[0],...]`` is 4 bytes of text but ~70 bytes of Python objects per
row — so before a body is parsed, the growth is estimated from its bytes (:func:`parsed_size`,
a few ``bytes.count`` passes at C speed) and charged too: a hostile node cannot sneak a parsed
gigabyte through a 16 MiB answer.
"""

from __future__ import annotations

MIB = 1024 * 1024
# An agent caps its /query answer at 8 MiB of values (ingero.store.budget.MAX_RESPONSE_BYTES); JSON
# quoting and the envelope add to that, so one answer may be twice as large.
MAX_ANSWER_BYTES = 16 * MIB
# Shared by all nodes of one fan-out: raw answer bytes plus their estimated parsed size.
MAX_TOTAL_BYTES = 256 * MIB

# Bytes of Python objects per JSON token, beyond the token's own text (CPython 3.11, 64-bit):
# a list/dict (56+ bytes plus 8 per slot), a str (~49 bytes header), a number (24–32 bytes).
_PER_CONTAINER = 72
_PER_STRING = 25  # per quote character: half of a str header per quote
_PER_ITEM = 32  # per separator: a slot pointer plus a number object


class BudgetExceeded(Exception):
    """A charge did not fit the shared budget (nothing was charged)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"answer budget of {limit} bytes spent")
        self.limit = limit


class AnswerBudget:
    """A byte budget shared by every node of a fan-out (single trio thread: no locking needed)."""

    def __init__(self, limit: int = MAX_TOTAL_BYTES) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self.peak = 0

    def take(self, n: int) -> None:
        """Charge ``n`` bytes, or raise :class:`BudgetExceeded` without charging."""
        if self.used + n > self.limit:
            raise BudgetExceeded(self.limit)
        self.used += n
        self.peak = max(self.peak, self.used)

    def give_back(self, n: int) -> None:
        self.used = max(0, self.used - n)

    @property
    def left(self) -> int:
        return self.limit - self.used


def parsed_size(body: bytes) -> int:
    """An upper-bound-ish estimate of the Python objects ``json.loads(body)`` builds, in bytes."""
    if len(body) < 4096:
        return len(body) * 16  # small answers: not worth counting
    containers = body.count(b"[") + body.count(b"{")
    return (
        len(body)
        + _PER_CONTAINER * containers
        + _PER_STRING * body.count(b'"')
        + _PER_ITEM * (body.count(b",") + body.count(b":"))
    )
