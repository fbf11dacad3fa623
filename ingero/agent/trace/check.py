"""``ingero check``: can this machine trace? Each piece tested on its own, with the fix when it fails.

Runs unprivileged and without bcc (those are checks too). Required checks decide ``ready``; the
others (BTF, GPU libraries, GPU driver) only say what will be missing from the traces.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingero.agent.trace import discovery, probes, sysinfo

MIN_KERNEL = (5, 8)  # BPF ring buffer
TRACEPOINTS = [
    ("sched", "sched_switch"),
    ("sched", "sched_waking"),
    ("sched", "sched_process_exec"),
    ("sched", "sched_process_exit"),
    ("sched", "sched_process_fork"),
    ("task", "task_newtask"),
    ("kmem", "mm_page_alloc"),
    ("block", "block_rq_issue"),
    ("block", "block_rq_complete"),
    ("tcp", "tcp_retransmit_skb"),
]
SETUP = "scripts/setup.sh --system"


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "required": self.required, "detail": self.detail, "fix": self.fix}


def kernel_version(release: str | None = None) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release or platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_kernel() -> CheckResult:
    rel = platform.release()
    ok = kernel_version(rel) >= MIN_KERNEL
    return CheckResult(
        "kernel",
        ok,
        f"{rel} (BPF ring buffers need {MIN_KERNEL[0]}.{MIN_KERNEL[1]}+)",
        "" if ok else "upgrade to a 5.8+ kernel (Debian 12 ships 6.1)",
    )


def _path_check(name: str, path: str, found: str, missing: str, fix: str, *, required: bool = True) -> CheckResult:
    """Passes when ``path`` exists: ``found``; else ``missing``, and ``fix`` says what to do."""
    ok = os.path.exists(path)
    return CheckResult(name, ok, found if ok else missing, "" if ok else fix, required=required)


def check_btf() -> CheckResult:
    return _path_check(
        "BTF",
        "/sys/kernel/btf/vmlinux",
        "/sys/kernel/btf/vmlinux present",
        "no /sys/kernel/btf/vmlinux",
        "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y (ingero works without it; other eBPF tools may not)",
        required=False,
    )


def check_headers() -> CheckResult:
    rel = platform.release()
    build = Path(f"/lib/modules/{rel}/build")
    if (build / "include" / "generated" / "autoconf.h").exists():
        target = os.path.realpath(build)
        other = (
            "" if rel in target else " (another kernel's headers: fine, ingero reads tracepoint layouts from tracefs)"
        )
        return CheckResult("kernel headers", True, f"{build} -> {target}{other}")
    if os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return CheckResult("kernel headers", True, "from /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS)")
    return CheckResult(
        "kernel headers",
        False,
        f"bcc compiles against {build}, which is missing",
        f"apt-get install linux-headers-amd64, then ln -s /usr/src/linux-headers-<version>-amd64 {build} "
        f"(and the -common one as {build.parent / 'source'}); {SETUP} does both",
    )


def check_tracefs() -> CheckResult:
    root = probes.tracefs_root()
    if root is None:
        readable = os.access("/sys/kernel/tracing", os.R_OK) or os.geteuid() == 0
        if not readable:
            return CheckResult(
                "tracefs", False, "/sys/kernel/tracing is not readable by this user", "run 'sudo ingero check'"
            )
        return CheckResult("tracefs", False, "not mounted", f"mount -t tracefs nodev /sys/kernel/tracing ({SETUP})")
    missing = [f"{c}:{n}" for c, n in TRACEPOINTS if not probes.tracepoint_exists(c, n)]
    if missing:
        return CheckResult(
            "tracepoints",
            False,
            f"{root}: missing {', '.join(missing)}",
            "use a kernel with these tracepoints (CONFIG_FTRACE, CONFIG_BLK_DEV_IO_TRACE)",
        )
    oom = "" if probes.tracepoint_exists("oom", "mark_victim") else " (no oom:mark_victim: OOM kills not recorded)"
    return CheckResult("tracefs", True, f"{root}, {len(TRACEPOINTS)} tracepoints{oom}")


def check_uprobes() -> CheckResult:
    return _path_check(
        "uprobes",
        "/sys/bus/event_source/devices/uprobe",
        "uprobe PMU available",
        "no uprobe PMU (/sys/bus/event_source/devices/uprobe)",
        "use a kernel built with CONFIG_UPROBES=y and CONFIG_UPROBE_EVENTS=y",
    )


def check_kprobes() -> CheckResult:
    have = os.path.exists("/sys/bus/event_source/devices/kprobe")
    return CheckResult(
        "kprobes", True, f"not needed (uprobes + tracepoints only); {'present' if have else 'absent'}", required=False
    )


def check_bcc() -> CheckResult:
    ok, detail = probes.bcc_status()
    return CheckResult(
        "bcc",
        ok,
        detail,
        "" if ok else f"apt-get install python3-bpfcc and expose it to the venv ({SETUP}; then scripts/setup.sh)",
    )


def check_privileges() -> CheckResult:
    if os.geteuid() == 0:
        return CheckResult("privileges", True, "root")
    if probes.has_bpf_capabilities():
        return CheckResult("privileges", True, f"uid {os.geteuid()} with CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN)")
    return CheckResult(
        "privileges",
        False,
        f"uid {os.geteuid()} without CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN",
        "run tracing as root: sudo ingero trace ... (or grant cap_bpf,cap_perfmon,cap_sys_admin)",
    )


def check_libraries(overrides: dict[str, list[str]] | None = None) -> list[CheckResult]:
    found = discovery.discover(overrides)
    out = []
    hints = {
        "cudart": "install CUDA or 'pip install nvidia-cuda-runtime-cu12', or pass --cuda-lib PATH to ingero trace",
        "cuda": "install the NVIDIA driver (libcuda.so.1 comes with it), or pass --driver-lib PATH",
        "nccl": "'pip install nvidia-nccl-cu12' (or your framework's bundled copy), or pass --nccl-lib PATH",
    }
    for kind in discovery.KINDS:
        libs = found.of_kind(kind)
        if libs:
            shown = "; ".join(f"{lib.path} ({lib.origin})" for lib in libs[:3])
            more = f" and {len(libs) - 3} more" if len(libs) > 3 else ""
            out.append(CheckResult(discovery.KIND_LABELS[kind], True, shown + more, required=False))
        else:
            out.append(CheckResult(discovery.KIND_LABELS[kind], False, "not found", hints[kind], required=False))
    return out


def check_gpu() -> CheckResult:
    model, driver = sysinfo.gpu_info()
    if driver:
        return CheckResult("GPU / driver", True, f"{model or 'NVIDIA GPU'}, driver {driver}", required=False)
    return CheckResult(
        "GPU / driver",
        False,
        "no NVIDIA driver (nvidia-smi, /proc/driver/nvidia/version)",
        "install the NVIDIA driver to trace real GPU work; host events and CUDA calls are recorded without one",
        required=False,
    )


def check_python_frames(scope: int | None = None, *, root: bool | None = None) -> CheckResult:
    """Can the tracer read CPython 3.10–3.12 frames from traced processes (kernel.yama.ptrace_scope)?"""
    from ingero.agent.trace.pyframes import SUPPORTED, ptrace_problem, ptrace_scope

    scope = ptrace_scope() if scope is None else scope
    root = os.geteuid() == 0 if root is None else root
    problem = ptrace_problem(scope, root=root)
    setting = "no Yama LSM" if scope is None else f"kernel.yama.ptrace_scope = {scope}"
    if problem:
        fix = (
            "sysctl kernel.yama.ptrace_scope=1 (3 can only be lowered by a reboot)"
            if scope == 3
            else "trace as root (or with CAP_SYS_PTRACE)"
        )
        return CheckResult("python frames", False, problem, fix, required=False)
    return CheckResult(
        "python frames",
        True,
        f"{setting}: [Python] frames readable from CPython {', '.join(SUPPORTED)} processes "
        "(other interpreters and versions: native frames only)",
        required=False,
    )


def run_checks(overrides: dict[str, list[str]] | None = None) -> list[CheckResult]:
    return [
        check_kernel(),
        check_btf(),
        check_headers(),
        check_tracefs(),
        check_uprobes(),
        check_kprobes(),
        check_bcc(),
        check_privileges(),
        *check_libraries(overrides),
        check_gpu(),
        check_python_frames(),
    ]


def compile_check() -> CheckResult:
    """Compile and load ingero's programs (root only), then unload them: the end-to-end proof."""
    import time

    from ingero.errors import TracingUnavailableError

    t0 = time.monotonic()
    try:
        bpf = probes.BpfProbes(probes.ProbeOptions(ring_mb=1))
    except TracingUnavailableError as e:
        return CheckResult("BPF programs", False, e.message, e.hint or "")
    try:
        elapsed = time.monotonic() - t0
        detail = f"compiled and loaded in {elapsed:.1f}s ({len(bpf.bpf.tracepoint_fds)} tracepoints attached)"
    finally:
        bpf.close()
    return CheckResult("BPF programs", True, detail)


def ready(results: list[CheckResult]) -> bool:
    return all(r.ok for r in results if r.required)
