"""Clock-skew estimation against injected offsets: real ``ingero serve`` agents under libfaketime.

One agent per offset (−200 ms … +1 s), each a real ``ingero serve`` (mTLS on 127.0.0.1) started with
``LD_PRELOAD=libfaketime.so.1 FAKETIME=<offset>``, so its wall clock — and the receive/transmit
timestamps every answer carries (headers) and /api/v1/time returns — is shifted by exactly that much. This process (real clock) then runs
``fleet_status`` several times; every estimate must contain the injected offset within its stated
uncertainty (offset ± delay/2). Printed per offset: median estimate, median uncertainty, worst
|error| and worst |error| / uncertainty (must stay <= 1.0), and how many rounds held.

Usage: .venv/bin/python bench/bench_skew.py [--rounds N] [--samples N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingero.config import NodeSpec
from ingero.fleet import local_agents

ROOT = Path(__file__).resolve().parents[1]
FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
DB = ROOT / "tests" / "data" / "ingero-samples" / "sample-gpu-node-01.db"
OFFSETS_MS = [-200.0, -50.0, -10.0, 0.0, 5.0, 50.0, 300.0, 1000.0]


def faketime_spec(ms: float) -> str:
    return f"{ms / 1000:+.3f}"


def start_agent(name: str, offset_ms: float, pki: Path, work: Path) -> tuple[subprocess.Popen[str], NodeSpec]:
    ready = work / f"{name}.json"
    env = {
        **os.environ,
        "LD_PRELOAD": str(FAKETIME_LIB),
        "FAKETIME": faketime_spec(offset_ms),
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    argv = [
        sys.executable, "-m", "ingero", "serve", "--db", str(DB), "--node", name, "--listen", "127.0.0.1:0",
        "--tls-cert", str(pki / "node-bench.pem"), "--tls-key", str(pki / "node-bench-key.pem"),
        "--client-ca", str(pki / "ca.pem"), "--ready-file", str(ready),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _, info = local_agents.wait_ready(proc, ready, name)
    except BaseException:
        local_agents.stop([proc])
        raise
    return proc, NodeSpec(info["host"], int(info["port"]), name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="fleet_status rounds (each: every node, N samples)")
    ap.add_argument("--samples", type=int, default=4, help="/time samples per node per round")
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    args = ap.parse_args()
    if not FAKETIME_LIB.exists():
        print(f"bench_skew: {FAKETIME_LIB} missing (apt-get install faketime); nothing measured")
        return 0
    rounds = 3 if args.quick else args.rounds

    from ingero.fleet.operations import status_sync
    from ingero.fleet.settings import ClientSettings
    from ingero.tls.pki import create_ca, issue_cert, split_sans

    work = Path(tempfile.mkdtemp(prefix="ingero-bench-skew-"))
    procs: list[subprocess.Popen[str]] = []
    try:
        pki = work / "pki"
        create_ca(pki)
        issue_cert(pki, "node", "bench", split_sans(["127.0.0.1"]))
        issue_cert(pki, "client", "bench")
        nodes: list[NodeSpec] = []
        injected: dict[str, float] = {}
        for ms in OFFSETS_MS:
            name = f"shift-{'minus' if ms < 0 else 'plus'}{abs(ms):.0f}ms"
            proc, spec = start_agent(name, ms, pki, work)
            procs.append(proc)
            nodes.append(spec)
            injected[name] = ms
        settings = ClientSettings(
            ca_cert=str(pki / "ca.pem"),
            client_cert=str(pki / "client-bench.pem"),
            client_key=str(pki / "client-bench-key.pem"),
            skew_samples=args.samples,
        )
        est: dict[str, list[tuple[float, float]]] = {n.label: [] for n in nodes}
        for _ in range(rounds):
            status = status_sync(nodes, settings)
            for o in status.outcomes:
                if o.skew is not None:
                    est[o.spec.label].append((o.skew.offset_ms, o.skew.uncertainty_ms))
        print(
            f"clock skew vs injected offsets (libfaketime): {rounds} rounds; per node the /info answer's own "
            "sample (headers) and one /time sample, the lowest-delay one wins"
        )
        print(
            f"{'injected':>9} {'estimate':>10} {'±uncert.':>9} {'worst |err|':>12} {'worst err/unc':>14} "
            f"{'held':>6}  target: |err| <= uncertainty every time"
        )
        all_ok = True
        for name, ms in injected.items():
            pairs = est[name]
            if not pairs:
                print(f"{ms:>8.0f}ms   no estimate (node did not answer)")
                all_ok = False
                continue
            errors = [abs(off - ms) for off, _ in pairs]
            ratios = [abs(off - ms) / unc if unc > 0 else float("inf") for off, unc in pairs]
            held = sum(1 for e, (_, unc) in zip(errors, pairs, strict=True) if e <= unc + 1e-6)
            all_ok &= held == len(pairs)
            print(
                f"{ms:>8.0f}ms {statistics.median(o for o, _ in pairs):>8.2f}ms "
                f"{statistics.median(u for _, u in pairs):>7.2f}ms {max(errors):>10.3f}ms "
                f"{max(ratios):>14.2f} {held:>3}/{len(pairs):<2}"
            )
        print(f"within the reported uncertainty every time: {'yes' if all_ok else 'NO'}")
    finally:
        local_agents.stop(procs)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
