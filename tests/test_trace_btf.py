"""The BTF reader behind ``--socket-rw``'s kernel offsets: a hand-built BTF blob (anonymous unions,
bitfield-encoded offsets, typedefs, kinds it skips) and the running kernel's own BTF."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ingero.agent.trace import btf
from ingero.errors import TracingUnavailableError


def _blob() -> bytes:
    strings = b"\0int\0outer\0a\0b\0wanted\0inner_t\0late\0"

    def s(name: str) -> int:
        return strings.index(name.encode() + b"\0")

    types = b""

    def add(name_off: int, kind: int, vlen: int, size_or_type: int, extra: bytes = b"", kflag: int = 0) -> None:
        nonlocal types
        types += struct.pack("<III", name_off, kflag << 31 | kind << 24 | vlen, size_or_type) + extra

    add(s("int"), 1, 0, 4, struct.pack("<I", 32))  # 1: int
    add(0, 6, 2, 4, struct.pack("<Ii", s("a"), 0) + struct.pack("<Ii", s("b"), 1))  # 2: an enum (skipped)
    add(0, 5, 2, 8, struct.pack("<III", s("a"), 1, 0) + struct.pack("<III", s("wanted"), 1, 32))  # 3: anon union
    add(s("inner_t"), 8, 0, 3)  # 4: typedef of the union
    members = (
        struct.pack("<III", s("a"), 1, 0)
        + struct.pack("<III", 0, 4, 64)  # the anonymous member, through the typedef, at bit 64
        + struct.pack("<III", s("late"), 1, 3 << 24 | 192)  # kflag: bitfield size 3 in the high bits
    )
    add(s("outer"), 4, 3, 32, members, kflag=1)  # 5: struct outer
    hdr = struct.pack("<HBBIIIII", btf.MAGIC, 1, 0, 24, 0, len(types), len(types), len(strings))
    return hdr + types + strings


def test_offsets_through_anonymous_members_and_bitfield_encoding() -> None:
    b = btf.parse(_blob())
    assert b.offset("outer", "a") == 0
    assert b.offset("outer", "wanted") == 8 + 4  # the union at byte 8, the member 4 bytes into it
    assert b.offset("outer", "late") == 24
    with pytest.raises(TracingUnavailableError, match="no member nope"):
        b.offset("outer", "nope")
    with pytest.raises(TracingUnavailableError, match="no struct missing"):
        b.offset("missing", "a")


def test_not_btf_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(TracingUnavailableError, match="bad magic"):
        btf.parse(b"\0" * 64)
    with pytest.raises(TracingUnavailableError, match="cannot read the kernel's BTF"):
        btf.kernel_btf(tmp_path / "absent")


@pytest.mark.skipif(not btf.VMLINUX.exists(), reason="this kernel has no BTF")
def test_running_kernel_offsets() -> None:
    flags = dict(f[2:].split("=") for f in btf.offset_defines())
    assert set(flags) == {f"KOFF_{s}_{m}" for s, m in btf.SOCKET_RW_MEMBERS}
    # stable facts of struct fdtable and struct inode: max_fds and i_mode come first
    assert flags["KOFF_fdtable_max_fds"] == "0" and flags["KOFF_inode_i_mode"] == "0"
    assert flags["KOFF_fdtable_fd"] == "8" and int(flags["KOFF_task_struct_files"]) > 0
