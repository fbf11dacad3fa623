"""Where the CUDA runtime, CUDA driver and NCCL libraries are on this machine.

Sources, in order: explicit overrides (``--cuda-lib``, ``--driver-lib``, ``--nccl-lib``: they replace
discovery for their kind), the libraries mapped by running processes (``/proc/<pid>/maps``, entered
through ``/proc/<pid>/root`` for processes in containers), ``ldconfig -p``, CUDA install trees
(``$CUDA_HOME``, ``/usr/local/cuda*``, ...), ``$LD_LIBRARY_PATH`` and pip-bundled ``nvidia/*/lib`` and
``torch/lib`` directories in every site-packages we can see. Files are deduplicated by inode: a uprobe
on a library file covers every process that maps it, now or later.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import site
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("cudart", "cuda", "nccl")
KIND_LABELS = {"cudart": "CUDA runtime (libcudart)", "cuda": "CUDA driver (libcuda)", "nccl": "NCCL (libnccl)"}
OVERRIDE_FLAGS = {"cudart": "--cuda-lib", "cuda": "--driver-lib", "nccl": "--nccl-lib"}
_KIND_RE = {
    # pip wheels of torch may rename them: libcudart-d0da41ae.so.11.0
    "cudart": re.compile(r"^libcudart(?:-[0-9a-f]{6,})?\.so(?:\.[0-9.]+)?$"),
    "cuda": re.compile(r"^libcuda\.so(?:\.[0-9.]+)?$"),
    "nccl": re.compile(r"^libnccl(?:-[0-9a-f]{6,})?\.so(?:\.[0-9.]+)?$"),
}
# What every _KIND_RE name has, after the directory's slash in a maps line (a cheap test of the whole file).
_MAPS_MARKERS = ("/libcuda", "/libnccl")
_VERSION_RE = re.compile(r"\.so\.([0-9][0-9.]*)$")


def library_kind(path: str) -> str | None:
    name = os.path.basename(path)
    for kind, rx in _KIND_RE.items():
        if rx.match(name):
            return kind
    return None


def library_version(path: str) -> str:
    """Version from the file name: libcudart.so.12.4.127 -> 12.4.127 (after resolving symlinks)."""
    for p in (os.path.realpath(path), path):
        m = _VERSION_RE.search(os.path.basename(p))
        if m:
            return m.group(1)
    return ""


@dataclass(frozen=True)
class LibraryFile:
    kind: str
    path: str  # real path, reachable from this mount namespace
    origin: str  # override | process <pid> | ldconfig | cuda install | LD_LIBRARY_PATH | pip bundle
    version: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "path": self.path, "origin": self.origin, "version": self.version}


@dataclass
class Discovery:
    libraries: list[LibraryFile] = field(default_factory=list)
    _seen: set[tuple[int, int]] = field(default_factory=set, repr=False)

    def add(self, kind: str, path: str, origin: str) -> LibraryFile | None:
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        if key in self._seen or not os.path.isfile(real):
            return None
        self._seen.add(key)
        lib = LibraryFile(kind, real, origin, library_version(path))
        self.libraries.append(lib)
        return lib

    def of_kind(self, kind: str) -> list[LibraryFile]:
        return [lib for lib in self.libraries if lib.kind == kind]


# --- sources -------------------------------------------------------------------------------------


def process_libraries(pids: Iterable[int] | None = None) -> Iterator[tuple[str, str, int]]:
    """(kind, reachable path, pid) for every GPU library mapped by the given (default: all) processes."""
    if pids is None:
        pids = all_pids()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if not any(marker in text for marker in _MAPS_MARKERS):
            continue  # most processes map no GPU library: no line to split
        seen: set[str] = set()
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            path = parts[5].removesuffix(" (deleted)")
            if path in seen:
                continue
            seen.add(path)
            kind = library_kind(path)
            if kind is None:
                continue
            yield kind, _reachable(pid, path, parts[4]), pid


def _reachable(pid: int, path: str, inode: str) -> str:
    """``path`` as seen from here: the same file, or through /proc/<pid>/root for another mount ns."""
    try:
        if str(os.stat(path).st_ino) == inode:
            return path
    except OSError:
        pass
    return f"/proc/{pid}/root{path}"


def all_pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []


def ldconfig_libraries() -> Iterator[tuple[str, str]]:
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if not exe:
        return
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return
    for line in out.splitlines():
        if "=>" not in line or "x86-64" not in line:
            continue
        name, _, path = line.partition("=>")
        kind = library_kind(name.split()[0]) if name.split() else None
        if kind:
            yield kind, path.strip()


def cuda_install_dirs() -> list[str]:
    dirs: list[str] = []
    for env in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(env):
            dirs += [os.path.join(os.environ[env], "lib64"), os.path.join(os.environ[env], "lib")]
    dirs += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
    dirs += sorted(glob.glob("/usr/local/cuda-*/lib64"), reverse=True)
    dirs += sorted(glob.glob("/usr/local/cuda-*/targets/x86_64-linux/lib"), reverse=True)
    dirs += [
        "/opt/cuda/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
        "/usr/lib/x86_64-linux-gnu/nvidia/current",
    ]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def site_package_dirs() -> list[str]:
    dirs = [*list(site.getsitepackages()), site.getusersitepackages()]
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    dirs += glob.glob("/usr/local/lib/python3*/dist-packages") + glob.glob("/usr/lib/python3*/dist-packages")
    dirs += glob.glob("/usr/local/lib/python3*/site-packages")
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def pip_bundle_dirs() -> list[str]:
    out: list[str] = []
    for sp in site_package_dirs():
        out += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")))
        torch_lib = os.path.join(sp, "torch", "lib")
        if os.path.isdir(torch_lib):
            out.append(torch_lib)
    return out


def libraries_in(directory: str) -> Iterator[tuple[str, str]]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        kind = library_kind(name)
        if kind:
            yield kind, os.path.join(directory, name)


# --- the whole search ----------------------------------------------------------------------------


def discover(
    overrides: dict[str, list[str]] | None = None,
    *,
    pids: Iterable[int] | None = None,
    system: bool = True,
) -> Discovery:
    """Every GPU library to probe. ``pids`` limits the process scan (None = every process)."""
    overrides = {k: v for k, v in (overrides or {}).items() if v}
    found = Discovery()
    for kind, paths in overrides.items():
        for p in paths:
            found.add(kind, p, "override")
    for kind, path, pid in process_libraries(pids):
        if kind not in overrides:
            found.add(kind, path, f"process {pid}")
    if not system:
        return found
    for kind, path in ldconfig_libraries():
        if kind not in overrides:
            found.add(kind, path, "ldconfig")
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        for kind, path in libraries_in(d) if d else ():
            if kind not in overrides:
                found.add(kind, path, "LD_LIBRARY_PATH")
    for d in cuda_install_dirs():
        for kind, path in libraries_in(d):
            if kind not in overrides:
                found.add(kind, path, "cuda install")
    for d in pip_bundle_dirs():
        for kind, path in libraries_in(d):
            if kind not in overrides:
                found.add(kind, path, "pip bundle")
    return found


def validate_overrides(overrides: dict[str, list[str]]) -> list[str]:
    """One message per override that is not a readable file."""
    problems = []
    for kind, paths in overrides.items():
        for p in paths:
            if not os.path.isfile(p):
                problems.append(f"{OVERRIDE_FLAGS[kind]} {p}: no such file")
    return problems


def read_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")
