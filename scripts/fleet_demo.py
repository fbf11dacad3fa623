"""The README's main demo (``make demo``): a local 3-node fleet on loopback, asked from one command.

1. ``ingero cert``: a fleet CA, one certificate per node (SANs 127.0.0.1, localhost), one client
   certificate — in a temporary directory.
2. ``ingero serve`` × 3 over ``investigations/sample-gpu-node-0{1,2,3}.db`` (made by ``ingero
   investigations`` when missing), each on 127.0.0.1 port 0 with mutual TLS and ``--ready-file``.
3. A fleet config (``fleet.nodes`` + client TLS) in the same directory, used through ``--config``.
4. ``ingero fleet status``, the seed's query with ``ingero query``, and ``ingero explain``, all
   ``--config``-driven; the explain output must name gpu-node-01 as the straggler.
5. The dashboard's URL is printed at the end; with ``--dashboard`` it is served (``ingero dashboard``
   over the same config, a certificate of the fleet CA, a one-off login token) and the agents keep
   running until Ctrl-C.
6. The agents are stopped — always, also on errors and Ctrl-C. No root, no GPU.

Usage: .venv/bin/python scripts/fleet_demo.py [--keep] [--dashboard]   (--keep leaves the temp dir for a look)
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ingero.errors import IngeroError
from ingero.fleet import local_agents

ROOT = Path(__file__).resolve().parents[1]
INVESTIGATIONS = ROOT / "investigations"
NODES = ["gpu-node-01", "gpu-node-02", "gpu-node-03"]
DASHBOARD_PORT = 8470
SEED_QUERY = "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"


class DemoError(Exception):
    pass


def spawn(argv: list[str]) -> subprocess.Popen[str]:
    """A child ``ingero`` process with its output piped to us, in its own session: Ctrl-C goes to us
    and we stop the children ourselves."""
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def ingero_cmd() -> list[str]:
    return [sys.executable, "-m", "ingero"]


def show(argv: list[str]) -> None:
    shown = ["ingero", *argv[len(ingero_cmd()) :]] if argv[: len(ingero_cmd())] == ingero_cmd() else argv
    print(f"\n$ {shlex.join(shown)}", flush=True)


def run(argv: list[str], *, quiet: bool = False) -> str:
    """Run a command, echo it (and, unless quiet, its output); return its stdout."""
    if not quiet:
        show(argv)
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if not quiet:
        sys.stdout.write(proc.stdout)
        sys.stdout.write(proc.stderr)
        sys.stdout.flush()
    if proc.returncode != 0:
        raise DemoError(
            f"{shlex.join(argv[len(ingero_cmd()) :])} failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc.stdout


def ensure_investigations() -> list[Path]:
    dbs = [INVESTIGATIONS / f"sample-{n}.db" for n in NODES]
    if not all(p.is_file() for p in dbs):
        print("investigations/ lacks the sample databases: generating them (ingero investigations)", flush=True)
        run([*ingero_cmd(), "investigations", "--out", str(INVESTIGATIONS)], quiet=True)
    missing = [str(p) for p in dbs if not p.is_file()]
    if missing:
        raise DemoError(f"missing {', '.join(missing)} (run: make investigations)")
    return dbs


def make_pki(pki: Path) -> None:
    print(f"certificates: fleet CA, node and client certificates in {pki}", flush=True)
    run([*ingero_cmd(), "cert", "ca", "--out", str(pki)], quiet=True)
    for node in NODES:
        run([*ingero_cmd(), "cert", "node", node, "--san", "127.0.0.1,localhost", "--ca-dir", str(pki)], quiet=True)
    run([*ingero_cmd(), "cert", "client", "demo", "--ca-dir", str(pki)], quiet=True)


def start_agent(node: str, db: Path, pki: Path, work: Path) -> tuple[subprocess.Popen[str], Path]:
    ready = work / f"{node}.ready.json"
    argv = [
        *ingero_cmd(),
        "serve",
        "--db",
        str(db),
        "--node",
        node,
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        str(pki / f"node-{node}.pem"),
        "--tls-key",
        str(pki / f"node-{node}-key.pem"),
        "--client-ca",
        str(pki / "ca.pem"),
        "--ready-file",
        str(ready),
    ]
    return spawn(argv), ready


def write_config(path: Path, addrs: dict[str, str], pki: Path) -> None:
    nodes = "\n".join(f"    - {{name: {n}, addr: '{a}'}}" for n, a in addrs.items())
    path.write_text(
        "# written by scripts/fleet_demo.py: the three local agents and this client's mTLS material\n"
        f"fleet:\n  nodes:\n{nodes}\n"
        f"  ca_cert: {pki / 'ca.pem'}\n  client_cert: {pki / 'client-demo.pem'}\n"
        f"  client_key: {pki / 'client-demo-key.pem'}\n  timeout: 5s\n",
        encoding="utf-8",
    )


def run_dashboard(cfg: Path, pki: Path, work: Path) -> None:
    """``ingero dashboard`` over the demo fleet until Ctrl-C: prints its URL, the token and the CA to trust."""
    import secrets

    run([*ingero_cmd(), "cert", "node", "dashboard", "--san", "127.0.0.1,localhost", "--ca-dir", str(pki)], quiet=True)
    token = work / "dashboard.token"
    token.write_text(secrets.token_urlsafe(16) + "\n", encoding="utf-8")
    token.chmod(0o600)
    ready = work / "dashboard.ready.json"
    argv = [
        *ingero_cmd(),
        "dashboard",
        "--config",
        str(cfg),
        "--listen",
        f"127.0.0.1:{DASHBOARD_PORT}",
        "--tls-cert",
        str(pki / "node-dashboard.pem"),
        "--tls-key",
        str(pki / "node-dashboard-key.pem"),
        "--token-file",
        str(token),
        "--ready-file",
        str(ready),
    ]
    show(argv)
    proc = spawn(argv)
    try:
        _, info = local_agents.wait_ready(proc, ready, "dashboard")
        print(
            f"\ndashboard: {info['url']}\n  token: {token.read_text().strip()}\n"
            f"  trust the fleet CA {pki / 'ca.pem'} in your browser (or accept the certificate,"
            f" sha256 {info['fingerprint_sha256']})\n  the agents keep running until Ctrl-C",
            flush=True,
        )
        proc.wait()
        raise DemoError(f"the dashboard exited (rc={proc.returncode})")
    finally:
        local_agents.stop([proc])


def demo(work: Path, dashboard: bool = False) -> None:
    dbs = ensure_investigations()
    pki = work / "pki"
    make_pki(pki)
    procs: list[subprocess.Popen[str]] = []
    try:
        print("agents: ingero serve × 3 on 127.0.0.1 (mutual TLS)", flush=True)
        started = [start_agent(node, db, pki, work) for node, db in zip(NODES, dbs, strict=True)]
        procs = [p for p, _ in started]
        addrs: dict[str, str] = {}
        for node, (proc, ready) in zip(NODES, started, strict=True):
            line, info = local_agents.wait_ready(proc, ready, node)
            print(f"  {line}", flush=True)
            addrs[node] = f"{info['host']}:{info['port']}"
        cfg = work / "ingero.yaml"
        write_config(cfg, addrs, pki)
        run([*ingero_cmd(), "fleet", "status", "--config", str(cfg)])
        run([*ingero_cmd(), "query", "--config", str(cfg), SEED_QUERY])
        explained = run([*ingero_cmd(), "explain", "--config", str(cfg)])
        if "straggler: gpu-node-01 is the outlier" not in explained:
            raise DemoError("explain --nodes did not name gpu-node-01 as the straggler")
        if "root cause: CPU contention" not in explained:
            raise DemoError("explain --nodes did not name CPU contention on gpu-node-01")
        print(
            "\nthe fleet agrees: gpu-node-01 is the straggler — CPU contention (its checkpoint writes are context).",
            flush=True,
        )
        if dashboard:
            run_dashboard(cfg, pki, work)
        else:
            print(
                f"\ndashboard: https://127.0.0.1:{DASHBOARD_PORT}/ — run 'python scripts/fleet_demo.py --dashboard'"
                " to browse this fleet (the agents then keep running until Ctrl-C)",
                flush=True,
            )
    finally:
        local_agents.stop(procs)
        if procs:
            print(f"\nstopped {len(procs)} agent(s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (certificates, config)")
    ap.add_argument("--dashboard", action="store_true", help="serve the dashboard and keep the agents running")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ingero-demo-"))
    os.chmod(work, 0o700)
    try:
        demo(work, dashboard=args.dashboard)
        return 0
    except (DemoError, IngeroError) as e:
        print(f"fleet demo: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fleet demo: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
