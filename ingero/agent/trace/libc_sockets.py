"""Where libc's socket calls are probed: which functions, at which instruction, in which file.

The agent records a traced process's socket calls with uprobes on its libc (net_probes.c), attached
to that process alone (:meth:`ingero.agent.trace.probes.BpfProbes.attach_sockets`), each at the
instruction :func:`ingero.agent.trace.elfsyms.probe_offset` picks (as the GPU libraries' are). This
module holds the pure part: no bcc here.

A failed call returns -1 and leaves its errno in the thread's TLS. The return probe reads it there:
``thread pointer + errno's offset``, where the thread pointer is the thread's FS base (x86-64, kept
in ``task_struct.thread.fsbase``: :data:`FSBASE_MEMBERS`) and the offset is fixed per process once
the dynamic linker has laid out the static TLS blocks — it is in the process's GOT slot that
glibc's ``__errno_location`` loads (:func:`errno_tp_offset`).
"""

from __future__ import annotations

import os

from ingero.agent.trace import elfsyms, procmaps

# libc's socket calls -> the entry program (net_probes.c); each has net_return at its return. Attached
# to the traced processes only (attach_sockets), never host-wide.
SOCKET_FUNCTIONS = (
    ("send", "net_enter_send"),
    ("sendto", "net_enter_send"),
    ("sendmsg", "net_enter_send"),
    ("recv", "net_enter_recv"),
    ("recvfrom", "net_enter_recv"),
    ("recvmsg", "net_enter_recv"),
)
SOCKET_RETURN = "net_return"

# task_struct.thread.fsbase: the thread pointer of a task (x86-64), for the return probe (net_probes.c)
FSBASE_MEMBERS = (("task_struct", "thread"), ("thread_struct", "fsbase"))
# glibc's __errno_location on x86-64: [endbr64] mov GOT(%rip), %rax; add %fs:0, %rax; ret. The GOT slot
# holds errno's offset from the thread pointer (an R_X86_64_TPOFF64 the dynamic linker fills at load).
_MOV_RIP_RAX = b"\x48\x8b\x05"  # + rel32
_ADD_FS0_RAX = b"\x64\x48\x03\x04\x25\x00\x00\x00\x00"
_MAX_TLS = 1 << 20  # the static TLS blocks sit just below the thread pointer (variant II): a few KiB


def _libc_mapping(pid: int) -> procmaps.Mapping | None:
    """The lowest mapping of the libc ``pid`` maps (its path as the process sees it)."""
    for m in procmaps.read_maps(pid):
        base = m.path.rsplit("/", 1)[-1]
        if m.path.startswith("/") and (base.startswith("libc.so") or base.startswith("libc-")):
            return m
    return None


def libc_of(pid: int) -> str | None:
    """The libc file ``pid`` maps, through its root (a container's own libc), or None."""
    m = _libc_mapping(pid)
    return None if m is None else f"/proc/{pid}/root{m.path}"


def errno_got_vaddr(image: elfsyms.ElfImage) -> int | None:
    """The link-time address of the GOT slot holding errno's TLS offset, from ``__errno_location``'s
    code; None when the function is missing or not of glibc's x86-64 shape (another libc, another arch)."""
    start = image.function_offset("__errno_location")
    if start is None:
        return None
    try:
        with open(image.path, "rb") as f:
            code = os.pread(f.fileno(), 32, start)
    except OSError:
        return None
    at = len(elfsyms.ENDBR64) if code.startswith(elfsyms.ENDBR64) else 0
    mov_end = at + len(_MOV_RIP_RAX) + 4
    if code[at : at + len(_MOV_RIP_RAX)] != _MOV_RIP_RAX or not code[mov_end:].startswith(_ADD_FS0_RAX):
        return None
    insn = image.offset_to_vaddr(start + at)
    if insn is None:
        return None
    return insn + mov_end - at + int.from_bytes(code[mov_end - 4 : mov_end], "little", signed=True)


def errno_tp_offset(pid: int, image: elfsyms.ElfImage) -> int | None:
    """errno's offset from the thread pointer in process ``pid`` (negative), read from its GOT slot
    (``/proc/<pid>/mem``) at libc's load address; None when unknown (not glibc's shape, the process
    gone, an implausible value)."""
    got = errno_got_vaddr(image)
    first = image.offset_to_vaddr(0)  # link-time address of the file's first byte (0 for a library)
    m = _libc_mapping(pid)
    if got is None or first is None or m is None or m.offset != 0:
        return None
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            raw = os.pread(f.fileno(), 8, m.start - first + got)
    except OSError:
        return None
    off = int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0
    return off if -_MAX_TLS < off < 0 else None
