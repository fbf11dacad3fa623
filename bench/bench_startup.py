"""CLI start-up (issue 13): ``ingero --help``, process start → first network byte, a query to a refused node.

Run: ``.venv/bin/python bench/bench_startup.py [--runs 7]``. Best of N wall times, each a fresh process:

  python          ``python -c pass`` — the interpreter alone (not ours)
  floor           ``python -c "import trio, ssl"`` — what any trio + TLS client pays before its first byte
  --help          ``ingero --help``                                  target ≤ 100 ms
  first byte      ``ingero query --nodes HOST:PORT`` (mTLS flags) from ``Popen`` until the bench's
                  listening socket receives the TLS ClientHello's first byte      target ≤ 100 ms
  refused         ``ingero query --nodes 127.0.0.1:<closed>``, start to exit     target ≤ 150 ms

The targets are absolute, so the line ``floor`` is printed beside them: on a loaded machine (load
average above the core count) every figure, the floor included, grows together.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
INGERO = [PY, "-m", "ingero"]


ENV = {k: v for k, v in os.environ.items() if k != "INGERO_CONFIG"}  # HOME is set to a temp dir in main()


def best_wall(argv: list[str], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        best = min(best, time.perf_counter() - t0)
    return best


def first_byte(argv_for_port: list[str], listener: socket.socket, runs: int) -> float:
    """Popen → the first byte the client sends arrives at ``listener``."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv_for_port, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(30)
            conn.recv(1)
            best = min(best, time.perf_counter() - t0)
        proc.kill()
        proc.wait()
    return best


def make_pki(d: Path) -> list[str]:
    from ingero.tls.pki import create_ca, issue_cert, split_sans

    create_ca(d / "ca")
    issue_cert(d / "ca", "node", "bench", split_sans(["127.0.0.1"]))
    client = issue_cert(d / "ca", "client", "bench-client")
    return ["--ca-cert", str(d / "ca" / "ca.pem"), "--client-cert", str(client.cert), "--client-key", str(client.key)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    runs = ap.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as listener:
        tls = make_pki(Path(tmp))
        ENV["HOME"] = tmp  # no user config file: nodes and TLS from the flags only
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        query = [*INGERO, "query", *tls, "SELECT 1", "--nodes"]
        figures = [
            ("python -c pass", best_wall([PY, "-c", "pass"], runs), None),
            ("floor: import trio, ssl", best_wall([PY, "-c", "import trio, ssl"], runs), None),
            ("ingero --help", best_wall([*INGERO, "--help"], runs), 0.100),
            ("start → first network byte", first_byte([*query, f"127.0.0.1:{port}"], listener, runs), 0.100),
            ("query to a refused node", best_wall([*query, f"127.0.0.1:{closed}"], runs), 0.150),
        ]
    load = os.getloadavg()[0]
    print(f"CLI start-up, best of {runs} fresh processes; {os.cpu_count()} CPUs, load average {load:.1f}")
    print(f"{'':32} {'measured':>10} {'target':>10}")
    for name, seconds, target in figures:
        tgt = f"≤ {target * 1000:.0f} ms" if target is not None else ""
        verdict = "" if target is None else ("  ok" if seconds <= target else "  MISS")
        print(f"{name:32} {seconds * 1000:8.0f} ms {tgt:>10}{verdict}")


if __name__ == "__main__":
    main()
