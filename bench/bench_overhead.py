"""The agent's tax on the node (issue 23): what processes it does not trace pay, and what it costs at rest.

Run as root: ``.venv/bin/python bench/bench_overhead.py [--quick] [--rest]`` (``--rest``: parts 2 and 3
only, ~1 min). Three parts, each side by side in
one run (the machine is shared and noisy: figures are the looping thread's own CPU time — probe
programs run in its context and count, preemption does not — best of the repetitions, with the median):

1. **Socket round trips of an untraced process** (``bpf_fixtures/socket_trips.c``: sendto + recvfrom
   of 64 bytes over a socketpair, one thread, never blocking), rounds alternating with no BPF at all.
   Each mechanism that could record socket calls is printed as ns per round trip over the bare loop
   (two calls, an entry and an exit program each), its floor (an attached program that returns at
   once) beside the same program with the traced-process check at its first instruction:
     syscall tracepoints   sys_enter/exit_sendto, _recvfrom (the agent's mechanism before)
     raw_tp sys_enter/exit the raw syscall tracepoints (every syscall of every process runs them)
     raw_tp sock_*_length  the socket layer's own tracepoints (6.3+: no fd, no entry: bytes only)
     fentry/fexit          __sys_sendto/__sys_recvfrom (BTF trampolines): tried; a kernel in lockdown
                           refuses tracing programs, which is said
     libc uprobes          uprobes on libc's sendto/recvfrom for one other process (perf pid filter):
                           the mechanism the agent uses now; also what a traced process pays for it
   Not measured, with the reason printed: a per-cgroup program (cgroup_skb, cgroup/sendmsg hooks see
   inet packets or UDP sends: not a socketpair, never the fd), and "attach the socket probes only
   while a traced process exists" (the agent does so: with no target it has no socket probe at all).
   Then the real agent (``run_trace``, default options) against no agent:  target <= 1.05x
   and with ``--socket-rw`` (opt-in: its own figure, no target).
2. **The agent at rest**: ``ingero trace`` (the CLI, default options, no GPU process), its CPU over a
   window from /proc/<pid>/stat:  target <= 0.5 % of a core; the same agent with --no-host --no-io (no
   host-wide events: the pipeline, drain, snapshots and rescans alone) too. Each is judged only when
   the agent was at rest (fewer than REST_EVENTS_PER_S events recorded a second: a shared machine's
   block I/O and exec storms, or another job's GPU calls the agent follows, are work, not rest).
3. **RSS**: the agent's resident memory and what holds it, stage by stage in a fresh interpreter
   (interpreter, our imports, ``import bcc``, compile + load), the ring buffer's share (the kernel's
   ring pages, mapped twice) and the compiler libraries' share. Judged on the PSS (libLLVM's pages are
   paged out after loading only when no other process maps them: another bcc tool running keeps them
   in this RSS too):  target <= 160 MB (RSS 202 MB before).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from verdict import Target, no_verdict, summary, verdict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ingero.agent.trace.tracer import TraceOptions, TraceReady  # noqa: E402
from ingero.identity import Identity  # noqa: E402
from tests.bpf_support import record  # noqa: E402

FIXTURE = ROOT / "tests" / "bpf_fixtures" / "socket_trips.c"
ROUND_TRIP = Target(1.05, "x")
IDLE_CPU = Target(0.5, " % of a core")
RSS = Target(160, " MB", fmt="{:.0f}")
REST_EVENTS_PER_S = 20.0


def judge(name: str, measured: float, target: Target, quick: bool, *, complete: bool = True, detail: str = "") -> None:
    """A verdict; a quick run's figures are shown, nothing judged."""
    if quick:
        no_verdict(name, measured, target, "quick run", detail=detail)
    else:
        verdict(name, measured, target, complete=complete, detail=detail)


FILTER = """
BPF_HASH(targets, u32, u8, 65536);
static __always_inline int traced(void) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return targets.lookup(&tgid) != 0;
}
"""
# name -> (floor program text, filtered program text, how to attach)
TP_NAMES = ("sendto", "recvfrom")
PROGRAMS: dict[str, tuple[str, str, str]] = {
    "syscall tracepoints": (
        "int en(void *ctx) { return 0; }\nint ex(void *ctx) { return 0; }",
        FILTER + "int en(void *ctx) { return traced(); }\nint ex(void *ctx) { return traced(); }",
        "syscalls",
    ),
    "raw_tp sys_enter/exit": (
        "RAW_TRACEPOINT_PROBE(sys_enter) { return 0; }\nRAW_TRACEPOINT_PROBE(sys_exit) { return 0; }",
        FILTER
        + "RAW_TRACEPOINT_PROBE(sys_enter) { return (ctx->args[1] == 44 || ctx->args[1] == 45) && traced(); }\n"
        + "RAW_TRACEPOINT_PROBE(sys_exit) { return traced(); }",
        "auto",
    ),
    "raw_tp sock_*_length": (
        "RAW_TRACEPOINT_PROBE(sock_send_length) { return 0; }\nRAW_TRACEPOINT_PROBE(sock_recv_length) { return 0; }",
        FILTER
        + "RAW_TRACEPOINT_PROBE(sock_send_length) { return traced(); }\n"
        + "RAW_TRACEPOINT_PROBE(sock_recv_length) { return traced(); }",
        "auto",
    ),
    "fentry/fexit": (
        "KFUNC_PROBE(__sys_sendto) { return 0; }\nKRETFUNC_PROBE(__sys_sendto) { return 0; }\n"
        "KFUNC_PROBE(__sys_recvfrom) { return 0; }\nKRETFUNC_PROBE(__sys_recvfrom) { return 0; }",
        FILTER + "KFUNC_PROBE(__sys_sendto) { return traced(); }\nKRETFUNC_PROBE(__sys_sendto) { return traced(); }\n"
        "KFUNC_PROBE(__sys_recvfrom) { return traced(); }\nKRETFUNC_PROBE(__sys_recvfrom) { return traced(); }",
        "auto",
    ),
    "libc uprobes, another pid": (
        "int en(void *ctx) { return 0; }\nint ex(void *ctx) { return 0; }",
        "",
        "uprobe",
    ),
}


class Loop:
    """socket_trips: one run's (CPU ns, wall ns) per round trip; ``wait`` lets the caller enrol it first."""

    def __init__(self, exe: Path, trips: int) -> None:
        self.exe, self.trips = exe, trips

    def run(self) -> tuple[float, float]:
        out = subprocess.run([str(self.exe), str(self.trips)], check=True, capture_output=True, text=True).stdout
        wall, cpu = (float(x) for x in out.split())
        return cpu, wall

    def start_waiting(self) -> tuple[subprocess.Popen[str], int]:
        p = subprocess.Popen(
            [str(self.exe), str(self.trips), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert p.stdout is not None
        return p, int(p.stdout.readline().split()[1])

    @staticmethod
    def finish(p: subprocess.Popen[str]) -> tuple[float, float]:
        out, _ = p.communicate("go\n", timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"socket_trips exited {p.returncode}")
        wall, cpu = (float(x) for x in out.split())
        return cpu, wall


def attach(kind: str, text: str) -> Any:
    """A BPF object with ``text`` attached the ``kind`` way (raises what bcc raises when refused)."""
    from bcc import BPF

    b = BPF(text=text.encode())
    try:
        if kind == "syscalls":
            for name in TP_NAMES:
                b.attach_tracepoint(tp=f"syscalls:sys_enter_{name}".encode(), fn_name=b"en")
                b.attach_tracepoint(tp=f"syscalls:sys_exit_{name}".encode(), fn_name=b"ex")
        elif kind == "uprobe":  # for this (benchmark) process only: the loop is another process
            for name in TP_NAMES:
                b.attach_uprobe(name=b"c", sym=name.encode(), fn_name=b"en", pid=os.getpid())
                b.attach_uretprobe(name=b"c", sym=name.encode(), fn_name=b"ex", pid=os.getpid())
    except BaseException:
        b.cleanup()
        raise
    return b


def traced_uprobe_floor(loop: Loop) -> tuple[float, float]:
    """The loop itself probed (empty programs on libc's sendto/recvfrom, for its pid, at the offsets the
    agent uses: elfsyms.probe_offset): the floor of what a traced process pays."""
    from bcc import BPF

    from ingero.agent.trace import elfsyms, libc_sockets

    p, pid = loop.start_waiting()
    path = libc_sockets.libc_of(pid)
    assert path is not None
    image = elfsyms.load(path)
    b = BPF(text=PROGRAMS["libc uprobes, another pid"][0].encode())
    try:
        for name in TP_NAMES:
            where = elfsyms.probe_offset(image, name)
            vaddr = image.offset_to_vaddr(where[0]) if where is not None else None
            assert vaddr is not None
            b.attach_uretprobe(name=path.encode(), addr=vaddr, fn_name=b"ex", pid=pid)
            b.attach_uprobe(name=path.encode(), addr=vaddr, fn_name=b"en", pid=pid)
        return Loop.finish(p)
    finally:
        b.cleanup()


def _finish(p: subprocess.Popen[str], _ready: TraceReady) -> tuple[float, float]:
    return Loop.finish(p)


def traced_by_agent(loop: Loop, tmp: Path, reps: int) -> list[tuple[float, float]]:
    """The loop as a --pid target of the real agent: its socket calls recorded (counted: all of them)."""
    out = []
    for _ in range(reps):
        p, pid = loop.start_waiting()
        db = tmp / f"traced{time.monotonic_ns()}.db"
        out.append(with_agent(db, partial(_finish, p), pids=[pid]))
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            (n,) = c.execute("SELECT coalesce(sum(count), 0) FROM event_aggregates WHERE source = 7").fetchone()
        if n != 2 * loop.trips:
            raise RuntimeError(f"the traced loop's socket calls: {n} recorded, {2 * loop.trips} made")
    return out


def with_agent(db: Path, action: Callable[[TraceReady], Any], **extra: Any) -> Any:
    """The real agent (run_trace: probes, pipeline, writer), default options, around ``action``."""
    return record(TraceOptions(db_path=db, identity=Identity("bench"), output="quiet", **extra), action)[1]


class Blocks:
    """Each block: a mechanism's runs beside the no-BPF runs made just before it (same conditions)."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}
        self.ratios: dict[str, list[float]] = {}
        self.bare: list[float] = []

    def add(self, key: str, bare: list[tuple[float, float]], got: list[tuple[float, float]]) -> None:
        b, g = [r[0] for r in bare], [r[0] for r in got]
        self.bare += b
        self.runs.setdefault(key, []).extend(g)
        self.ratios.setdefault(key, []).append(statistics.median(g) / statistics.median(b))

    def show(self, key: str) -> float:
        """Print the key's line; its median block ratio."""
        cpu, ratios, base = self.runs[key], self.ratios[key], statistics.median(self.bare)
        mid = statistics.median(ratios)
        print(
            f"  {key:<40} {min(cpu):8.1f} ns/trip (median {statistics.median(cpu):8.1f})  "
            f"+{statistics.median(cpu) - base:7.1f} ns  {mid:5.2f}x (blocks {min(ratios):.2f}-{max(ratios):.2f}x)",
            flush=True,
        )
        return mid


def part_sockets(loop: Loop, tmp: Path, rounds: int, reps: int, quick: bool) -> None:
    print("1. socket round trips of an untraced process (CPU ns per sendto+recvfrom round trip)")
    print("   ratio = median of the block / median of the no-BPF runs just before it; range over the blocks")
    blocks = Blocks()
    refused: dict[str, str] = {}
    for r in range(rounds):
        for name, (floor, filtered, kind) in PROGRAMS.items():
            for variant, text in (("floor", floor), ("+ target check", filtered)):
                if not text or name in refused:
                    continue
                bare = [loop.run() for _ in range(reps)]
                try:
                    b = attach(kind, text)
                except Exception as e:  # bcc raises plain Exception (EPERM: lockdown)
                    refused[name] = str(e).splitlines()[0][:90]
                    continue
                try:
                    blocks.add(f"{name}: {variant}", bare, [loop.run() for _ in range(reps)])
                finally:
                    b.cleanup()
        bare = [loop.run() for _ in range(reps)]
        blocks.add("traced process: libc uprobes floor", bare, [traced_uprobe_floor(loop) for _ in range(reps)])
        bare = [loop.run() for _ in range(reps)]
        blocks.add("traced process: agent (--pid)", bare, traced_by_agent(loop, tmp, reps))
        bare = [loop.run() for _ in range(reps)]
        blocks.add(
            "agent (default options)", bare, with_agent(tmp / f"a{r}.db", lambda _: [loop.run() for _ in range(reps)])
        )
        bare = [loop.run() for _ in range(reps)]
        rw = with_agent(tmp / f"rw{r}.db", lambda _: [loop.run() for _ in range(reps)], socket_rw=True)
        blocks.add("agent --socket-rw (opt-in)", bare, rw)
    print(f"  {'no BPF':<40} {min(blocks.bare):8.1f} ns/trip (median {statistics.median(blocks.bare):8.1f})")
    for key in blocks.runs:
        if not key.startswith(("agent", "traced")):
            blocks.show(key)
    for name, why in refused.items():
        print(f"  {name + ':':<40} refused by this kernel ({why})")
    print(
        "  per-cgroup program:                      not measured: cgroup_skb and cgroup/sendmsg hooks see inet packets\n"
        "                                           or UDP sends, never a socketpair nor the socket call's fd"
    )
    print(
        "  attach only while a traced process exists: what the agent does (no target: no socket probe, cost 0);\n"
        "                                           with targets, untraced processes still pay nothing (pid filter)"
    )
    blocks.show("traced process: libc uprobes floor")
    blocks.show("traced process: agent (--pid)")
    agent = blocks.show("agent (default options)")
    rw = blocks.show("agent --socket-rw (opt-in)")
    complete = len(blocks.runs["agent (default options)"]) == rounds * reps
    judge("untraced round trip, agent / no BPF", agent, ROUND_TRIP, quick, complete=complete)
    print(f"  --socket-rw's own figure: {rw:.2f}x (opt-in, no target)")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(pid: int) -> dict[str, int]:
    """MB: VmRSS, RssAnon, RssFile (/proc/<pid>/status) and Pss (smaps_rollup: pages shared with other
    processes, e.g. libLLVM mapped by another bcc tool, counted in proportion)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) // 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            out["Pss"] = int(line.split()[1]) // 1024
    return out


def _ring_mb(pid: int) -> float:
    """Resident MB of the agent's BPF map mappings (the ring buffer: kernel pages, mapped twice)."""
    kb, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(" ", 1)[0]
        if ":" not in first:  # a mapping's header line: "lo-hi perms offset dev inode path"
            inside = "anon_inode:bpf-map" in line
        elif inside and line.startswith("Rss:"):
            kb += int(line.split()[1])
    return kb / 1024


def agent_at_rest(tmp: Path, seconds: float, extra: list[str]) -> dict[str, Any]:
    """``ingero trace`` (the CLI) at rest: CPU % over ``seconds`` after start-up, events it recorded, RSS."""
    ready = tmp / f"ready{len(extra)}.json"
    db = tmp / f"rest{len(extra)}.db"
    cmd = [str(ROOT / ".venv" / "bin" / "ingero"), "trace", "--db", str(db), "--quiet", "--ready-file", str(ready)]
    born = time.monotonic()
    p = subprocess.Popen([*cmd, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ingero trace did not start: {p.stderr.read() if p.stderr else ''}")
            time.sleep(0.1)
        pid = json.loads(ready.read_text())["pid"]
        time.sleep(2.0)  # the first rescan and snapshot
        c0, t0 = _cpu_s(pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = _cpu_s(pid), time.monotonic()
        mem, ring = _status(pid), _ring_mb(pid)
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
        life = time.monotonic() - born
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        (events,) = c.execute(
            "SELECT coalesce(sum(count), 0) FROM event_aggregates WHERE source != 3 OR op != 3"
        ).fetchone()
    return {"cpu_pct": 100 * (c1 - c0) / (t1 - t0), "events_per_s": events / life, "mem": mem, "ring": ring}


RSS_STAGES = """
import json, sys
sys.path.insert(0, sys.argv[1])
def rss():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile"):
            d[k] = int(v.split()[0]) // 1024
    return d
out = {"interpreter": rss()}
import numpy, trio, sqlite3
from ingero.agent.trace import tracer, pipeline, recorder
from ingero.store import writer
out["our imports"] = rss()
import bcc
out["import bcc (libbcc, LLVM, clang mapped)"] = rss()
from ingero.agent.trace import probes
orig = probes.release_compiler_memory
probes.release_compiler_memory = lambda: None
p = probes.BpfProbes(probes.ProbeOptions())
out["compiled + loaded"] = rss()
orig()
out["after release_compiler_memory"] = rss()
p.close()
print(json.dumps(out))
"""


def part_rest(tmp: Path, seconds: float, quick: bool) -> None:
    print(f"2. the agent at rest: ingero trace, no GPU process, CPU over {seconds:.0f} s")
    default = agent_at_rest(tmp, seconds, [])
    bare = agent_at_rest(tmp, seconds, ["--no-host", "--no-io"])
    for name, run in (("idle CPU, default options", default), ("idle CPU, --no-host --no-io (no host events)", bare)):
        rate = run["events_per_s"]
        if rate <= REST_EVENTS_PER_S:
            judge(name, run["cpu_pct"], IDLE_CPU, quick, detail=f"events recorded {rate:.0f}/s")
        else:  # a shared machine's block I/O, exec storms or another job's GPU calls are work, not rest
            no_verdict(name, run["cpu_pct"], IDLE_CPU, f"host not at rest: {rate:,.0f} events/s recorded")
    print("3. RSS of the agent")
    mem = default["mem"]
    print(
        f"  ingero trace: VmRSS {mem['VmRSS']} MB = anonymous {mem['RssAnon']} MB + file-backed {mem['RssFile']} MB "
        f"(PSS {mem['Pss']} MB: pages shared with other processes counted in proportion); "
        f"of which the BPF ring buffer {default['ring']:.0f} MB (the kernel's ring pages, mapped twice: --ring-mb)"
    )
    out = subprocess.run(
        [sys.executable, "-c", RSS_STAGES, str(ROOT)], check=True, capture_output=True, text=True
    ).stdout.strip()
    last: dict[str, int] = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    for stage, m in json.loads(out.splitlines()[-1]).items():
        print(
            f"  {stage:<42} RSS {m['VmRSS']:4d} MB ({m['VmRSS'] - last['VmRSS']:+4d}; anonymous {m['RssAnon']:3d}, "
            f"file {m['RssFile']:3d})"
        )
        last = m
    print(
        "  (file pages of libLLVM/libclang are paged out after loading unless another process maps them too;\n"
        "   bcc keeps its LLVM module — the maps live in it — so the compiler's remaining heap stays)"
    )
    judge("agent PSS (ingero trace, default options)", mem["Pss"], RSS, quick, detail=f"VmRSS {mem['VmRSS']} MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, shorter windows")
    ap.add_argument("--rest", action="store_true", help="parts 2 and 3 only: the agent at rest and its RSS")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_overhead: needs root (eBPF); run: sudo .venv/bin/python bench/bench_overhead.py")
        return 2
    rounds, reps, trips, seconds = (1, 2, 50_000, 6.0) if args.quick else (3, 4, 200_000, 20.0)
    print(f"bench_overhead: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (a busy machine: read ranges)")
    with tempfile.TemporaryDirectory(prefix="ingero-overhead-") as d:
        tmp = Path(d)
        if not args.rest:
            exe = tmp / "socket_trips"
            subprocess.run(["gcc", "-O2", "-o", str(exe), str(FIXTURE)], check=True)
            part_sockets(Loop(exe, trips), tmp, rounds, reps, args.quick)
        part_rest(tmp, seconds, args.quick)
    return summary()


if __name__ == "__main__":
    raise SystemExit(main())
