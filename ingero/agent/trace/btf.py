"""Kernel struct member offsets from the running kernel's BTF (``/sys/kernel/btf/vmlinux``).

bcc compiles against the installed kernel headers, which need not match the running kernel (here
Debian's headers beside a different kernel), so a probe that reads kernel structs through those headers
reads the wrong offsets. The few reads the probes make (``--socket-rw``: task → files → fdtable → file
→ inode) take their offsets from the kernel's own type information instead, passed to the C as
``-DKOFF_<struct>_<member>=<bytes>`` flags.

A minimal reader of the BTF format (``include/uapi/linux/btf.h``): the type section is walked once,
keeping struct and union members; a member found inside an anonymous struct or union counts with that
member's offset added.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ingero.errors import TracingUnavailableError

VMLINUX = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F
KIND_STRUCT, KIND_UNION = 4, 5
# kind -> bytes after the 12-byte btf_type: (fixed, per vlen item)
_EXTRA: dict[int, tuple[int, int]] = {
    1: (4, 0),  # INT
    2: (0, 0),  # PTR
    3: (12, 0),  # ARRAY
    4: (0, 12),  # STRUCT
    5: (0, 12),  # UNION
    6: (0, 8),  # ENUM
    7: (0, 0),  # FWD
    8: (0, 0),  # TYPEDEF
    9: (0, 0),  # VOLATILE
    10: (0, 0),  # CONST
    11: (0, 0),  # RESTRICT
    12: (0, 0),  # FUNC
    13: (0, 8),  # FUNC_PROTO
    14: (4, 0),  # VAR
    15: (0, 12),  # DATASEC
    16: (0, 0),  # FLOAT
    17: (4, 0),  # DECL_TAG
    18: (0, 0),  # TYPE_TAG
    19: (0, 12),  # ENUM64
}
# The kernel members the probes read: (struct, member) -> the -D flag's name
SOCKET_RW_MEMBERS = (
    ("task_struct", "files"),
    ("files_struct", "fdt"),
    ("fdtable", "max_fds"),
    ("fdtable", "fd"),
    ("file", "f_inode"),
    ("inode", "i_mode"),
)


@dataclass(frozen=True)
class Member:
    name: str
    type_id: int
    bit_offset: int


@dataclass
class Btf:
    names: dict[int, str]  # struct/union type id -> name ("" when anonymous)
    members: dict[int, list[Member]]  # struct/union type id -> members
    by_name: dict[str, int]  # named struct -> its type id (the first one)
    resolve: dict[int, int]  # typedef/const/volatile/type_tag id -> the type it names

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of ``member`` in ``struct struct_name`` (found in anonymous sub-structs too)."""
        tid = self.by_name.get(struct_name)
        if tid is None:
            raise TracingUnavailableError(f"the kernel's BTF has no struct {struct_name}")
        found = self._find(tid, member)
        if found is None:
            raise TracingUnavailableError(f"the kernel's BTF has no member {member} in struct {struct_name}")
        return found // 8

    def _find(self, tid: int, member: str) -> int | None:
        for m in self.members.get(tid, []):
            if m.name == member:
                return m.bit_offset
            if not m.name:  # an anonymous struct or union: its members count as this one's
                inner = self._find(self._strip(m.type_id), member)
                if inner is not None:
                    return m.bit_offset + inner
        return None

    def _strip(self, tid: int) -> int:
        for _ in range(16):
            if tid not in self.resolve:
                return tid
            tid = self.resolve[tid]
        return tid


def parse(data: bytes) -> Btf:
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, _str_len = struct.unpack_from("<HBBIIIII", data)
    if magic != MAGIC:
        raise TracingUnavailableError("not a BTF file (bad magic)")
    types = hdr_len + type_off
    strings = hdr_len + str_off

    def name(off: int) -> str:
        end = data.index(b"\0", strings + off)
        return data[strings + off : end].decode()

    out = Btf({}, {}, {}, {})
    pos, end, tid = types, types + type_len, 1
    while pos < end:
        name_off, info, size_or_type = struct.unpack_from("<III", data, pos)
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        if kind not in _EXTRA:
            raise TracingUnavailableError(f"unknown BTF kind {kind}")
        fixed, per = _EXTRA[kind]
        body = pos + 12 + fixed
        if kind in (KIND_STRUCT, KIND_UNION):
            members = []
            for i in range(vlen):
                m_name, m_type, m_off = struct.unpack_from("<III", data, body + 12 * i)
                members.append(Member(name(m_name), m_type, m_off & 0xFFFFFF if kflag else m_off))
            n = name(name_off)
            out.names[tid], out.members[tid] = n, members
            if n:
                out.by_name.setdefault(n, tid)
        elif kind in (8, 9, 10, 18):  # typedef, volatile, const, type_tag
            out.resolve[tid] = size_or_type
        pos = body + per * vlen
        tid += 1
    return out


@cache
def kernel_btf(path: Path = VMLINUX) -> Btf:
    try:
        return parse(path.read_bytes())
    except OSError as e:
        raise TracingUnavailableError(
            f"cannot read the kernel's BTF ({path}: {e.strerror})", hint="a kernel built with CONFIG_DEBUG_INFO_BTF=y"
        ) from None


def offset_defines(members: tuple[tuple[str, str], ...] = SOCKET_RW_MEMBERS, path: Path = VMLINUX) -> list[str]:
    """``-DKOFF_<struct>_<member>=<bytes>`` for each member, from the running kernel's BTF."""
    btf = kernel_btf(path)
    return [f"-DKOFF_{s}_{m}={btf.offset(s, m)}" for s, m in members]
