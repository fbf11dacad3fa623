"""``ingero serve`` agents as child processes of this one: wait for their readiness report, stop them.

For what runs real agent processes on one host — the fleet demo (``scripts/fleet_demo.py``), the
clock-skew benchmark, the libfaketime and network-namespace tests. Start an agent with
``--ready-file`` and its stdout (stderr merged) piped in text mode; it writes the ready file, then
prints ``listening on``.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ingero.errors import IngeroError

READY_TIMEOUT_S = 60.0


def wait_ready(
    proc: subprocess.Popen[str], ready_file: Path, name: str, timeout_s: float = READY_TIMEOUT_S
) -> tuple[str, dict[str, Any]]:
    """Block on the agent's output until it reports listening; its line and its ready file's document.

    Raises :class:`~ingero.errors.IngeroError` when the agent exits or stays silent for ``timeout_s``.
    """
    assert proc.stdout is not None, "start the agent with stdout=subprocess.PIPE"
    # Raw reads on the pipe's descriptor: a buffered readline() may swallow two lines at once (a warning,
    # then "listening on"), and select() would then wait for bytes that were already read.
    fd = proc.stdout.fileno()
    seen: list[str] = []
    pending = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise IngeroError(f"agent {name} did not report listening within {timeout_s:g}s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise IngeroError(f"agent {name} exited (rc={proc.wait()}): {' '.join(seen)[-400:]}")
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").strip()
                seen.append(line)
                if "listening on" in line:
                    doc: dict[str, Any] = json.loads(ready_file.read_text())
                    return line, doc


def stop(procs: Sequence[subprocess.Popen[str]], timeout_s: float = 10.0) -> None:
    """SIGTERM every agent still running, wait for each (SIGKILL after ``timeout_s``), close its pipe."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()
