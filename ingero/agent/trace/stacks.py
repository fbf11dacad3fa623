"""User stacks: Ingero-compatible hashing and symbolization into ``stack_traces`` rows.

* ``stack_traces.hash`` is FNV-1a 64 over the raw IPs, each as 8 little-endian bytes — Ingero's
  ``HashStackIPs`` — stored as a signed 64-bit integer (SQLite's INTEGER), as Ingero does.
* ``ips`` is the JSON array of hex IPs (``["0x7f1234", ...]``).
* ``frames`` is compact JSON, one object per IP: ``{"s": "cudaMalloc+0x1cb", "f": "libcudart.so.12"}``
  when a function symbol covers the IP, ``{"i": "0x7f1234", "f": "libfoo.so"}`` when only the file is
  known, ``{"i": "0x7f1234"}`` when nothing is. Symbols come from each file's ``.symtab``/``.dynsym``
  (:mod:`ingero.agent.trace.elfsyms`) through the process's ``/proc/<pid>/maps``, read while it runs.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
from collections.abc import Sequence

from ingero.agent.trace import elfsyms
from ingero.agent.trace.procmaps import Mapping, read_maps
from ingero.agent.trace.pyframes import PyFrames, insert_python

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    h = FNV64_OFFSET
    for b in data:
        h = ((h ^ b) * FNV64_PRIME) & _MASK64
    return h


def to_signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def stack_hash(ips: Sequence[int]) -> int:
    """Ingero's stack hash (FNV-1a 64 of the IPs as little-endian u64s), as a signed int64."""
    return to_signed64(fnv1a64(struct.pack(f"<{len(ips)}Q", *ips)))


def ips_json(ips: Sequence[int]) -> str:
    return json.dumps([f"0x{ip:x}" for ip in ips], separators=(",", ":"))


def frames_json(frames: Sequence[dict[str, str]]) -> str:
    return json.dumps(list(frames), separators=(",", ":"), ensure_ascii=False)


class Symbolizer:
    """Turns (pid, ips) into frame dicts. Caches each process's maps and each IP's frame."""

    def __init__(self, max_cached_frames: int = 200_000, *, python: PyFrames | None = None) -> None:
        self.python = python  # Python frames of CPython threads (ingero.agent.trace.pyframes); None: off
        self._maps: dict[int, tuple[list[int], list[Mapping]]] = {}
        self._frames: dict[tuple[int, int], dict[str, str]] = {}
        self._max = max_cached_frames

    def forget(self, pid: int) -> None:
        self._maps.pop(pid, None)
        if self.python is not None:
            self.python.forget(pid)

    def prime(self, pid: int) -> None:
        """Read ``pid``'s maps now, if not yet known: called when its first stacks are drained, while it
        most likely lives, so that they are symbolized when written even if it exited meanwhile."""
        if pid not in self._maps and (maps := read_maps(pid)):
            self._maps[pid] = ([m.start for m in maps], maps)

    def _mapping(self, pid: int, ip: int, *, refresh: bool = True) -> Mapping | None:
        entry = self._maps.get(pid)
        if entry is None:
            maps = read_maps(pid)
            entry = ([m.start for m in maps], maps)
            self._maps[pid] = entry
        starts, maps = entry
        i = bisect.bisect_right(starts, ip) - 1
        if i >= 0 and maps[i].start <= ip < maps[i].end:
            return maps[i]
        if refresh and maps and (fresh := read_maps(pid)):  # dlopen'ed since we read them (gone: keep them)
            self._maps[pid] = ([m.start for m in fresh], fresh)
            return self._mapping(pid, ip, refresh=False)
        return None

    def frame(self, pid: int, ip: int) -> dict[str, str]:
        key = (pid, ip)
        cached = self._frames.get(key)
        if cached is not None:
            return cached
        frame = self._resolve(pid, ip)
        if len(self._frames) >= self._max:
            self._frames.clear()
        self._frames[key] = frame
        return frame

    def _resolve(self, pid: int, ip: int) -> dict[str, str]:
        hexip = f"0x{ip:x}"
        m = self._mapping(pid, ip)
        if m is None:
            return {"i": hexip}
        base = os.path.basename(m.path.removesuffix(" (deleted)")) if m.path.startswith("/") else m.path
        if not m.reachable:
            return {"i": hexip, "f": base} if base else {"i": hexip}
        try:
            image = elfsyms.load(m.reachable)
        except elfsyms.ElfError:
            return {"i": hexip, "f": base}
        vaddr = image.offset_to_vaddr(ip - m.start + m.offset)
        hit = image.symbolize(vaddr) if vaddr is not None else None
        if hit is None:
            return {"i": hexip, "f": base}
        name, off = hit
        return {"s": f"{name}+0x{off:x}", "f": base}

    def frames(self, pid: int, ips: Sequence[int]) -> list[dict[str, str]]:
        return [self.frame(pid, ip) for ip in ips]


def stack_row(pid: int, ips: Sequence[int], symbolizer: Symbolizer, tid: int = 0) -> tuple[int, str, str]:
    """A ``stack_traces`` row: (hash, ips JSON, frames JSON); with the thread ``tid`` and Python frames
    on, the thread's ``[Python] file:line in function()`` frames beside the native ones."""
    frames = symbolizer.frames(pid, ips)
    if tid and symbolizer.python is not None:
        frames = insert_python(frames, symbolizer.python.frames(pid, tid))
    return stack_hash(ips), ips_json(ips), frames_json(frames)
