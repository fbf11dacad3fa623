"""The detection catalog's real workloads (tests/test_bpf_catalog.py): one runner per scenario family,
each starting ``bpf_fixtures/catalog_job.c`` over the modelled device of ``bpf_fixtures/device_cudart.c``
(and the fake NCCL for ranks), plus whatever the family needs beside it — a CPU hog pinned to the
workload's core, a loopback tool server, a request generator, a memory cgroup, a file on disk.

A runner returns the GPU processes it ran (the disturbed one first). Every GPU program runs SCHED_FIFO
unless its family is CPU contention: on this shared 2-core machine the other engineers' work keeps
both cores busy (load 10+), and a woken thread at nice -20 still waits 0.4-3 ms for a CPU one time
in twenty (p95-p99 measured here) — real CPU contention, a second cause the family does not have.
Forked DataLoader workers go back to SCHED_OTHER (their slowness is the family). The contention
families run at nice 0 beside a hog at nice -10 on the same core, so any extra load only makes them
more contended. ``magnitude`` is the share of the GPU thread's wall time each scenario is built to lose:
far enough above its severity's threshold that a noisy machine moves it within the band
(:mod:`tests.scenarios.expectations`), never across it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingero.agent.trace.cgroups import cgroup2_mount
from ingero.agent.trace.tracer import TraceReady
from tests.bpf_support import build_library, build_program

HOG_CPU = max(os.sched_getaffinity(0))
# a memory cgroup: (its parent, the file of its limit) — cgroup v1's memory hierarchy, else v2's
MEMCG = (
    (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")
    if Path("/sys/fs/cgroup/memory").is_dir()
    else (Path("/sys/fs/cgroup"), "memory.max")
)
RT_PRIORITY = 10  # SCHED_FIFO: woken, the GPU thread runs at once, whatever else is runnable
CGROUP2 = cgroup2_mount() or Path("/sys/fs/cgroup")
POD_UIDS = ("5e1f0c2a-7d3b-4c8e-9a10-2b3c4d5e6f70", "b9e8d7c6-5a4b-4c3d-8e2f-1a0b9c8d7e6f")
CONTAINER_IDS = ("a1" * 32, "b9" * 32)


@contextmanager
def cgroup_dir(path: Path) -> Iterator[Path]:
    """A cgroup directory (and its missing parents) for the time of a scenario; removed, leaf first,
    once its processes are gone."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        for d in made:
            d.rmdir()


@dataclass
class Env:
    """Where the built programs are, and a scratch directory on the test's disk."""

    lib: Path  # libcudart.so.12 (the modelled device) and libnccl.so.2
    exe: Path
    work: Path
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    ready: TraceReady | None = None  # the recording the workloads run in
    started_ns: int | None = None  # where a runner's scenario starts, when not where it was called
    culprits: list[int] = field(default_factory=list)  # the processes a runner put beside its workload (a hog)

    def start(
        self,
        mode: str,
        secs: float,
        *args: object,
        env: dict[str, str] | None = None,
        realtime: bool = True,
        cpu: int | None = None,
        cgroup: Path | None = None,
    ) -> subprocess.Popen[str]:
        """``catalog_job MODE LIBDIR SECS ARGS...``: SCHED_FIFO unless ``realtime`` is False (nice 0),
        on ``cpu`` alone when given, in ``cgroup`` (a directory of a cgroup hierarchy) from its start."""
        prio = ["chrt", "-f", str(RT_PRIORITY)] if realtime else []
        pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
        join = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs")] if cgroup else []
        cmd = [*join, *pin, *prio, str(self.exe), mode, str(self.lib), str(secs), *map(str, args)]
        p = subprocess.Popen(
            cmd, env={**os.environ, **(env or {})}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.procs.append(p)
        return p

    def when_probed(self, p: subprocess.Popen[str], timeout: float = 30.0) -> None:
        """``p`` has made its first GPU call ("warm"): tell it to go on once the tracer probes its socket
        calls too (attached per traced process, a moment after it is found)."""
        assert p.stdout is not None and p.stdin is not None and self.ready is not None
        assert p.stdout.readline().strip() == "warm", p.args
        end = time.monotonic() + timeout
        while p.pid not in self.ready.socket_pids():
            assert time.monotonic() < end, f"socket calls of pid {p.pid} never probed"
            time.sleep(0.05)
        self.started_ns = time.time_ns()  # the scenario starts here: its warm-up call and wait are not in it
        p.stdin.write("go\n")
        p.stdin.flush()

    def hog(self, cpu: int, on_ms: float = 0, off_ms: float = 0, nice: int = -10) -> subprocess.Popen[bytes]:
        """A CPU hog (``catalog_job hog``) pinned to ``cpu`` at ``nice`` (-10: ahead of a nice-0 workload)."""
        p = subprocess.Popen(
            ["taskset", "-c", str(cpu), "nice", "-n", str(nice), str(self.exe), "hog", "-", str(on_ms), str(off_ms)],
            stdin=subprocess.DEVNULL,
        )
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)


def build_device(out: Path, work: Path) -> Env:
    """The modelled device as ``out/libcudart.so.12``, the fake NCCL beside it, and catalog_job;
    scratch files go to ``work``."""
    build_library("device_cudart.c", "libcudart.so.12", out)
    build_library("fake_nccl.c", "libnccl.so.2", out)
    return Env(out, build_program("catalog_job.c", out), work)


def done(p: subprocess.Popen[str], timeout: float = 60) -> int:
    """Wait for a workload; its pid. It must have finished its steps ("done N", exit 0)."""
    out, _ = p.communicate(timeout=timeout)  # closes stdin
    assert p.returncode == 0 and out.split()[:1] == ["done"], (p.args, p.returncode, out)
    return p.pid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def data_file(env: Env, name: str, mb: int) -> Path:
    path = env.work / name
    if not path.exists():
        with path.open("wb") as f:
            for _ in range(mb):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    return path


# --- the runners: (env) -> GPU pids, the disturbed process first -----------------------------------

SECS = 4.0


def healthy_sleeps(env: Env) -> list[int]:
    """The trainer (SCHED_FIFO, so never held off the CPU by it) shares its core with a batch job at nice
    19 that spins whenever the core is free: the timers that end its sleeps fire while the batch job runs."""
    batch = env.hog(HOG_CPU, nice=19)
    env.culprits.append(batch.pid)
    try:
        return [done(env.start("healthy", SECS, cpu=HOG_CPU))]
    finally:
        batch.kill()
        batch.wait()


def loader_fork(env: Env) -> list[int]:
    # 2 workers x 14 ms of CPU per batch for a ~5.5 ms step: the GPU waits for batches most of the time
    return [done(env.start("fork", SECS, 2, 14000))]


def loader_inline(env: Env) -> list[int]:
    # 2 ms of decoding per batch, 30 ms for every 5th (large images): the GPU waits ~40 % of the time
    return [done(env.start("inline", SECS, 30000, data_file(env, "dataset-cached.bin", 16)))]


def loader_disk(env: Env) -> list[int]:
    # 4 MiB read with O_DIRECT per step (2-8 ms on this disk, slower when it is busy)
    return [done(env.start("disk", SECS, 4, data_file(env, "dataset-disk.bin", 64)))]


def cpu_bound_loop(env: Env) -> list[int]:
    # ~5.6 ms of GPU work per step, then 4 ms of its own host code: the GPU waits ~30 % of every step
    return [done(env.start("cpubound", SECS, 4000))]


def _overlapped(env: Env, every: int) -> list[int]:
    # 40 ms queued; 2 ms of host code, then a 1 MiB read (about 1 ms here, 38 ms of room on a busy
    # disk) hides under the rest; every ``every``-th step a 128 MiB read (90-270 ms here) outlasts it:
    # only the excess is lost
    return [done(env.start("overlap", SECS, 1, 128, every, data_file(env, "dataset-disk.bin", 64)))]


def loader_overlap(env: Env) -> list[int]:
    return _overlapped(env, 8)


def healthy_overlap(env: Env) -> list[int]:
    return _overlapped(env, 0)


def serving_host_bound(env: Env) -> list[int]:
    return [done(env.start("serve", SECS, 700))]


def checkpoint(env: Env) -> list[int]:
    ckpt = env.work / "ckpt.pt"
    try:
        # 768 MiB every 0.6 s of training, written with O_DIRECT (1.1-2.8 GB/s here): 30-55 % of the time
        return [done(env.start("checkpoint", SECS, ckpt, 768, 600))]
    finally:
        ckpt.unlink(missing_ok=True)


def kv_pressure(env: Env) -> list[int]:
    return [done(env.start("kv", SECS))]


def leak(env: Env) -> list[int]:
    return [done(env.start("leak", SECS, 16))]


def fragmentation(env: Env) -> list[int]:
    return [done(env.start("frag", SECS, env={"FAKE_GPU_MEM_MB": "2048"}))]


def pageable_copy(env: Env) -> list[int]:
    return [done(env.start("pageable", SECS))]


def cold_start(env: Env) -> list[int]:
    return [done(env.start("steps", 2.5, env={"FAKE_GPU_INIT_MS": "900", "FAKE_GPU_MODULE_MS": "150"}))]


def kernel_drift(env: Env) -> list[int]:
    # the clock falls as the device heats: kernels +15 % per second, ~1.6x by the end
    return [done(env.start("steps", SECS, env={"FAKE_GPU_THROTTLE": "0.15"}))]


def noisy_neighbour(env: Env) -> list[int]:
    """Another tenant's inference pod runs on the same (time-sliced) device for the middle half of the
    trainer's run: while it does, the trainer's kernels wait behind the neighbour's. Each runs in its
    own container's cgroup (a kubelet's cgroupfs layout: kubepods/<qos>/pod<uid>/<container id>)."""
    queue = env.work / "gpu0.queue"
    queue.unlink(missing_ok=True)
    shared = {"FAKE_GPU_SHARED": str(queue)}
    pods = CGROUP2 / f"kubepods-ingero-catalog-{os.getpid()}"
    trainer_cg, neighbour_cg = (pods / "burstable" / f"pod{POD_UIDS[i]}" / CONTAINER_IDS[i] for i in (0, 1))
    with cgroup_dir(trainer_cg), cgroup_dir(neighbour_cg):
        p = env.start("steps", SECS, env=shared, cgroup=trainer_cg)
        time.sleep(0.25 * SECS)
        neighbour = env.start("steps", 0.5 * SECS, env=shared, cgroup=neighbour_cg)
        env.culprits.append(neighbour.pid)
        pids = [done(neighbour), done(p)]
    queue.unlink()
    return pids[::-1]


def _beside_hog(env: Env, secs: float, on_ms: float, off_ms: float) -> list[int]:
    """The trainer (nice 0) on HOG_CPU; a hog at nice -10 on the same core from 20 % to 85 % of it."""
    p = env.start("contend", secs, realtime=False)
    os.sched_setaffinity(p.pid, {HOG_CPU})
    time.sleep(0.2 * secs)
    hog = env.hog(HOG_CPU, on_ms, off_ms)
    env.culprits.append(hog.pid)
    time.sleep(0.65 * secs)
    hog.send_signal(signal.SIGKILL)
    hog.wait()
    return [done(p)]


def cpu_contention(env: Env) -> list[int]:
    return _beside_hog(env, SECS, 0, 0)


def cpu_bimodal(env: Env) -> list[int]:
    # the hog runs 20 ms of every 50: the syncs that meet it are several times slower, the rest are not
    return _beside_hog(env, SECS, 20, 30)


class ToolServer:
    """A tool behind loopback TCP: each request line is answered after ``delay_s`` (a search, an API)."""

    def __init__(self, delay_s: float) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.delay_s = delay_s
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            while conn.recv(4096):
                time.sleep(self.delay_s)
                conn.sendall(b'{"result": "..."}\n')

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=10)


def tool_call(env: Env) -> list[int]:
    """An agent server busy with user requests (the next sent as soon as one is answered): each is 250 ms
    of decoding, then a tool call answered 200 ms later, then the answer — the GPU idles inside requests."""
    server = ToolServer(0.2)
    try:
        port = free_port()
        p = env.start("toolcall", SECS, port, server.port, 250)
        env.when_probed(p)
        with socket.create_connection(("127.0.0.1", port)) as user:
            try:
                while True:
                    user.sendall(b"what makes my GPU idle?\n")
                    if not user.recv(64):
                        break
            except OSError:
                pass  # the agent closed the connection after its last answer
        return [done(p)]
    finally:
        server.close()


def healthy_idle_server(env: Env) -> list[int]:
    """The server waits in recv between requests sent at low load (one every ~0.35 s, exponential)."""
    import random

    port = free_port()
    p = env.start("server", SECS, port)
    env.when_probed(p)
    rng = random.Random(20)
    with socket.create_connection(("127.0.0.1", port)) as c:
        end = time.monotonic() + SECS + 0.5
        while time.monotonic() < end and p.poll() is None:
            time.sleep(rng.expovariate(1 / 0.35))
            try:
                c.sendall(bytes([rng.randrange(32, 127)]) + b" prompt\n")
                c.recv(64)
            except OSError:
                break
    return [done(p)]


def oom(env: Env) -> list[int]:
    """The trainer in a memory cgroup of 160 MiB: from 1.5 s a pinned staging pool grows 2 MiB a step
    until the kernel's OOM killer takes it (a memcg OOM: nothing outside the cgroup is touched)."""
    parent, limit = MEMCG
    with cgroup_dir(parent / f"ingero-catalog-oom-{os.getpid()}") as cg:
        (cg / limit).write_text(str(160 << 20))
        p = env.start("oom", SECS, 2, 1.5, cgroup=cg)
        p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL, f"not OOM-killed: {p.returncode}"
        time.sleep(0.5)  # the recording goes on past the kill
        return [p.pid]


# --- serving engines (trace --inference): a stand-in vLLM whose serving loop is catalog_job -----------


def _engine(env: Env, engine: str, scenario: str, mode: str, *args: object) -> list[int]:
    """A stand-in vLLM or SGLang server (``vllm serve`` / ``python3 -m sglang.launch_server``: found by its
    command line, its metrics scraped by the tracer) publishing ``scenario``'s gauges
    (tests/engine_standin.py); once scraped, it starts its serving loop as its child — ``catalog_job MODE``
    (SCHED_FIFO) through a link named as the engine's loop process is (``vllm``; SGLang's
    ``sglang::scheduler``), the name the tracer records. The scenario's window opens with the server."""
    from tests.engine_standin import launcher

    bindir = env.work / f"engine-{engine}"
    (bindir / "loop").mkdir(parents=True, exist_ok=True)
    link = bindir / "loop" / {"vllm": "vllm", "sglang": "sglang::scheduler"}[engine]
    if not link.exists():
        link.symlink_to(env.exe)
    loop = ["chrt", "-f", str(RT_PRIORITY), str(link), mode, str(env.lib), str(SECS), *map(str, args)]
    port = ["--port", str(free_port()), "--engine", engine, "--scenario", scenario]
    if engine == "vllm":
        cmd = [str(launcher(bindir, "vllm")), "serve", "m", *port]
    else:
        cmd = [str(launcher(bindir, "python3")), "-m", "sglang.launch_server", *port]
    p = subprocess.Popen([*cmd, "--run", *loop], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    env.procs.append(p)
    assert p.stdout is not None
    p.stdout.readline()  # its port
    env.started_ns = time.time_ns()
    child = p.stdout.readline().split()  # once the tracer's detection (every 5 s) has found and scraped it
    assert child[:1] == ["child"], (p.args, child)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and out.split()[:1] == ["done"], (p.args, p.returncode, out)
    return [int(child[1])]


def engine_cpu_bound(env: Env) -> list[int]:
    # a busy vLLM (64 running, a queue that comes and goes) whose loop runs 4 ms of host code after each
    # ~5.6 ms GPU step (as cpu_bound_loop): the GPU waits ~30 % of every step while requests wait
    return _engine(env, "vllm", "healthy_busy", "cpubound", 4000)


def healthy_engine_idle(env: Env) -> list[int]:
    # an SGLang whose gauges say no request is there while its loop spins on-CPU (as serving_host_bound's)
    return _engine(env, "sglang", "idle", "serve", 700)


# --- ranks: one job of three processes on the fake NCCL (every all-reduce waits for all ranks) -----

RANKS = 2  # one core each (pinned): ranks of a real job do not share cores
CPUS = sorted(os.sched_getaffinity(0))


def _ranks(env: Env, steps: int, extra_us: int, every: int, job: str) -> list[subprocess.Popen[str]]:
    go = env.work / f"go-{job}"
    go.unlink(missing_ok=True)
    nccl = {"FAKE_NCCL_ROOT": f"127.0.0.1:{free_port()}", "FAKE_NCCL_JOB": job}
    procs = [
        env.start("rank", 0, r, RANKS, steps, extra_us if r == 1 else 0, every, go, env=nccl, cpu=CPUS[r % len(CPUS)])
        for r in range(RANKS)
    ]
    go.touch()
    return procs


def late_rank(env: Env) -> list[int]:
    # rank 1 runs 25 ms more host code before every 5th all-reduce (~5 ms steps): rank 0 waits for it
    procs = _ranks(env, 300, 25000, 5, "catalog-late")
    pids = [done(p, timeout=120) for p in procs]
    return [pids[1], pids[0]]


def hung_rank(env: Env) -> list[int]:
    """Rank 1 stops (SIGSTOP) after 2 s: rank 0 sits in an all-reduce it never enters for 1.5 s."""
    procs = _ranks(env, 1_000_000, 0, 0, "catalog-hung")
    time.sleep(2.0)
    procs[1].send_signal(signal.SIGSTOP)
    time.sleep(1.5)
    for p in procs:
        p.kill()
        p.wait(timeout=30)
    return [procs[1].pid, procs[0].pid]


def healthy_collective(env: Env) -> list[int]:
    return [done(p, timeout=120) for p in _ranks(env, 500, 0, 0, "catalog-healthy")]


Runner = Callable[[Env], list[int]]
