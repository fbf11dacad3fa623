"""A small ELF64 reader: function symbols, file offsets and prologues — no bcc, no pyelftools.

Used to decide where a uprobe goes (:func:`probe_offset`: the function's first instruction the kernel
emulates, past an ``endbr64`` and the like, instead of single-stepping it ~10x slower), for the GPU
libraries and libc's socket calls alike, to tell ``ingero check`` which GPU functions a library
exports, and to symbolize user stacks (:mod:`ingero.agent.trace.stacks`).
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
# Leading instructions a probe may be placed after: they touch neither the stack pointer (the return
# address stays on top, for the uretprobe and the frame match) nor an argument register (rdi, rsi, rdx,
# rcx, r8, r9; rax is none). glibc's sendto starts with `cmpb $0, __libc_single_threaded(%rip)`, which
# the kernel would single-step; the jcc after it is emulated.
_SKIPPABLE = (
    (ENDBR64, 4, "endbr64"),
    (b"\x80\x3d", 7, "cmpb"),  # cmpb $imm8, rel32(%rip)
    (b"\x83\x3d", 7, "cmpl"),  # cmpl $imm8, rel32(%rip)
    (b"\x64\x8b\x04\x25", 8, "mov"),  # mov %fs:disp32, %eax
    (b"\x85\xc0", 2, "test"),  # test %eax, %eax
    (b"\x41\x89\xca", 3, "mov"),  # mov %ecx, %r10d
    (b"\x49\x89\xca", 3, "mov"),  # mov %rcx, %r10
)
_MAX_SKIPPED = 5
_PROLOGUE_BYTES = 48  # read at a function's start: every skippable instruction and the one after


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


def _emulated(code: bytes) -> str | None:
    """The kind of instruction ``code`` starts with when the kernel executes it without single-stepping
    (jcc / jmp with rel8 or rel32, push of a register), else None."""
    op = code[0]
    if 0x50 <= op <= 0x57 or (op == 0x41 and 0x50 <= code[1] <= 0x57):
        return "push"
    if 0x70 <= op <= 0x7F or (op == 0x0F and 0x80 <= code[1] <= 0x8F):
        return "jcc"
    if op in (0xEB, 0xE9):
        return "jmp"
    return None


def probe_offset(image: ElfImage, name: str) -> tuple[int, str] | None:
    """Where to put a uprobe for ``name``: (file offset, what it sits on), or None if absent.

    The kernel emulates ``push``, ``jmp`` and ``jcc`` (~1 µs per hit) but single-steps most other
    instructions (~11 µs here). The probe goes on the function's first emulated instruction when only
    :data:`_SKIPPABLE` ones precede it (``endbr64+push``: 4 bytes in, on the ``push`` of
    compiler-generated code; ``endbr64+cmpb+jcc``: glibc's sendto), else on its first byte
    (``other``). The return address is still on top of the stack there and the arguments in their
    registers, so argument reads and uretprobes work the same.
    """
    start = image.function_offset(name)
    if start is None:
        return None
    try:
        with open(image.path, "rb") as f:
            code = os.pread(f.fileno(), _PROLOGUE_BYTES, start)
    except OSError:
        return start, "unknown"
    at = 0
    skipped: list[str] = []
    for _ in range(_MAX_SKIPPED + 1):
        if len(code) - at < 2:
            break
        kind = _emulated(code[at:])
        if kind is not None:
            return start + at, "+".join((*skipped, kind))
        step = next(((n, what) for prefix, n, what in _SKIPPABLE if code[at:].startswith(prefix)), None)
        if step is None:
            break
        at += step[0]
        skipped.append(step[1])
    return start, "other"
