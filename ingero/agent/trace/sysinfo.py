"""System snapshots (CPU, memory, swap, load — every second) and the ``sessions`` row, from /proc.

Everything reads plain files, so it works unprivileged and without a GPU; the GPU model and driver
come from ``nvidia-smi`` when it exists, else ``/proc/driver/nvidia/version``.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ingero.timeutil import now_ns


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def meminfo() -> dict[str, int]:
    """/proc/meminfo in kB."""
    out: dict[str, int] = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0])
    return out


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies across all CPUs."""
    for line in _read("/proc/stat").splitlines():
        if line.startswith("cpu "):
            vals = [int(v) for v in line.split()[1:]]
            idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
            total = sum(vals[:8])  # guest time is already counted in user/nice
            return total - idle, total
    return 0, 0


def load_avg_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


@dataclass(frozen=True)
class Snapshot:
    timestamp: int
    cpu_pct: float
    mem_pct: float
    mem_avail_mb: int
    swap_mb: int
    load_avg: float

    def as_row(self) -> tuple[int, float, float, int, int, float]:
        return (self.timestamp, self.cpu_pct, self.mem_pct, self.mem_avail_mb, self.swap_mb, self.load_avg)


class SnapshotSampler:
    """Call :meth:`sample` about once a second; CPU % is measured between consecutive calls."""

    def __init__(self) -> None:
        self._last = cpu_times()

    def sample(self) -> Snapshot:
        busy, total = cpu_times()
        d_busy, d_total = busy - self._last[0], total - self._last[1]
        self._last = (busy, total)
        cpu = 100.0 * d_busy / d_total if d_total > 0 else 0.0
        mem = meminfo()
        total_kb = mem.get("MemTotal", 0)
        avail_kb = mem.get("MemAvailable", mem.get("MemFree", 0))
        swap_used_kb = mem.get("SwapTotal", 0) - mem.get("SwapFree", 0)
        return Snapshot(
            timestamp=now_ns(),
            cpu_pct=round(cpu, 2),
            mem_pct=round(100.0 * (total_kb - avail_kb) / total_kb, 2) if total_kb else 0.0,
            mem_avail_mb=avail_kb // 1024,
            swap_mb=max(0, swap_used_kb) // 1024,
            load_avg=round(load_avg_1m(), 2),
        )


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def os_release() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return platform.system()


def gpu_info() -> tuple[str, str]:
    """(model, driver version); empty strings when there is no NVIDIA GPU/driver."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out:
            first = [f.strip() for f in out.splitlines()[0].split(",")]
            if len(first) >= 3:
                return f"{first[0]}, {first[1]}", first[2]
    text = _read("/proc/driver/nvidia/version")
    if text:
        for word in text.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return "", word
    return "", ""


def session_info(*, cuda_version: str = "", pid_filter: str = "", flags: str = "") -> dict[str, object]:
    """The ``sessions`` columns ingero fills (see ``SESSION_FIELDS`` in the store writer)."""
    model, driver = gpu_info()
    mem = meminfo()
    return {
        "gpu_model": model,
        "gpu_driver": driver,
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count() or 0,
        "mem_total": mem.get("MemTotal", 0) // 1024,
        "kernel": platform.release(),
        "os_release": os_release(),
        "cuda_ver": cuda_version,
        "python_ver": platform.python_version(),
        "pid_filter": pid_filter,
        "flags": flags,
    }
