"""Where libc's socket calls are probed: which functions, at which instruction, in which file.

The agent records a traced process's socket calls with uprobes on its libc (net_probes.c), attached
to that process alone (:meth:`ingero.agent.trace.probes.BpfProbes.attach_sockets`). This module holds the
pure part: no bcc here.
"""

from __future__ import annotations

from ingero.agent.trace import elfsyms

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

# Leading instructions of libc's socket calls that touch neither the stack pointer nor the first
# argument (so a probe after them still sees the fd and the return address on top of the stack), and
# the first instructions the kernel emulates instead of single-stepping (~1 µs against ~11 µs a hit
# here): glibc's sendto starts with `cmpb $0, __libc_single_threaded(%rip)`, which would be stepped.
_SKIP = (
    (b"\xf3\x0f\x1e\xfa", 4),  # endbr64
    (b"\x80\x3d", 7),  # cmpb $imm8, rel32(%rip)
    (b"\x83\x3d", 7),  # cmpl $imm8, rel32(%rip)
    (b"\x64\x8b\x04\x25", 8),  # mov %fs:disp32, %eax
    (b"\x85\xc0", 2),  # test %eax, %eax
    (b"\x41\x89\xca", 3),  # mov %ecx, %r10d
    (b"\x49\x89\xca", 3),  # mov %rcx, %r10
)


def _emulated(code: bytes) -> bool:
    """jcc/jmp (rel8, rel32) or push of a register: executed by the kernel without single-stepping."""
    op = code[0]
    return (
        0x70 <= op <= 0x7F
        or op in (0xEB, 0xE9)
        or 0x50 <= op <= 0x57
        or (op == 0x0F and 0x80 <= code[1] <= 0x8F)
        or (op == 0x41 and 0x50 <= code[1] <= 0x57)
    )


def socket_probe_offset(image: elfsyms.ElfImage, name: str) -> int | None:
    """File offset for the entry uprobe of libc's ``name``: its first emulated instruction when only
    harmless ones precede it (see _SKIP), else the function's start. None when not exported."""
    start = image.function_offset(name) if name in image.symbols else None
    if start is None:
        return None
    try:
        with open(image.path, "rb") as f:
            f.seek(start)
            code = f.read(48)
    except OSError:
        return start
    at = 0
    for _ in range(6):
        if len(code) - at < 2:
            break
        if _emulated(code[at:]):
            return start + at
        step = next((n for prefix, n in _SKIP if code[at:].startswith(prefix)), 0)
        if not step:
            break
        at += step
    return start


def libc_of(pid: int) -> str | None:
    """The libc file ``pid`` maps, through its root (a container's own libc), or None."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip()
                base = path.rsplit("/", 1)[-1]
                if path.startswith("/") and (base.startswith("libc.so") or base.startswith("libc-")):
                    return f"/proc/{pid}/root{path}"
    except OSError:
        pass
    return None
