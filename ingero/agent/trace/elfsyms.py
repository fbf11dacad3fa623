"""A small ELF64 reader: function symbols, file offsets and prologues — no bcc, no pyelftools.

Used to decide where a uprobe goes (the file offset of a function, +4 past an ``endbr64`` so the
kernel emulates the ``push %rbp`` instead of single-stepping ~10x slower), to tell ``ingero check``
which GPU functions a library exports, and to symbolize user stacks (:mod:`ingero.agent.trace.stacks`).
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from typing import BinaryIO

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_SYM = struct.Struct("<IBBHQQ")
_PT_LOAD = 1
_SHT_SYMTAB = 2
_SHT_DYNSYM = 11
_STT_FUNC = 2
_STT_GNU_IFUNC = 10
_SHN_UNDEF = 0
ENDBR64 = b"\xf3\x0f\x1e\xfa"
PUSH_RBP = 0x55


class ElfError(Exception):
    """Not a readable little-endian ELF64 file."""


@dataclass(frozen=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int
    memsz: int
    executable: bool


@dataclass
class ElfImage:
    """Function symbols and loadable segments of one ELF file."""

    path: str
    elf_type: int  # 2 = ET_EXEC, 3 = ET_DYN
    segments: list[Segment]
    symbols: dict[str, tuple[int, int]]  # name -> (vaddr, size), functions only
    sections: dict[str, int] = field(default_factory=dict)  # section name -> vaddr (e.g. ".PyRuntime")
    _starts: list[int] = field(default_factory=list, repr=False)
    _entries: list[tuple[int, int, str]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        by_addr: dict[int, tuple[int, int, str]] = {}
        for name, (addr, size) in self.symbols.items():
            old = by_addr.get(addr)
            # Prefer the sized, shortest, non-underscore name for an address (aliases: pnccl vs nccl).
            if old is None or (size, -len(name)) > (old[1], -len(old[2])):
                by_addr[addr] = (addr, size, name)
        self._entries = sorted(by_addr.values())
        self._starts = [e[0] for e in self._entries]

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        for s in self.segments:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return vaddr - s.vaddr + s.offset
        return None

    def offset_to_vaddr(self, offset: int) -> int | None:
        for s in self.segments:
            if s.offset <= offset < s.offset + max(s.filesz, 1):
                return offset - s.offset + s.vaddr
        return None

    def symbolize(self, vaddr: int) -> tuple[str, int] | None:
        """(function, offset) containing ``vaddr``, or None."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        addr, size, name = self._entries[i]
        off = vaddr - addr
        if off < size or (size == 0 and off < 4096):
            return name, off
        return None

    def function_offset(self, name: str) -> int | None:
        """File offset of a function's first byte (what a uprobe attaches to)."""
        sym = self.symbols.get(name)
        if sym is None:
            return None
        return self.vaddr_to_offset(sym[0])


def _read_exact(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ElfError("truncated ELF file")
    return data


def _parse(path: str) -> ElfImage:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise ElfError(f"cannot read {path}: {e.strerror}") from None
    with fh:
        head = fh.read(_EHDR.size)
        if len(head) < _EHDR.size or head[:4] != b"\x7fELF":
            raise ElfError(f"{path} is not an ELF file")
        if head[4] != 2 or head[5] != 1:
            raise ElfError(f"{path} is not a little-endian 64-bit ELF file")
        (_, e_type, _, _, _, e_phoff, e_shoff, _, _, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx) = (
            _EHDR.unpack(head)
        )
        segments: list[Segment] = []
        if e_phoff and e_phnum:
            raw = _read_exact(fh, e_phoff, e_phentsize * e_phnum)
            for i in range(e_phnum):
                p_type, p_flags, p_offset, p_vaddr, _, p_filesz, p_memsz, _ = _PHDR.unpack_from(raw, i * e_phentsize)
                if p_type == _PT_LOAD:
                    segments.append(Segment(p_vaddr, p_offset, p_filesz, p_memsz, bool(p_flags & 1)))
        symbols: dict[str, tuple[int, int]] = {}
        named: dict[str, int] = {}
        if e_shoff and e_shnum:
            raw = _read_exact(fh, e_shoff, e_shentsize * e_shnum)
            sections = [_SHDR.unpack_from(raw, i * e_shentsize) for i in range(e_shnum)]
            if e_shstrndx < len(sections):  # section names: where an interpreter keeps its runtime state
                shstr = _read_exact(fh, sections[e_shstrndx][4], sections[e_shstrndx][5])
                for sh in sections:
                    end = shstr.find(b"\0", sh[0])
                    named[shstr[sh[0] : end if end >= 0 else None].decode(errors="replace")] = sh[3]
            # .dynsym first, then .symtab: the full table (unstripped builds) wins on duplicates.
            for wanted in (_SHT_DYNSYM, _SHT_SYMTAB):
                for sh in sections:
                    if sh[1] != wanted or sh[9] == 0:
                        continue
                    strtab = sections[sh[6]] if sh[6] < len(sections) else None
                    if strtab is None:
                        continue
                    names = _read_exact(fh, strtab[4], strtab[5])
                    table = _read_exact(fh, sh[4], sh[5])
                    _collect(table, names, sh[9], symbols)
    return ElfImage(path, e_type, segments, symbols, named)


def _collect(table: bytes, names: bytes, entsize: int, out: dict[str, tuple[int, int]]) -> None:
    if entsize != _SYM.size:
        return
    for st_name, st_info, _, st_shndx, st_value, st_size in _SYM.iter_unpack(table[: len(table) - len(table) % 24]):
        kind = st_info & 0xF
        if kind not in (_STT_FUNC, _STT_GNU_IFUNC) or st_shndx == _SHN_UNDEF or st_value == 0:
            continue
        end = names.find(b"\0", st_name)
        name = names[st_name:end].decode("utf-8", "replace")
        if "@" in name:  # versioned .symtab names: cudaMalloc@@libcudart.so.12
            name = name.split("@", 1)[0]
        if name:
            out[name] = (st_value, st_size)


@lru_cache(maxsize=256)
def _cached(path: str, dev: int, ino: int, mtime_ns: int) -> ElfImage:
    return _parse(path)


def load(path: str) -> ElfImage:
    """Parse (and cache, keyed by inode and mtime) the ELF file at ``path``."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ElfError(f"cannot read {path}: {e.strerror}") from None
    return _cached(path, st.st_dev, st.st_ino, st.st_mtime_ns)


def probe_offset(image: ElfImage, name: str) -> tuple[int, str] | None:
    """Where to put a uprobe for ``name``: (file offset, first instruction kind), or None if absent.

    The kernel emulates ``push %rbp`` (~1 µs per hit) but single-steps most other first instructions
    (~11 µs here). A function that starts with ``endbr64`` is probed 4 bytes in (on its ``push`` in
    compiler-generated code); the return address is still on top of the stack there, so arguments and
    uretprobes work the same.
    """
    off = image.function_offset(name)
    if off is None:
        return None
    try:
        with open(image.path, "rb") as f:
            f.seek(off)
            head = f.read(5)
    except OSError:
        return off, "unknown"
    if head[:4] == ENDBR64:
        return off + 4, "endbr64+push" if head[4:5] == bytes([PUSH_RBP]) else "endbr64"
    if head[:1] == bytes([PUSH_RBP]):
        return off, "push"
    return off, "other"
