"""The C heap's policy (ingero.explain.memory_policy) in real processes: a one-shot process keeps the memory
explain frees for reuse; the agent (``ingero serve``) gives it back after each explain request, so that its
resident memory returns to about its pre-request level. Memory figures only (RSS, peak RSS), generous bounds;
no timing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ingero.explain import memory_policy
from ingero.tls.context import client_ssl_context
from tests.conftest import ROOT
from tests.test_api_serve_cli import serve

MB = 1 << 20
pytestmark = pytest.mark.skipif(
    memory_policy._glibc().malloc_trim is None or not Path("/proc/self/clear_refs").exists(),
    reason="glibc and Linux /proc only",
)


def memory_kb(pid: int | str) -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (peak since the last reset), in kB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines) if k in ("VmRSS", "VmHWM")}


def reset_peak(pid: int | str) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


# A worker process: one explain-like request (numpy temporaries of 40 MB each, a few alive at once, all
# freed when it returns), under the entry point's choice; it prints RSS before, the request's peak, after.
WORKER = """
import sys
import numpy as np
from ingero.explain import memory_policy
from tests.test_memory_policy import memory_kb, reset_peak

getattr(memory_policy, sys.argv[1])()

@memory_policy.gives_back
def request():
    cols = [np.full(5_000_000, i, dtype=np.int64) for i in range(4)]  # 40 MB each
    for _ in range(3):
        cols = [np.cumsum(c) + 1 for c in cols]  # fresh temporaries, the old ones freed
    return int(sum(int(c[-1]) for c in cols))

np.cumsum(np.ones(1000))  # numpy's first use (its code, its caches) before measuring
before = memory_kb("self")["VmRSS"]
reset_peak("self")
request()
m = memory_kb("self")
print(before, m["VmHWM"], m["VmRSS"])
"""


def run_worker(choice: str) -> tuple[float, float]:
    """(MB the request added at its peak, MB still held after it) in a fresh process under ``choice``."""
    out = subprocess.run([sys.executable, "-c", WORKER, choice], cwd=ROOT, capture_output=True, text=True, check=True)
    before, peak, after = (int(x) * 1024 / MB for x in out.stdout.split())
    return peak - before, after - before


def test_one_shot_keeps_freed_memory_and_long_lived_gives_it_back() -> None:
    grew, held = run_worker("one_shot")
    assert grew > 120, grew  # several 40 MB columns alive at once
    assert held > 0.5 * grew, (grew, held)  # kept for reuse: the thresholds took effect (no munmap on free)
    grew, held = run_worker("long_lived")
    assert grew > 120, grew
    assert held < 0.2 * grew, (grew, held)  # the request's end trimmed the heap


LIGHT_AND_HEAVY = """
import numpy as np
from ingero.explain import memory_policy

memory_policy.long_lived()

@memory_policy.gives_back
def request(n):
    return int(np.cumsum(np.ones(n))[-1])

request(1000)  # a small query: the resident size did not grow, no malloc_trim walk of the heap
light = memory_policy._state["trimmed"]
request(20_000_000)  # 160 MB of columns: trimmed
print(light, memory_policy._state["trimmed"])
"""


def test_only_a_request_that_grew_the_heap_trims_it() -> None:
    out = subprocess.run([sys.executable, "-c", LIGHT_AND_HEAVY], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "1"]


def make_trainer(path: Path, n: int) -> None:
    """The explain benchmark's trainer (bench/bench_explain.py), ``n`` events."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from bench_explain import make_db
    finally:
        sys.path.remove(str(ROOT / "bench"))
    make_db(path, n)


def test_agent_gives_back_what_an_explain_request_took(tmp_path: Path) -> None:
    db = tmp_path / "trainer.db"
    make_trainer(db, 400_000)
    with serve(tmp_path, "--db", str(db), "--node", "n1") as (proc, _, ready):
        cert = tmp_path / "home" / ".ingero" / "tls" / "server-cert.pem"
        with httpx.Client(verify=client_ssl_context(ca_cert=cert), base_url=ready["url"], timeout=120) as c:

            def chains() -> None:
                doc = c.get("/api/v1/chains").json()
                assert doc["ok"] and doc["ledger"], doc

            chains()  # the first request imports numpy and the engine (code, not freed memory)
            before = memory_kb(proc.pid)["VmRSS"]
            reset_peak(proc.pid)
            chains()
            after = memory_kb(proc.pid)
    grew, held = (after["VmHWM"] - before) / 1024, (after["VmRSS"] - before) / 1024
    # the request's columns and temporaries (tens of MB on 400 k events): had the first request's memory
    # been kept, this one would reuse it and grow by nothing
    assert grew > 25, (grew, held)
    assert held < 0.25 * grew + 8, (grew, held)  # back near the pre-request level, not at the peak
