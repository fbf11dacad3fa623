"""The ``investigations/`` sample databases: a deterministic 3-node DDP training cluster.

Three nodes run the same data-parallel job (ranks 0, 1, 2 of world size 3) for 90 s from
2026-04-14T10:00:00Z. ``gpu-node-01`` (rank 0) is the straggler: from t=20 s a preprocessing job with
16 workers competes for its CPUs (it preempts the trainer: hundreds of involuntary off-CPU periods, ~20 ms each, CPU > 90 %)
and, being rank 0, it writes a checkpoint every 30 s (bursts of block writes issued by the trainer). Its cudaStreamSync and
cuLaunchKernel tails follow from both. ``gpu-node-02`` and ``-03`` see ordinary background noise (short preemptions, voluntary futex/poll
sleeps, journald writes by a kworker — context, never a cause).

``generate(out_dir)`` writes ``sample-gpu-node-0{1,2,3}.db`` and ``sample-cluster.db`` (the three nodes
written one after another into one file, each through its own :class:`StoreWriter` identity), with the
chains the explain engine computes on each node stored in ``causal_chains``. Same inputs, same bytes of
content: ``tests/test_investigations.py`` regenerates and compares every table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingero.demo.synth import CU_LAUNCH, CU_MEM_ALLOC, LAUNCH, MEMCPY_ASYNC, SESSION, STREAM_SYNC, SyntheticNode
from ingero.timeutil import NS_PER_MS, NS_PER_US, parse_time

BASE_NS = parse_time("2026-04-14T10:00:00Z")
SECONDS = 90.0
WORLD = 3
CONTENTION_FROM = 20.0
CHECKPOINTS = (30.0, 60.0, 88.0)


@dataclass(frozen=True)
class DemoNode:
    name: str
    rank: int
    trainer: int
    seed: int
    straggler: bool = False


NODES = (
    DemoNode("gpu-node-01", 0, 3187, 101, straggler=True),
    DemoNode("gpu-node-02", 1, 3204, 202),
    DemoNode("gpu-node-03", 2, 3199, 303),
)
FILES = {spec.name: f"sample-{spec.name}.db" for spec in NODES}
CLUSTER_FILE = "sample-cluster.db"

LAUNCH_FRAMES = [
    ("cuLaunchKernel", "libcuda.so.1"),
    ("cublasLtMatmul", "libcublasLt.so.12"),
    ("at::cuda::blas::gemm_internal_cublaslt", "libtorch_cuda.so"),
    ("torch::autograd::Engine::evaluate_function", "libtorch_cpu.so"),
]
ALLOC_FRAMES = [
    ("cuMemAlloc_v2", "libcuda.so.1"),
    ("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc", "libc10_cuda.so"),
    ("at::detail::empty_cuda", "libtorch_cuda.so"),
]
SYNC_FRAMES = [
    ("cudaStreamSynchronize", "libcudart.so.12"),
    ("c10::cuda::stream_synchronize", "libc10_cuda.so"),
    ("torch::cuda::synchronize", "libtorch_python.so"),
]


def build_node(spec: DemoNode) -> SyntheticNode:
    rec = SyntheticNode(spec.name, BASE_NS, spec.seed, rank=spec.rank, world_size=WORLD)
    rec.session = {
        **SESSION,
        "gpu_model": "NVIDIA A100-SXM4-40GB (synthetic)",
        "pid_filter": str(spec.trainer),
        "flags": "stack,record,synthetic",
    }
    rng, pid = rec.rng, spec.trainer
    snap_offset = spec.rank * 0.01  # distinct snapshot timestamps once the nodes share one file
    rec.process(pid, f"python3 train.py --rank {spec.rank}", 0.0, exec_event=False)
    rec.process(100 + spec.rank, "ingero", 0.0, exec_event=False)
    rec.process(281, "kworker/u16:6+flush-259:0", 0.0, exec_event=False)
    if spec.straggler:
        rec.process(3350, "python3 preprocess.py --workers 16", CONTENTION_FROM - 0.4)
    launch, alloc, sync_stack = rec.stack(LAUNCH_FRAMES), rec.stack(ALLOC_FRAMES), rec.stack(SYNC_FRAMES)
    t, it = 0.05, 0
    while t < SECONDS:
        contended = spec.straggler and t >= CONTENTION_FROM
        ckpt = spec.straggler and any(c <= t < c + 2.5 for c in CHECKPOINTS)
        rec.ev(t, pid, *MEMCPY_ASYNC, rec.jitter(15 * NS_PER_US), arg0=8 << 20, arg1=1)
        rec.ev(t + 40e-6, pid, *LAUNCH, rec.jitter(8 * NS_PER_US, 0.15))
        for k in range(2):
            dur = rec.jitter(14 * NS_PER_US, 0.15)
            if contended and rng.random() < 0.06:  # preempted mid-launch for a time slice
                off = float(rng.uniform(0.4, 1.4)) * NS_PER_MS
                rec.sched(t + 80e-6 + k * 30e-6, pid, off, by=3350)
                dur += off
            rec.ev(t + 80e-6 + k * 30e-6, pid, *CU_LAUNCH, dur, stack=launch if k == 0 else 0)
        if it % 25 == 0:
            rec.ev(t + 200e-6, pid, *CU_MEM_ALLOC, rec.jitter(120 * NS_PER_US, 0.12), arg0=1 << 20, stack=alloc)
        host_work = rec.jitter(85 * NS_PER_MS, 0.03) / 1e9  # data prep + Python, between the launches and the sync
        if contended:
            # the preprocessing workers take the CPU: off-CPU gaps in the host work
            for _ in range(int(rng.poisson(1.0))):
                off = float(rng.uniform(12, 40)) * NS_PER_MS
                rec.sched(t + 0.001 + float(rng.uniform(0, host_work)), pid, off, by=3350)
                host_work += off / 1e9
        t_sync = t + 250e-6 + host_work
        sync = rec.jitter(8 * NS_PER_MS, 0.05)
        if contended and rng.random() < 0.22:
            off = float(rng.uniform(15, 45)) * NS_PER_MS
            rec.sched(t_sync, pid, off, by=3350)
            sync += off
        if ckpt and rng.random() < 0.6:
            stall = float(rng.uniform(10, 30)) * NS_PER_MS  # the save's page-cache flush stalls the loop
            sync += stall
            # the checkpoint's writes in flight while the sync is held up
            rec.block_io(t_sync + sync / 1e9 - 1e-3, pid, True, rec.jitter(0.6 * stall, 0.2), 2048)
        rec.ev(t_sync, pid, *STREAM_SYNC, sync, stack=sync_stack if it % 100 == 0 else 0)
        t = t_sync + sync / 1e9 + 0.5e-3
        it += 1
    _host_noise(rec, spec)
    rec.snapshots_every(
        snap_offset,
        SECONDS,
        lambda s: 96.0 if spec.straggler and s >= CONTENTION_FROM else (55.0 if spec.straggler else 48.0),
        mem=38.0 + spec.rank,
    )
    return rec


def _host_noise(rec: SyntheticNode, spec: DemoNode) -> None:
    rng, pid = rec.rng, spec.trainer
    rec.background(0.0, SECONDS, pid, 2.0, 1.5 * NS_PER_MS, by=281)  # ordinary preemption
    rec.background(0.0, SECONDS, pid, 2.0, 0.4 * NS_PER_MS, state=1)  # futex / poll sleeps of its own
    for t in sorted(rng.uniform(0, SECONDS, 45)):  # logging / journald writes
        rec.block_io(float(t), 281, True, rec.jitter(2.5 * NS_PER_MS, 0.25), 8)
    if spec.straggler:
        for c in CHECKPOINTS:  # rank 0 saves a checkpoint (torch.save + fsync): ~1 MB block writes for ~2.5 s
            for t in sorted(rng.uniform(c, c + 2.5, 50)):
                rec.block_io(float(t), pid, True, rec.jitter(4.5 * NS_PER_MS, 0.35), 2048)


def generate(out_dir: str | Path) -> dict[str, Path]:
    """Write the four databases into ``out_dir`` (replacing them). Returns name → path."""
    from ingero.explain.engine import explain
    from ingero.store.db import open_readonly

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recs = [build_node(spec) for spec in NODES]
    written: dict[str, Path] = {}
    chains: dict[str, list[dict[str, Any]]] = {}
    for rec in recs:
        path = out / FILES[rec.node]
        _remove(path)
        rec.write(path)
        conn = open_readonly(path)
        try:
            chains[rec.node] = [c.as_row() for c in explain(conn).chains]
        finally:
            conn.close()
        if chains[rec.node]:
            from ingero.store.writer import StoreWriter

            with StoreWriter(path, rec.identity()) as w:
                w.save_chains(chains[rec.node])
        written[rec.node] = path
    cluster = out / CLUSTER_FILE
    _remove(cluster)
    for rec in recs:
        rec.write(cluster, chains=chains[rec.node])
    written["cluster"] = cluster
    for path in written.values():  # committed files are reproducible: their instance ids too
        _pin_instance_id(path)
    return written


def _pin_instance_id(path: Path) -> None:
    """A fixed instance id per file name (a database normally gets a random one when created)."""
    import uuid

    from ingero.store.db import write_transaction
    from ingero.store.instance import INSTANCE_KEY

    value = uuid.uuid5(uuid.NAMESPACE_URL, f"ingero-investigations/{path.name}").hex
    with write_transaction(path) as conn:
        conn.execute("UPDATE schema_info SET value = ? WHERE key = ?", (value, INSTANCE_KEY))


def _remove(path: Path) -> None:
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        p.unlink(missing_ok=True)
