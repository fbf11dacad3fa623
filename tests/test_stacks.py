"""Stack hashing (Ingero-compatible FNV-1a 64 of the IPs) and symbolization through /proc/<pid>/maps."""

from __future__ import annotations

import ctypes
import json
import os
import struct

from ingero.agent.trace.stacks import (
    Symbolizer,
    fnv1a64,
    frames_json,
    ips_json,
    read_maps,
    stack_hash,
    stack_row,
    to_signed64,
)


def test_fnv1a64_reference_vectors() -> None:
    # From the FNV reference test suite (FNV-1a, 64 bit).
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_stack_hash_is_fnv_of_little_endian_ips_as_signed_int64() -> None:
    ips = [0x7AC1C9E47F0E, 0x7AC1C9E16B83, 0x55D0DEADBEEF]
    raw = b"".join(struct.pack("<Q", ip) for ip in ips)
    assert stack_hash(ips) == to_signed64(fnv1a64(raw))
    assert -(1 << 63) <= stack_hash(ips) < 1 << 63
    assert stack_hash(ips) != stack_hash(list(reversed(ips)))
    assert to_signed64(0xFFFFFFFFFFFFFFFF) == -1 and to_signed64(5) == 5


def test_json_forms_are_compact() -> None:
    assert ips_json([0x10, 0xABC]) == '["0x10","0xabc"]'
    assert frames_json([{"s": "cudaMalloc+0x1cb", "f": "libcudart.so.12"}, {"i": "0x7f"}]) == (
        '[{"s":"cudaMalloc+0x1cb","f":"libcudart.so.12"},{"i":"0x7f"}]'
    )


def test_symbolizes_addresses_of_this_process() -> None:
    libc = ctypes.CDLL(None)
    getpid = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    malloc = ctypes.cast(libc.malloc, ctypes.c_void_p).value
    assert getpid and malloc
    sym = Symbolizer()
    pid = os.getpid()
    assert sym.frame(pid, getpid) == {"s": "getpid+0x0", "f": "libc.so.6"}
    assert sym.frame(pid, malloc + 3) == {"s": "malloc+0x3", "f": "libc.so.6"}
    # An address in no mapping: only the IP.
    assert sym.frame(pid, 0x10) == {"i": "0x10"}
    h, ips, frames = stack_row(pid, [getpid, 0x10], sym)
    assert h == stack_hash([getpid, 0x10])
    assert json.loads(frames) == [{"s": "getpid+0x0", "f": "libc.so.6"}, {"i": "0x10"}]
    assert json.loads(ips) == [f"0x{getpid:x}", "0x10"]


def test_gone_process_keeps_raw_ips() -> None:
    sym = Symbolizer()
    assert sym.frame(2**22 + 12345, 0x7F0000001000) == {"i": "0x7f0000001000"}


def test_read_maps_lists_files_and_pseudo_mappings() -> None:
    maps = read_maps(os.getpid())
    paths = {m.path for m in maps}
    assert any(p.endswith("libc.so.6") for p in paths)
    assert "[stack]" in paths
    assert all(m.start < m.end for m in maps)
    assert [m.start for m in maps] == sorted(m.start for m in maps)
    assert read_maps(2**22 + 12345) == []


def test_maps_primed_while_a_process_lives_symbolize_its_stacks_after_it_exited() -> None:
    """The drain primes the maps of a process whose stacks it just read; written later, after the process
    exited, its frames still name their file. Unprimed, they are raw IPs; an IP the primed maps do not
    cover (read again: gone) does not throw the primed maps away."""
    import subprocess
    import time

    proc = subprocess.Popen(["sleep", "30"])
    try:
        for _ in range(500):  # Popen returns once the exec began: the binary is mapped just after
            main = next((m for m in read_maps(proc.pid) if m.path.endswith("/sleep")), None)
            if main is not None:
                break
            time.sleep(0.01)
        assert main is not None
        primed, unprimed = Symbolizer(), Symbolizer()
        primed.prime(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    ip = main.start + 0x10
    assert unprimed.frame(proc.pid, ip) == {"i": f"0x{ip:x}"}
    assert primed.frame(proc.pid, 0x10) == {"i": "0x10"}  # not mapped: read again, gone
    assert primed.frame(proc.pid, ip)["f"] == "sleep"
