"""GPU memory leak rule and live-bytes accounting on synthetic databases (written by the real writer).

A training loop allocates and frees by pointer; the leaking variant keeps a share of each step's
allocations (live bytes grow without plateau) and must be named with its allocating stack; a healthy
loop, a caching allocator that warms up and then levels off, and nested runtime→driver allocations of
the same pointer must not be.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ingero.demo.synth import SyntheticNode
from ingero.explain.engine import ExplainReport, explain
from ingero.explain.rules_leak import FAMILY, MIN_GROWTH_BYTES
from ingero.store import allocations as al
from ingero.store.catalog import CUDA, DRIVER, launch_dims
from ingero.store.db import open_readonly

BASE = 1_776_000_000_000_000_000
MiB = 1 << 20
PID = 100
Keep = Callable[[int], bool]  # step -> whether that step's activation buffer is kept (never freed)


def build(path: Path, keep: Keep, *, steps: int = 600, nested: bool = False, warm_steps: int = 0) -> Path:
    """``steps`` steps of 10 ms: a 4 MiB workspace allocated and freed, an 8 MiB activation buffer kept
    when ``keep(step)``; ``warm_steps``: a caching allocator growing a 2 MiB block per step first."""
    rec = SyntheticNode("node-a", BASE, 1)
    rec.process(PID, "python3 train.py", 0.0, exec_event=False)
    leak_stack = rec.stack([("cudaMalloc", "libcudart.so.12"), ("store_activations", "train.py"), ("main", "train")])
    work_stack = rec.stack([("cudaMalloc", "libcudart.so.12"), ("workspace", "train.py"), ("main", "train")])
    ptr = 0x7000_0000_0000
    for i in range(steps):
        t = 0.1 + i * 0.01
        ptr += 0x100_0000
        rec.ev(t, PID, CUDA, 1, 20_000, arg0=4 * MiB, arg1=ptr, stack=work_stack)
        if nested:  # libcudart's cudaMalloc calls libcuda's cuMemAlloc_v2: the same pointer twice
            rec.ev(t + 1e-6, PID, DRIVER, 5, 15_000, arg0=4 * MiB, arg1=ptr)
        rec.ev(t + 0.002, PID, CUDA, 3, 8000)
        rec.ev(t + 0.004, PID, CUDA, 2, 10_000, arg0=ptr)
        if keep(i) or i < warm_steps:
            ptr += 0x100_0000
            size = 8 * MiB if keep(i) else 2 * MiB
            rec.ev(t + 0.005, PID, CUDA, 1, 20_000, arg0=size, arg1=ptr, stack=leak_stack)
        rec.ev(t + 0.006, PID, CUDA, 5, 2_000_000)
    rec.ev(0.05, PID, CUDA, 1, 20_000, arg0=1 << 45, arg1=0, ret=2)  # a failed allocation: no pointer
    rec.write(path)
    return path


def report(path: Path) -> ExplainReport:
    conn = open_readonly(path)
    try:
        return explain(conn)
    finally:
        conn.close()


def leaks(r: ExplainReport) -> list[object]:
    return [c for c in r.chains if c.family == FAMILY]


def test_steady_leak_is_named_with_its_allocating_stack(tmp_path: Path) -> None:
    path = build(tmp_path / "leak.db", lambda i: i % 3 == 0)
    r = report(path)
    found = [c for c in r.chains if c.family == FAMILY]
    assert len(found) == 1, [(c.family, c.summary) for c in r.chains]
    c = found[0]
    kept = len(range(0, 600, 3)) * 8 * MiB
    assert c.evidence["pid"] == PID and c.evidence["live_bytes"] == kept
    assert c.evidence["growth_bytes"] > MIN_GROWTH_BYTES
    top = c.evidence["top_stacks"][0]
    assert top["bytes"] == kept and "store_activations" in top["frames"]
    assert "store_activations" in c.explanation and "cudaMalloc" in c.summary
    assert c.severity == "MEDIUM"  # 1.6 GiB at stake


def test_healthy_allocate_free_loop_is_not_a_leak(tmp_path: Path) -> None:
    r = report(build(tmp_path / "ok.db", lambda i: False))
    assert not leaks(r)


def test_warm_up_then_plateau_is_not_a_leak(tmp_path: Path) -> None:
    # 300 MiB of cache grown in the first quarter, then flat
    r = report(build(tmp_path / "warm.db", lambda i: False, warm_steps=150))
    assert not leaks(r)


def test_leak_that_stopped_early_is_not_named(tmp_path: Path) -> None:
    r = report(build(tmp_path / "stopped.db", lambda i: i < 200 and i % 2 == 0))
    assert not leaks(r)


def test_nested_runtime_and_driver_allocation_counts_once(tmp_path: Path) -> None:
    path = build(tmp_path / "nested.db", lambda i: False, nested=True, steps=50)
    conn = open_readonly(path)
    try:
        s = al.live_bytes(conn, PID)
    finally:
        conn.close()
    assert int(s.live.max()) == 4 * MiB and int(s.live[-1]) == 0
    assert s.allocated == s.freed == 50 * 4 * MiB
    assert not leaks(report(path))


def test_live_series_matches_frees_by_pointer() -> None:
    A, F = al.ALLOC, al.FREE
    kind = np.array([A, A, F, A, F, F, F, A], dtype=np.int64)
    ptr = np.array([10, 20, 10, 10, 30, 10, 10, 0], dtype=np.int64)  # 30: allocated before; 10 freed twice
    ts = np.arange(8, dtype=np.int64)
    size = np.array([100, 200, 0, 50, 0, 0, 0, 999], dtype=np.int64)
    s = al.live_series(kind, ptr, ts, size)
    assert s.live.tolist() == [100, 300, 200, 250, 250, 200, 200]
    assert (s.allocated, s.freed) == (350, 150)
    assert al.unfreed(kind, ptr, ts, size).tolist() == [False, True, False, False, False, False, False, False]


@pytest.mark.parametrize(
    ("grid", "block"), [((1, 1, 1), (1, 1, 1)), ((65535, 2, 3), (1024, 1, 1)), ((7, 1, 1), (32, 8, 4))]
)
def test_launch_dims_round_trip(grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    # the packing of gpu_probes.c's launch_dims(), written out in Python
    g = grid[0] * grid[1] * grid[2]
    packed = g << 32 | block[0] | block[1] << 11 | block[2] << 22
    assert launch_dims(packed) == (g, block)
    assert launch_dims(packed - (1 << 64) if packed >= 1 << 63 else packed) == (g, block)  # SQLite's signed form


def test_free_at_its_allocations_quantized_time_is_matched() -> None:
    # explain's frame keeps microseconds: an allocation freed at once shares its free's timestamp
    A, F = al.ALLOC, al.FREE
    kind = np.array([A, F, A, F], dtype=np.int64)
    ptr = np.array([10, 10, 10, 10], dtype=np.int64)
    ts = np.array([5, 5, 7, 7], dtype=np.int64)
    size = np.array([100, 0, 100, 0], dtype=np.int64)
    s = al.live_series(kind, ptr, ts, size)
    assert s.live.tolist() == [100, 0, 100, 0] and s.freed == 200
    assert not al.unfreed(kind, ptr, ts, size).any()


@pytest.mark.parametrize("span_ns", range(267_184_000, 267_184_000 + 4_000, 250))
def test_growth_ends_at_the_last_row_at_real_timestamps(span_ns: int) -> None:
    # nanosecond timestamps near 2^61: float64 edges could fall short of the last row and drop it
    from ingero.explain.rules_leak import steady_growth

    n = 180
    t0 = 1_795_550_213_980_880_000
    ts = t0 + np.linspace(0, span_ns, n).astype(np.int64)
    ts[-1] = t0 + span_ns
    live = np.cumsum(np.full(n, MiB, dtype=np.int64))
    g = steady_growth(al.LiveSeries(ts, live, n * MiB, 0), n)
    assert g is not None and g.live_bytes == n * MiB


def test_top_stacks_count_only_the_explain_window(tmp_path: Path) -> None:
    """The stacks of a leak are those of the memory held in the window explain read, not the whole history."""
    from ingero.store.window import Window

    path = tmp_path / "leak.db"
    build(path, lambda i: i % 3 == 0)
    conn = open_readonly(path)
    try:
        second_half = Window(start_ns=BASE + int(3.1e9))  # steps 300..599 (10 ms each from t = 0.1 s)
        c = next(c for c in explain(conn, second_half).chains if c.family == FAMILY)
    finally:
        conn.close()
    kept_in_window = len(range(300, 600, 3)) * 8 * MiB
    assert c.evidence["top_stacks"][0]["bytes"] == kept_in_window
    assert c.evidence["live_bytes"] == kept_in_window


@pytest.mark.parametrize(("alloc", "free"), [("cuMemAlloc", "cuMemFree"), ("cudaMallocManaged", "cudaFree")])
def test_a_leak_through_any_allocator_of_the_catalog_is_named(tmp_path: Path, alloc: str, free: str) -> None:
    """The leak rule uses the catalog's allocation sets: a process that allocates through libcuda alone
    (or managed memory) leaks the same way, and is named with its own allocator."""
    from ingero.store.catalog import op_id

    (a_src, a_op), (f_src, f_op) = op_id(alloc), op_id(free)
    rec = SyntheticNode("node-a", BASE, 1)
    rec.process(PID, "python3 jax_train.py", 0.0, exec_event=False)
    ptr = 0x7000_0000_0000
    for i in range(600):
        t = 0.1 + i * 0.01
        ptr += 0x100_0000
        rec.ev(t, PID, a_src, a_op, 20_000, arg0=4 * MiB, arg1=ptr)
        rec.ev(t + 0.004, PID, f_src, f_op, 10_000, arg0=ptr)
        if i % 3 == 0:
            ptr += 0x100_0000
            rec.ev(t + 0.005, PID, a_src, a_op, 20_000, arg0=8 * MiB, arg1=ptr)
        rec.ev(t + 0.006, PID, CUDA, 5, 2_000_000)
    rec.write(tmp_path / "leak.db")
    found = leaks(report(tmp_path / "leak.db"))
    assert len(found) == 1
    assert found[0].evidence["live_bytes"] == 200 * 8 * MiB
    assert f"{alloc} without {free}" in found[0].summary
