"""Finding the GPU libraries and where to put the uprobes (ELF reading), without the kernel."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from ingero.agent.trace import discovery, elfsyms
from tests.bpf_support import FIXTURES, REAL_CUDART


def _gcc_lib(tmp: Path, name: str, *flags: str) -> Path:
    out = tmp / name
    subprocess.run(
        ["gcc", "-shared", "-fPIC", *flags, "-o", str(out), str(FIXTURES / "fake_cudart.c")],
        check=True,
        capture_output=True,
    )
    return out


def test_push_prologue_is_probed_at_the_symbol(tmp_path: Path) -> None:
    lib = _gcc_lib(tmp_path, "libcudart.so.12", "-O0", "-fno-omit-frame-pointer", "-fcf-protection=none")
    image = elfsyms.load(str(lib))
    assert {"cudaMalloc", "cudaFree", "cudaLaunchKernel", "cudaStreamSynchronize"} <= set(image.symbols)
    off, kind = elfsyms.probe_offset(image, "cudaMalloc") or (0, "")
    assert kind == "push"
    assert lib.read_bytes()[off] == elfsyms.PUSH_RBP
    assert elfsyms.probe_offset(image, "notThere") is None
    # file offset -> vaddr -> symbol round trip, as the stack symbolizer uses it
    vaddr = image.offset_to_vaddr(off)
    assert vaddr is not None and image.symbolize(vaddr + 2) == ("cudaMalloc", 2)


def test_endbr64_functions_are_probed_past_it(tmp_path: Path) -> None:
    lib = _gcc_lib(tmp_path, "libcudart.so.12", "-O0", "-fno-omit-frame-pointer", "-fcf-protection=full")
    image = elfsyms.load(str(lib))
    sym = image.function_offset("cudaMalloc")
    assert sym is not None and lib.read_bytes()[sym : sym + 4] == elfsyms.ENDBR64
    assert elfsyms.probe_offset(image, "cudaMalloc") == (sym + 4, "endbr64+push")


@pytest.mark.skipif(REAL_CUDART is None, reason="nvidia-cuda-runtime-cu12 (a dev dependency) is not installed")
def test_real_libcudart_exports_the_probed_functions() -> None:
    assert REAL_CUDART is not None
    image = elfsyms.load(str(REAL_CUDART))
    for name in ("cudaMalloc", "cudaFree", "cudaLaunchKernel", "cudaMemcpy", "cudaMemcpyAsync"):
        assert name in image.symbols
        where = elfsyms.probe_offset(image, name)
        assert where is not None and where[1] in ("push", "endbr64+push")


def test_not_an_elf_file(tmp_path: Path) -> None:
    bad = tmp_path / "libcuda.so.1"
    bad.write_text("not an ELF")
    with pytest.raises(elfsyms.ElfError, match="not an ELF"):
        elfsyms.load(str(bad))
    with pytest.raises(elfsyms.ElfError):
        elfsyms.load(str(tmp_path / "missing.so"))


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("libcudart.so.12", "cudart"),
        ("libcudart.so.12.4.127", "cudart"),
        ("libcudart-d0da41ae.so.11.0", "cudart"),
        ("libcudart.so", "cudart"),
        ("libcuda.so.1", "cuda"),
        ("libcuda.so.580.126.09", "cuda"),
        ("libnccl.so.2", "nccl"),
        ("libcudnn.so.9", None),
        ("libcudart_static.a", None),
        ("libcuda.so.1.bak", None),
    ],
)
def test_library_kinds(name: str, kind: str | None) -> None:
    assert discovery.library_kind(f"/x/{name}") == kind


def test_overrides_replace_discovery_and_dedupe_by_inode(tmp_path: Path) -> None:
    lib = _gcc_lib(tmp_path, "libcudart.so.12.9.1", "-O0")
    link = tmp_path / "libcudart.so.12"
    link.symlink_to(lib.name)
    found = discovery.discover({"cudart": [str(link), str(lib)]}, pids=[], system=True)
    cudart = found.of_kind("cudart")
    assert [(x.path, x.origin, x.version) for x in cudart] == [(str(lib), "override", "12.9.1")]
    assert discovery.validate_overrides({"nccl": [str(tmp_path / "nope.so")]}) == [
        f"--nccl-lib {tmp_path / 'nope.so'}: no such file"
    ]


@pytest.mark.skipif(REAL_CUDART is None, reason="nvidia-cuda-runtime-cu12 (a dev dependency) is not installed")
def test_finds_the_pip_bundled_runtime_and_the_libraries_a_process_maps() -> None:
    assert REAL_CUDART is not None
    real = os.path.realpath(REAL_CUDART)
    found = discovery.discover(pids=[])
    assert real in {x.path for x in found.of_kind("cudart")}
    ctypes.CDLL(str(REAL_CUDART))  # now this process maps it
    mapped = discovery.discover(pids=[os.getpid()], system=False)
    assert [(x.path, x.origin) for x in mapped.of_kind("cudart")] == [(real, f"process {os.getpid()}")]


# Prologues as assembled bytes: (function, where the probe goes from its start, what it sits on).
PROLOGUES = {
    "like_sendto": (  # glibc 2.36's sendto, with the endbr64 a CET build adds
        "endbr64; cmpb $0, flag(%rip); mov %ecx, %r10d; je 1f; mov $44, %eax; syscall; 1: ret",
        4 + 7 + 3,
        "endbr64+cmpb+mov+jcc",
    ),
    "like_recvmsg": ("mov %fs:0x18, %eax; test %eax, %eax; jne 1f; 1: ret", 8 + 2, "mov+test+jcc"),
    "push_r15": ("push %r15; pop %r15; ret", 0, "push"),
    "endbr_push": ("endbr64; push %rbp; pop %rbp; ret", 4, "endbr64+push"),
    "tail_jump": ("endbr64; cmpl $0, flag(%rip); jmp 1f; 1: ret", 4 + 7, "endbr64+cmpl+jmp"),
    "stepped": ("endbr64; mov %rdi, %rax; push %rbp; pop %rbp; ret", 0, "other"),  # writes rax: then no skip
    "arg_written": ("xor %edi, %edi; push %rbp; pop %rbp; ret", 0, "other"),  # an argument register: never skipped
}


def test_probes_go_on_the_first_emulated_instruction_past_skippable_ones(tmp_path: Path) -> None:
    """One rule for the GPU libraries and libc's socket calls: hand-written prologues, assembled by gcc."""
    src = tmp_path / "prologues.c"
    body = "".join(
        f'  ".globl {n}\\n.type {n}, @function\\n{n}:\\n{asm}\\n.size {n}, .-{n}\\n"\n'
        for n, (asm, _, _) in PROLOGUES.items()
    )
    src.write_text(f'__asm__(".data\\nflag: .long 0\\n.text\\n"\n{body});\n'.replace("; ", "\\n"))
    lib = tmp_path / "libprologues.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    image = elfsyms.load(str(lib))
    for name, (_, at, kind) in PROLOGUES.items():
        start = image.function_offset(name)
        assert start is not None
        assert elfsyms.probe_offset(image, name) == (start + at, kind), name


def test_libc_socket_calls_are_probed_on_an_emulated_instruction() -> None:
    """The system's libc (what attach_sockets probes): every socket call's probe sits on a push, jmp or
    jcc, reached through skippable instructions only (glibc's sendto: past its cmpb and mov)."""
    from ingero.agent.trace.libc_sockets import SOCKET_FUNCTIONS

    libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libc.so.6") if os.path.exists(p)), None)
    if libc is None:
        pytest.skip("no x86-64 glibc at the usual paths")
    image = elfsyms.load(libc)
    for name, _ in SOCKET_FUNCTIONS:
        where = elfsyms.probe_offset(image, name)
        assert where is not None and where[1].rsplit("+", 1)[-1] in ("push", "jmp", "jcc"), (name, where)
