"""Serving engines on this host, found by command line, and where each publishes its metrics.

=========  ===================================================  ==========================================
engine     command line                                         metrics endpoint (path /metrics)
=========  ===================================================  ==========================================
vllm       ``vllm serve ...``, ``-m vllm.entrypoints...``       ``--host``/``--port`` (8000)
sglang     ``-m sglang.launch_server ...``                      ``--host``/``--port`` (30000; needs
                                                                ``--enable-metrics``)
tgi        ``text-generation-launcher ...``                     ``--prometheus-port`` when given, else
                                                                ``--hostname``/``--port``/``-p`` (3000)
triton     ``tritonserver ...``                                 ``--metrics-port`` (8002);
                                                                ``--allow-metrics=false``: none
=========  ===================================================  ==========================================

A wildcard listen address (0.0.0.0, ::, none given) is scraped on loopback. Flags are read as
``--flag value`` and ``--flag=value``. Only the engine's top process counts: a worker whose parent is
already an engine of the same kind (vLLM's engine core, TGI's shards) is not scraped again.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

ENGINES = ("vllm", "sglang", "tgi", "triton")
PREFIXES = {"vllm": ("vllm:",), "sglang": ("sglang:",), "tgi": ("tgi_",), "triton": ("nv_",)}  # as published
_DEFAULT_PORT = {"vllm": 8000, "sglang": 30000, "tgi": 3000, "triton": 8002}
_WILDCARD = {"", "0.0.0.0", "::", "[::]", "*"}


@dataclass(frozen=True)
class Engine:
    pid: int
    engine: str
    url: str  # the metrics endpoint

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "engine": self.engine, "url": self.url}


def kind_of(argv: list[str]) -> str | None:
    """Which serving engine a command line runs (None: none of them)."""
    names = [os.path.basename(a) for a in argv]
    for i, (a, n) in enumerate(zip(argv, names, strict=True)):
        if n == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return "vllm"
        if a.startswith("vllm.entrypoints"):
            return "vllm"
        if a == "sglang.launch_server":
            return "sglang"
        if n == "text-generation-launcher":
            return "tgi"
        if n == "tritonserver":
            return "triton"
    return None


def flag(argv: list[str], *names: str) -> str | None:
    """The value of the last of ``--name value`` / ``--name=value`` (any of ``names``)."""
    found = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1 :]
    return found


def endpoint(kind: str, argv: list[str]) -> str | None:
    """The metrics URL of engine ``kind`` started with ``argv`` (None: metrics turned off)."""
    host = flag(argv, "--host", "--hostname") or ""
    if kind == "triton":
        if (flag(argv, "--allow-metrics") or "true").lower() in ("false", "0", "no"):
            return None
        port, host = flag(argv, "--metrics-port"), flag(argv, "--metrics-address") or ""
    elif kind == "tgi":
        port = flag(argv, "--prometheus-port") or flag(argv, "--port", "-p")
    else:
        port = flag(argv, "--port")
    try:
        number = int(port) if port else _DEFAULT_PORT[kind]
    except ValueError:
        number = _DEFAULT_PORT[kind]
    host = "127.0.0.1" if host in _WILDCARD else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{number}/metrics"


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def detect(pids: Iterable[int] | None = None) -> list[Engine]:
    """The serving engines among ``pids`` (default: every process), top processes only, by pid."""
    if pids is None:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    kinds: dict[int, tuple[str, list[str]]] = {}
    for pid in pids:
        argv = _cmdline(pid)
        kind = kind_of(argv) if argv else None
        if kind is not None:
            kinds[pid] = (kind, argv)
    out = []
    for pid, (kind, argv) in sorted(kinds.items()):
        parent = kinds.get(_parent(pid))
        if parent is not None and parent[0] == kind:
            continue
        url = endpoint(kind, argv)
        if url is not None:
            out.append(Engine(pid, kind, url))
    return out


__all__ = ["ENGINES", "PREFIXES", "Engine", "detect", "endpoint", "flag", "kind_of"]
