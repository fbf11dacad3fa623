"""Source lines from CPython code objects' line tables, as the interpreter itself maps them.

* 3.11+ ``co_linetable`` (PEP 626/657 location table, ``Objects/locations.md``): :func:`line_of`,
  indexed by code unit;
* 3.10 ``co_linetable`` (``Objects/lnotab_notes.txt``: pairs of an unsigned byte-offset delta and a
  signed line delta, -128 = no line): :func:`line_of_310`, indexed by byte offset, following
  ``PyCode_Addr2Line``.
"""

from __future__ import annotations


def _varint(data: bytes, i: int) -> tuple[int, int]:
    b = data[i]
    i += 1
    value, shift = b & 63, 6
    while b & 64:
        b = data[i]
        i += 1
        value |= (b & 63) << shift
        shift += 6
    return value, i


def _svarint(data: bytes, i: int) -> tuple[int, int]:
    u, i = _varint(data, i)
    return (-(u >> 1) if u & 1 else u >> 1), i


def line_of(table: bytes, firstlineno: int, index: int) -> int:
    """Source line of code unit ``index`` from a 3.11+ location table (Objects/locations.md)."""
    line, unit, i = firstlineno, 0, 0
    try:
        while i < len(table):
            head = table[i]
            i += 1
            code, length = (head >> 3) & 15, (head & 7) + 1
            delta: int | None = 0
            if code == 15:  # no location
                delta = None
            elif code == 14:  # long form: line delta, end line delta, column, end column
                delta, i = _svarint(table, i)
                _, i = _varint(table, i)
                _, i = _varint(table, i)
                _, i = _varint(table, i)
            elif code == 13:  # no column
                delta, i = _svarint(table, i)
            elif code >= 10:  # one-line forms: the line delta is the code - 10, then 2 column bytes
                delta = code - 10
                i += 2
            else:  # short form: same line, one column byte
                i += 1
            if delta is not None:
                line += delta
            if unit <= index < unit + length:
                return line
            unit += length
    except IndexError:
        pass
    return line


def line_of_310(table: bytes, firstlineno: int, offset: int) -> int:
    """Source line of byte offset ``offset`` (``f_lasti * 2``) from a 3.10 line table; the first line
    when the offset has none (before the first instruction, or an entry marked -128)."""
    if offset < 0:
        return firstlineno
    line, end = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        start, end = end, end + table[i]
        delta = table[i + 1] - 256 if table[i + 1] >= 128 else table[i + 1]
        current = -1
        if delta != -128:
            line += delta
            current = line
        if start <= offset < end:
            return current if current >= 0 else firstlineno
    return firstlineno
