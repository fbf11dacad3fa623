"""GPU memory families: a leak, an out-of-memory kill, and fragmentation's allocate-fail-retry.

* ``leak`` — every few steps one allocation is never freed: live bytes grow steadily to the end
  (``magnitude`` x 8 GiB in all). A leak costs no time until memory runs out; explain grades it by bytes.
* ``oom`` — the same growth until ``cudaMalloc`` fails (``cudaErrorMemoryAllocation``) and the host's
  OOM killer takes the trainer (``oom_kill``): always HIGH.
* ``fragmentation`` — PyTorch's OOM retry: a large ``cudaMalloc`` fails although enough memory is
  free in pieces; the caching allocator releases its cache (a burst of ``cudaFree``, each one
  synchronising) and retries slowly. The time lost is ``magnitude`` of the wall time.

Allocations carry the returned pointer in ``arg1`` and frees the pointer in ``arg0``, as the tracer
records them (:mod:`ingero.store.allocations`).
"""

from __future__ import annotations

from ingero.demo.synth import FREE, MALLOC, SyntheticNode
from ingero.store.catalog import op_id
from ingero.timeutil import NS_PER_S, NS_PER_US
from tests.scenarios.base import SECONDS, Loop, Params, disturb, fleet, split, steps_in

OOM_KILL = op_id("oom_kill")
CUDA_ERROR_MEMORY_ALLOCATION = 2
LEAK_SPAN_BYTES = 8 << 30  # magnitude 1.0 would leak this much
ACTIVATIONS = 96 << 20


def _allocating(loop: Loop, leak_bytes: float, *, stop_at: float | None = None) -> None:
    """The loop with one balanced allocate/free pair per step, and ``leak_bytes`` in all allocated
    and never freed, a little every 8 steps; with ``stop_at``, the run ends there in an OOM."""
    rec, pid = loop.rec, loop.pid
    n = steps_in(SECONDS)
    leaks = max(1, n // 8)
    each = int(leak_bytes / leaks)
    ptr = 0x7F60_0000_0000
    while loop.healthy_s < (stop_at if stop_at is not None else SECONDS):
        ptr += 0x400_0000
        rec.ev(loop.t, pid, *MALLOC, rec.jitter(80 * NS_PER_US, 0.1), arg0=ACTIVATIONS, arg1=ptr)
        loop.t += 1e-4
        if loop.steps % 8 == 0 and each > 0:
            ptr += 0x400_0000
            rec.ev(loop.t, pid, *MALLOC, rec.jitter(80 * NS_PER_US, 0.1), arg0=each, arg1=ptr + 0x10_0000)
            loop.t += 1e-4
        loop.step()
        rec.ev(loop.t, pid, *FREE, rec.jitter(20 * NS_PER_US, 0.1), arg0=ptr)
        loop.t += 5e-5


def leak(p: Params) -> list[SyntheticNode]:
    return fleet(p, lambda loop, p: _allocating(loop, p.magnitude * LEAK_SPAN_BYTES))


def oom(p: Params) -> list[SyntheticNode]:
    def disturbed(loop: Loop, p: Params) -> None:
        end = SECONDS * (0.5 + p.magnitude)
        _allocating(loop, 6 << 30, stop_at=end)
        rec = loop.rec
        rec.ev(loop.t, loop.pid, *MALLOC, 2e5, arg0=2 << 30, ret=CUDA_ERROR_MEMORY_ALLOCATION)
        loop.t += 0.05
        rec.ev(loop.t, loop.pid, *OOM_KILL, 0, arg1=loop.pid)

    return fleet(p, disturbed)


def fragmentation(p: Params) -> list[SyntheticNode]:
    held: list[int] = []  # the block the last retry got, released with the cache at the next one

    def retry(lp: Loop, s: float) -> None:
        rec, ns = lp.rec, s * NS_PER_S
        rec.ev(lp.t, lp.pid, *MALLOC, 150 * NS_PER_US, arg0=3 << 30, ret=CUDA_ERROR_MEMORY_ALLOCATION)
        lp.t += 2e-4
        for k, d in enumerate(split(rec.rng, ns * 0.4, 12)):  # the cache released: every block synchronises
            ptr = held.pop() if held else 0x7F70_0000_0000 + k * 0x100_0000
            rec.ev(lp.t, lp.pid, *FREE, d, arg0=ptr)
            lp.t += d / 1e9 + 20e-6
        d = ns * 0.6 - 2e5
        held.append(0x7F71_0000_0000 + int(lp.t * 1e6) * 0x1000)
        rec.ev(lp.t, lp.pid, *MALLOC, d, arg0=3 << 30, arg1=held[-1])
        lp.t += d / 1e9

    return fleet(p, lambda loop, p: disturb(loop, p.magnitude, 8, retry))


FAMILIES = {"leak": leak, "oom": oom, "fragmentation": fragmentation}
