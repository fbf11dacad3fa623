"""Families where GPU calls themselves take longer than the op's steady level.

* ``cpu-contention`` — a preprocessing job shares the trainer's cores for the middle of the run: woken
  at the end of its blocking sync, the trainer waits in the run queue while the job runs (sched_switch
  ``prev_state`` = sleeping, then the wakeup → switch delay, ``arg1`` = the job): involuntary.
* ``cpu-bimodal`` — a hog pinned to the trainer's core: a third of the syncs in its stretch are
  2.85x slower (p99/p50 stays just under 3: a tail gate misses it, a regime finder must not).
* ``kv-pressure`` — a server's KV cache fills: at irregular steps the allocator hands blocks back
  (``cudaFree``, which synchronises), allocates again slowly, and the next sync spikes.
* ``noisy-neighbour`` — another container's process runs kernels on the same GPU for a stretch: the
  trainer's syncs take longer (the GPU is shared), its CPU is not touched.
* ``cold-start`` — a fresh process pays context creation and lazy module loading on its first calls.
* ``pageable-copy`` — batches copied from pageable host memory: ~3 GB/s instead of ~11 GB/s pinned.
* ``kernel-drift`` — the same kernels slower and slower over the run (thermal or power capping).
"""

from __future__ import annotations

from pathlib import Path

from ingero.demo.realistic import KERNELS
from ingero.demo.synth import FREE, LAUNCH, MALLOC, MEMCPY, STREAM_SYNC, SyntheticNode
from ingero.store.cgroups import CgroupInfo, write_cgroups
from ingero.timeutil import NS_PER_MS, NS_PER_S, NS_PER_US
from tests.scenarios.base import (
    BASE_NS,
    HOG,
    SECONDS,
    Loop,
    Node,
    Params,
    disturb,
    fleet,
    healthy_run,
    incidents,
    lost_budget,
    split,
    steps_in,
)

PINNED_BPS, PAGEABLE_BPS = 11e9, 3e9
TRAINER_CG, NEIGHBOUR_CG = 0x3A01, 0x3A77
NEIGHBOUR = 8800
BIMODAL = 2.85  # slow syncs of the bimodal stretch take this many times the steady time


def _hog(loop: Loop, name: str) -> None:
    loop.rec.process(HOG, name, 0.0)


def cpu_contention(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        _hog(loop, "python3 preprocess.py --workers 16")

        def late(lp: Loop, s: float) -> None:
            lp.runqueue_ns, lp.by = s * NS_PER_S, HOG

        k = incidents(p.magnitude, 0.015, steps_in(SECONDS) // 3)  # delays of ~15 ms: syncs ~3x slower
        disturb(loop, p.magnitude, k, late, lo=0.3, hi=0.8)

    return fleet(p, disturbed)


def cpu_bimodal(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        _hog(loop, "stress-ng --cpu 1 --taskset 3")
        extra = (BIMODAL - 1) * loop.gpu_ms / 1e3
        k = max(1, round(lost_budget(p.magnitude) / extra))
        n = steps_in(SECONDS)
        stretch = min(0.85, 3 * k / n)  # a third of the stretch's syncs are slow

        def late(lp: Loop, s: float) -> None:
            lp.runqueue_ns, lp.by = s * NS_PER_S, HOG

        disturb(loop, p.magnitude, k, late, lo=0.1, hi=0.1 + stretch, rel=0.0)

    return fleet(p, disturbed)


def kv_pressure(p: Params) -> list[SyntheticNode]:
    held: list[int] = []  # the KV blocks allocated at the last eviction, handed back at the next

    def evict(lp: Loop, s: float) -> None:
        rec, ns = lp.rec, s * NS_PER_S
        frees, mallocs, spike = split(rec.rng, ns * 0.2, 6), split(rec.rng, ns * 0.5, 3), ns * 0.3
        for k, d in enumerate(frees):  # blocks handed back: cudaFree synchronises the device
            ptr = held.pop() if held else 0x7F40_0000_0000 + k * 0x20_0000
            rec.ev(lp.t, lp.pid, *FREE, d, arg0=ptr)
            lp.t += d / 1e9 + 20e-6
        for d in mallocs:
            held.append(0x7F41_0000_0000 + int(lp.t * 1e6) * 0x1000)
            rec.ev(lp.t, lp.pid, *MALLOC, d, arg0=256 << 20, arg1=held[-1])
            lp.t += d / 1e9 + 20e-6
        lp.extra_gpu_ms = spike / NS_PER_MS  # the next sync waits for the re-paged cache

    return fleet(p, lambda loop, p: disturb(loop, p.magnitude, 10, evict), cmd="python3 -m vllm.entrypoints.api_server")


def noisy_neighbour(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        rec = loop.rec
        assert isinstance(rec, Node)
        k = steps_in(SECONDS) // 2
        lo, hi = 0.3, 0.8
        rec.process(NEIGHBOUR, "python3 infer.py --tenant b", SECONDS * lo - 0.1)

        def shared(lp: Loop, s: float) -> None:
            lp.extra_gpu_ms = s * 1e3
            t = lp.t  # the neighbour's own work on the same GPU at the same time
            for j in range(3):
                lp.rec.ev(t + j * 2e-4, NEIGHBOUR, *LAUNCH, lp.rec.jitter(7 * NS_PER_US), arg0=KERNELS[j])
            sync = lp.gpu_ms * NS_PER_MS + s * NS_PER_S  # it shares the GPU too; blocking sync, then usleep
            lp.rec.ev(t + 8e-4, NEIGHBOUR, *STREAM_SYNC, sync)
            lp.rec.sleep(t + 9e-4, NEIGHBOUR, sync - 2e5)
            lp.rec.sleep(t + 8e-4 + sync / 1e9 + 1e-4, NEIGHBOUR, 1.1 * NS_PER_MS)

        disturb(loop, p.magnitude, k, shared, lo=lo, hi=hi)
        cg = {loop.pid: TRAINER_CG, NEIGHBOUR: NEIGHBOUR_CG}
        rec.events = [(*e[:11], cg.get(e[1], 0)) for e in rec.events]
        rec.after.append(_containers)

    return fleet(p, disturbed)


def _containers(db: Path) -> None:
    write_cgroups(
        db,
        [
            CgroupInfo(TRAINER_CG, "/kubepods/pod-train/c1", "a1" * 32, "trainer-0", "ml"),
            CgroupInfo(NEIGHBOUR_CG, "/kubepods/pod-infer/c9", "b9" * 32, "infer-b-7f9c", "tenant-b"),
        ],
        seen_at=BASE_NS,
    )


def cold_start(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        rec = loop.rec
        rec.process(loop.pid, "python3 serve.py --model llama", 0.05)  # a fresh process: exec'd now
        ns = lost_budget(p.magnitude) * NS_PER_S
        init = ns * 0.4  # context creation in the first allocation
        t0 = loop.t
        rec.ev(loop.t, loop.pid, *MALLOC, init, arg0=64 << 20, arg1=0x7F50_0000_0000)
        loop.t += init / 1e9 + 1e-4
        for fn, d in zip(KERNELS, split(rec.rng, ns * 0.6, len(KERNELS)), strict=True):  # lazy module loading
            rec.ev(loop.t, loop.pid, *LAUNCH, d, arg0=fn)
            loop.seen.add(fn)
            loop.t += d / 1e9 + 30e-6
        loop.lost += loop.t - t0
        healthy_run(loop)

    return fleet(p, disturbed, cmd="python3 serve.py --model llama")


def pageable_copy(p: Params) -> list[SyntheticNode]:
    def copy(lp: Loop, s: float) -> None:
        nbytes = s / (1 / PAGEABLE_BPS - 1 / PINNED_BPS)
        d = nbytes / PAGEABLE_BPS * NS_PER_S * lp.rec.jitter(1.0, 0.03) + 8 * NS_PER_US
        lp.rec.ev(lp.t, lp.pid, *MEMCPY, d, arg0=int(nbytes), arg1=1)
        lp.t += d / 1e9 + 10e-6
        lp.lost -= nbytes / PINNED_BPS  # what the copy takes from pinned memory is the step's own work

    return fleet(p, lambda loop, p: disturb(loop, p.magnitude, steps_in(SECONDS) // 2, copy, rel=0.1))


DRIFT_SECONDS = 3 * SECONDS  # "over minutes", kept short: the slope is what matters


def kernel_drift(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        n = steps_in(DRIFT_SECONDS, 0.0107)  # about how many steps the run has
        slope = 2 * lost_budget(p.magnitude, DRIFT_SECONDS) / (n * loop.gpu_ms / 1e3)  # Σ gpu x slope x k/n
        while loop.healthy_s < DRIFT_SECONDS:
            loop.extra_gpu_ms = loop.gpu_ms * slope * loop.healthy_s / DRIFT_SECONDS
            loop.step()

    return fleet(p, disturbed, healthy=lambda loop: healthy_run(loop, DRIFT_SECONDS))


FAMILIES = {
    "cpu-contention": cpu_contention,
    "cpu-bimodal": cpu_bimodal,
    "kv-pressure": kv_pressure,
    "noisy-neighbour": noisy_neighbour,
    "cold-start": cold_start,
    "pageable-copy": pageable_copy,
    "kernel-drift": kernel_drift,
}
