"""``ingero query --nodes`` against what users do today: ``pdsh -w nodes 'sqlite3 -json db "SQL"'`` over ssh.

Run (root, Debian ``openssh-server pdsh sqlite3``): ``.venv/bin/python bench/bench_ssh.py [--sizes 4,16,64,128]``.

Side by side, the same SQL on the same database behind every "node", best of ``--repeat`` (3):

  ingero   the CLI as a user runs it: ``ingero query --nodes a:p,b:p,... --ca-cert ... "SQL"`` — a fresh
           process each time, TLS 1.3 + mTLS to real ``serve_api`` agents (bench_fleet's agent processes),
           a clock-skew sample per node, rows merged under ``node``
  pdsh     ``pdsh -R ssh -f N -w node[001-N] 'sqlite3 -json DB "SQL"'`` against an sshd this script
           starts on 127.0.0.1 with its own host and user keys; every node is an ssh alias of that
           sshd with its own ControlMaster connection, opened by a warm-up run and kept (ControlPersist)
           — the best case for ssh: no key exchange inside the measured runs

Every run's output is read back: each node's rows (pdsh: each host's ``sqlite3 -json`` array; ingero:
``--json``, the merged table's ``node`` column) must all be there, from every node, or the size's
verdict is MISS (incomplete). Target: ingero / pdsh ≤ 0.5x at every size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from bench_fleet import SAMPLE_DB, SQL, expected_rows, make_pki, raise_fd_limit, start_agents, tls_flags  # noqa: E402
from verdict import Runs, Target, summary, verdict  # noqa: E402

TARGET = Target(0.5, "x")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def sshd(d: Path, max_nodes: int) -> Iterator[tuple[Path, str]]:
    """An sshd on 127.0.0.1 with its own keys; yields (ssh_config, alias pattern prefix)."""
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(exist_ok=True)
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nMaxStartups {max_nodes * 2}\n"
        f"MaxSessions {max_nodes * 2}\nLogLevel ERROR\n"
    )
    lines = [
        "Host node*",
        "  HostName 127.0.0.1",
        f"  Port {port}",
        f"  IdentityFile {d / 'user'}",
        "  IdentitiesOnly yes",
        "  UserKnownHostsFile /dev/null",
        "  StrictHostKeyChecking no",
        "  BatchMode yes",
        "  LogLevel ERROR",
        "  ControlMaster auto",
        f"  ControlPath {d}/cm-%n",
        "  ControlPersist 300",
    ]
    (d / "ssh_config").write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while True:  # sshd has no readiness report: wait until one real login works (bounded)
            ok = subprocess.run(
                ["ssh", "-F", str(d / "ssh_config"), "-o", "ControlMaster=no", "node000", "true"],
                capture_output=True,
                check=False,
            )
            if ok.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not come up: {ok.stderr.decode()[-300:]}")
            time.sleep(0.1)
        yield d / "ssh_config", "node"
    finally:
        for sock in d.glob("cm-*"):  # close the ControlMaster connections
            subprocess.run(
                ["ssh", "-F", str(d / "ssh_config"), "-O", "exit", sock.name[3:]], capture_output=True, check=False
            )
        proc.terminate()
        proc.wait(timeout=10)


def pdsh_rows(out: str) -> dict[str, int]:
    """Rows per host in pdsh's output (``host: line`` for every line of each host's ``sqlite3 -json``)."""
    lines: dict[str, list[str]] = {}
    for line in out.splitlines():
        host, _, rest = line.partition(": ")
        lines.setdefault(host, []).append(rest)
    return {host: _json_rows(text) for host, text in lines.items()}


def _json_rows(text: list[str]) -> int:
    try:
        rows = json.loads("\n".join(text))
    except ValueError:
        return -1  # mangled output: not this host's rows
    return len(rows) if isinstance(rows, list) else -1


def ingero_rows(out: str) -> dict[str, int]:
    """Rows per node of ``ingero query --json`` (the merged table's ``node`` column)."""
    doc = json.loads(out)
    col = doc["columns"].index("node")
    counts: dict[str, int] = {}
    for row in doc["rows"]:
        counts[row[col]] = counts.get(row[col], 0) + 1
    return counts


def best_of(argv: list[str], repeat: int, env: dict[str, str], rows: Callable[[str], dict[str, int]], want: int,
            rows_each: int) -> Runs:  # fmt: skip
    """``repeat`` runs of ``argv``; a run goes as expected when it exits 0 and ``rows`` of its output finds
    ``want`` nodes with ``rows_each`` rows each."""
    timed = Runs()
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
        timed.add(time.perf_counter() - t0, run_problem(r, rows, want, rows_each))
    return timed


def run_problem(r: subprocess.CompletedProcess[str], rows: Callable[[str], dict[str, int]], want: int,
                rows_each: int) -> str:  # fmt: skip
    """ "" when the run exited 0 with every node's rows; else what was wrong."""
    err = r.stderr.strip().splitlines()
    last = f" ({err[-1][:200]})" if err else ""
    if r.returncode != 0:
        return f"{r.args[0]} exit {r.returncode}{last}"
    try:
        per_node = rows(r.stdout)
    except (ValueError, KeyError) as e:
        return f"{r.args[0]}: unreadable output ({e})"
    full = sum(1 for k in per_node.values() if k == rows_each)
    return (
        "" if full == want == len(per_node) else f"{r.args[0]}: {full}/{want} nodes with their {rows_each} rows{last}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4,16,64,128")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--procs", type=int, default=4, help="agent processes (bench_fleet's)")
    ap.add_argument("--quick", action="store_true", help="one run per size (same sizes and target)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_ssh: run as root (it starts its own sshd)")
    for tool in ("pdsh", "sqlite3", "ssh", SSHD):
        if not shutil.which(tool):
            sys.exit(f"bench_ssh: {tool} not found (apt-get install openssh-server pdsh sqlite3)")
    raise_fd_limit()
    repeat = 1 if args.quick else args.repeat
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        db = d / "node.db"
        shutil.copy(SAMPLE_DB, db)
        rows_each = expected_rows(db)
        (d / "pki").mkdir()
        make_pki(d / "pki")
        pki = d / "pki"
        tls = tls_flags(pki)
        (d / "ssh").mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if k != "INGERO_CONFIG"}
        env["HOME"] = tmp  # no user config file
        print(f"ingero query --nodes vs pdsh + sqlite3 over ssh (ControlMaster), best of {repeat}, "
              f"{rows_each} rows per node; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        with sshd(d / "ssh", max(sizes)) as (ssh_config, prefix):
            pdsh_env = {**env, "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {ssh_config}"}
            remote = f"sqlite3 -json {db} '{SQL}'"
            pool = start_agents(max(sizes), min(args.procs, max(sizes)), db, pki)
            try:
                for n in sizes:
                    hosts = f"{prefix}[{0:03d}-{n - 1:03d}]"
                    pdsh = ["pdsh", "-R", "ssh", "-f", str(n), "-w", hosts, remote]
                    best_of(pdsh, 1, pdsh_env, pdsh_rows, n, rows_each)  # warm-up: opens every ControlMaster
                    t_pdsh = best_of(pdsh, repeat, pdsh_env, pdsh_rows, n, rows_each)
                    nodes = ",".join(f"{s.host}:{s.port}" for s in pool.nodes[:n])
                    ingero = [sys.executable, "-m", "ingero", "query", "--json", "--nodes", nodes, *tls]
                    ingero += ["--fanout", str(n), SQL]
                    t_ingero = best_of(ingero, repeat, env, ingero_rows, n, rows_each)
                    verdict(
                        f"{n} nodes: ingero / pdsh+ssh",
                        t_ingero.best / t_pdsh.best,
                        TARGET,
                        complete=t_ingero.complete and t_pdsh.complete,
                        detail=f"{t_ingero.best:.2f} s vs {t_pdsh.best:.2f} s; ingero {t_ingero.detail}; "
                        f"pdsh {t_pdsh.detail}",
                    )
            finally:
                pool.close()
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
