"""The agent at rest (issue 23): what it still records while it hardly wakes.

At rest the pipeline's drain does not poll: the housekeeping tick hands the trickle to the writer once
a second, the ring watch wakes the drain for a burst and reads the names of processes that just
exec'd. These tests hold what must not be lost for it: a short-lived command's name, the block I/O
of a quiet host, and the bound on write transactions that is the point of resting.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from ingero.agent.trace import discovery
from ingero.agent.trace.pipeline import PipelineOptions
from ingero.agent.trace.recorder import Recorder, StoragePolicy
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.agent.trace.ringwatch import RingWatch
from ingero.agent.trace.tracer import TraceOptions, TraceReady
from ingero.identity import Identity
from ingero.store import catalog


@pytest.mark.parametrize(
    "name",
    ["libcudart.so.12.4.127", "libcudart-d0da41ae.so.11.0", "libcuda.so.1", "libnccl.so.2", "libnccl-3ea7b8d9.so.2"],
)
def test_the_maps_prefilter_keeps_every_gpu_library(name: str) -> None:
    """A process's maps are split line by line only when they name a GPU library: the cheap test of the
    whole text must let through every file name a kind matches."""
    line = f"7f00-7f10 r-xp 00000000 08:01 42  /opt/lib/{name}"
    assert discovery.library_kind(line.rsplit(maxsplit=1)[-1]) is not None
    assert any(marker in line for marker in discovery._MAPS_MARKERS)


def test_the_maps_prefilter_skips_a_process_without_gpu_libraries() -> None:
    """``sleep`` maps no GPU library: nothing found, as when every line was read."""
    me = subprocess.Popen(["sleep", "5"])
    try:
        time.sleep(0.1)
        assert list(discovery.process_libraries([me.pid])) == []
    finally:
        me.kill()
        me.wait()


def test_the_watch_looks_below_the_threshold_and_wakes_once_at_it() -> None:
    """Armed: below ``threshold`` it looks (names), at it it wakes the drain once and disarms."""
    import trio

    pending = [3]
    looks: list[int] = []
    woken: list[float] = []

    async def main() -> None:
        watch = RingWatch(lambda: pending[0], 10, 0.02, lambda: looks.append(pending[0]))
        watch.start()
        try:
            done = trio.Event()

            def wake() -> None:
                woken.append(time.monotonic())
                done.set()

            watch.arm(wake)
            await trio.sleep(0.15)
            assert looks and not woken  # below the threshold: looks, never wakes
            pending[0] = 10
            with trio.fail_after(5):
                await done.wait()
            await trio.sleep(0.1)
            assert len(woken) == 1  # once: disarmed by the wake
            n = len(looks)
            await trio.sleep(0.1)
            assert len(looks) == n  # disarmed: no look either
        finally:
            watch.stop()

    trio.run(main)


@pytest.mark.bpf
def test_an_agent_at_rest_names_short_lived_commands_and_keeps_host_io(tmp_path: Path) -> None:
    """Default options on this host (no GPU process of ours): a command living 0.6 s is named (the watch
    reads its name while it lives; the tick, once a second, would often be too late), a file written and
    synced here is recorded as block writes of its writer, and the writer commits at most once per
    tick, plus once per ``flush_events`` records, plus the final drains."""
    from tests.bpf_support import record

    nap = tmp_path / "ingero-rest-nap"
    shutil.copy("/bin/sleep", nap)
    out: dict[str, int] = {}

    def action(ready: TraceReady) -> None:
        time.sleep(1.5)  # past start-up: the drain rests unless this host is busy
        proc = subprocess.Popen([str(nap), "0.6"])
        out["nap"] = proc.pid
        proc.wait()
        writer = subprocess.Popen(
            ["dd", "if=/dev/zero", f"of={tmp_path / 'blob'}", "bs=64k", "count=16", "conv=fsync"],
            stderr=subprocess.DEVNULL,
        )
        out["dd"] = writer.pid
        writer.wait()
        time.sleep(1.5)  # a tick or two after: the trickle goes to the writer without a drain of its own

    db = tmp_path / "rest.db"
    summary, _ = record(TraceOptions(db_path=db, identity=Identity("rest"), output="quiet"), action)
    with sqlite3.connect(db) as c:
        names = dict(c.execute("SELECT pid, name FROM process_names WHERE pid = ?", (out["nap"],)).fetchall())
        execs = c.execute(
            "SELECT count(*) FROM events WHERE pid = ? AND source = ? AND op = ?",
            (out["nap"], *catalog.op_id("process_exec")),
        ).fetchone()[0]
        io = c.execute(
            "SELECT count(*), coalesce(sum(arg0), 0) FROM events WHERE pid = ? AND source = ? AND op = ?",
            (out["dd"], *catalog.op_id("block_write")),
        ).fetchone()
    assert execs == 1
    assert names == {out["nap"]: "ingero-rest-nap"}
    assert io[0] >= 1 and io[1] * 512 >= 16 * 64 * 1024, io  # sectors of 512 bytes: the whole file reached the disk
    st = summary.stats
    ticks = st["elapsed_ms"] / 1000 / PipelineOptions().snapshot_interval_s
    bound = ticks + st["events_drained"] / PipelineOptions().flush_events + 3
    assert st["write_transactions"] <= bound, (st["write_transactions"], bound, st["events_drained"])


def test_the_watch_stops_promptly() -> None:
    watch = RingWatch(lambda: 0, 1, 0.25)
    watch.start()
    t0 = time.monotonic()
    watch.stop()
    assert not watch.is_alive() and time.monotonic() - t0 < 1.0


def test_names_read_when_drained_outlive_the_process() -> None:
    """exec_names reads the names of processes that exec'd when their records are drained (or looked
    at); the batch written later names them so even though /proc no longer has them."""
    live = {4242: "nap"}
    rec = Recorder(StoragePolicy(), lambda _sid: [], comm_of=lambda pid: live.get(pid, ""))
    ev = np.zeros(2, dtype=EVENT_DTYPE)
    ev["source"], ev["op"] = catalog.op_id("process_exec")
    ev["pid"] = [4242, 4343]
    ev["ts"] = [1, 2]
    names = rec.exec_names(ev)
    assert names == {4242: "nap", 4343: ""}
    live.clear()  # both gone by the time the batch is written
    rows = rec.process(ev, 0, names).process_names
    assert [(pid, name) for pid, name, _ in rows] == [(4242, "nap")]
    assert Recorder(StoragePolicy(), lambda _sid: [], comm_of=live.get).process(ev, 0).process_names == []  # type: ignore[arg-type]


def test_the_watch_wakes_when_its_look_finds_urgent_records() -> None:
    """Below ``threshold``, a look that found a traced process's records (it returns True) wakes the drain
    once: its stacks and names are read while it lives, not at the next tick."""
    import trio

    found = [False]
    woken: list[int] = []

    async def main() -> None:
        watch = RingWatch(lambda: 1, 512, 0.02, lambda: found[0])
        watch.start()
        try:
            done = trio.Event()
            watch.arm(lambda: (woken.append(1), done.set()))
            await trio.sleep(0.1)
            assert not woken  # looks found nothing urgent: no wake
            found[0] = True
            with trio.fail_after(5):
                await done.wait()
            await trio.sleep(0.1)
            assert woken == [1]  # once: disarmed by the wake
        finally:
            watch.stop()

    trio.run(main)


def test_urgent_records_are_gpu_calls_or_carry_a_stack() -> None:
    from ingero.agent.trace.pipeline import urgent

    ev = np.zeros(3, dtype=EVENT_DTYPE)
    ev["stack_id"] = -1
    ev["source"], ev["op"] = catalog.op_id("block_write")
    assert not urgent(ev) and not urgent(ev[:0])  # a quiet host's own block I/O rests
    ev["source"][1], ev["op"][1] = catalog.op_id("cudaStreamSynchronize")
    assert urgent(ev)
    ev["source"][1], ev["op"][1] = catalog.op_id("ncclAllReduce")
    assert urgent(ev)
    ev["source"][1], ev["op"][1] = catalog.op_id("sched_switch")
    assert not urgent(ev)
    ev["stack_id"][2] = 7  # a stack to symbolize while its process lives
    assert urgent(ev)
