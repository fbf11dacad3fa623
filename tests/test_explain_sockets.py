"""GPU idle while its thread sleeps on the network: a dependency wait inside an open request (lost) or a
server idle between requests (not lost), told by the socket calls' connections (issue #20).

* the request state machine (:func:`ingero.explain.sockets.requests`) on hand-made calls: requests,
  streamed replies, requests read in parts, the thread's own calls and their answers;
* socket rows read alike in both layouts (Ingero stamps the return and puts the fd first);
* explain on the scenario generator's tool-call and idle-server databases, both layouts: the tool call's
  lost share is the magnitude built in, at its severity; the idle server gets no network chain; without
  connections (fds) the wait stays at most LOW and says both.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from ingero.explain import causes as cz
from ingero.explain.evidence import Grid, HostSeries, Snapshots
from ingero.explain.frame_load import load_frames
from ingero.explain.sockets import Sockets, requests, socket_calls
from ingero.store.catalog import NET
from ingero.store.db import open_readonly
from ingero.store.window import Window
from ingero.timeutil import NS_PER_S
from tests.conftest import SharedDbs
from tests.scenarios.base import PID, Params
from tests.scenarios.expectations import INGERO, LAYOUTS, RECORDED, TOLERANCE
from tests.scenarios.idle import TOOL_FD, USER_FD
from tests.scenarios.judge import build, explain_file
from tests.test_explain_regimes import check_invariants

MS = 1_000_000
A, B = 7, 9  # a user's connection, a tool's


def _calls(*rows: tuple[int, str, int, int]) -> Sockets:
    """(fd, 'send' | 'recv', start ms, duration ms) rows of one thread."""
    fd = np.asarray([r[0] for r in rows], dtype=np.int64)
    start = np.asarray([r[2] * MS for r in rows], dtype=np.int64)
    end = start + np.asarray([r[3] * MS for r in rows], dtype=np.int64)
    send = np.asarray([r[1] == "send" for r in rows])
    return Sockets(np.zeros(fd.size, dtype=np.int64), start, end, fd, np.full(fd.size, 100, dtype=np.int64), send)


def test_a_request_is_open_from_its_last_read_to_its_reply_and_the_tool_call_inside_it_is_its_own() -> None:
    r = requests(
        _calls(
            (A, "recv", 0, 1),  # the request, in two reads
            (A, "recv", 2, 1),
            (B, "send", 10, 1),  # the tool call ...
            (B, "recv", 11, 50),  # ... its answer after 50 ms
            (A, "send", 80, 1),  # the reply, streamed in two writes
            (A, "send", 90, 1),
            (A, "recv", 100, 300),  # the next request, after a long idle
            (A, "send", 420, 1),
        )
    )
    assert r.served == 2
    assert r.open_start.tolist() == [3 * MS, 400 * MS] and r.open_end.tolist() == [90 * MS, 420 * MS]
    assert r.calls == [(B, 10 * MS, 61 * MS, 100, 100)]
    inside = r.inside(np.asarray([11 * MS, 100 * MS, 0]), np.asarray([61 * MS, 400 * MS, 3 * MS]))
    assert inside.tolist() == [50 * MS, 0, 0]  # the tool's wait is inside; the idle and the reading are not


def test_a_client_loop_serves_no_request() -> None:
    r = requests(
        _calls((B, "send", 0, 1), (B, "recv", 1, 40), (B, "recv", 41, 1), (B, "send", 60, 1), (B, "recv", 61, 40))
    )
    assert r.served == 0 and r.open_start.size == 0
    assert [(c[1], c[2], c[4]) for c in r.calls] == [(0, 42 * MS, 200), (60 * MS, 101 * MS, 100)]


@pytest.fixture(scope="module")
def tool_call_dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build("tool-call", Params(seed=3, magnitude=0.16, n_nodes=2, outlier=1), tmp_path_factory.mktemp("tool"))


def test_socket_rows_read_alike_in_both_layouts(tool_call_dbs: dict[str, Path]) -> None:
    got = {}
    for layout in LAYOUTS:
        conn = open_readonly(tool_call_dbs[layout])
        try:
            fr = load_frames(conn, Window())["gpu-node-01"]
            if layout == INGERO:  # Ingero's own shape: stamped at the return, the fd first
                q = "SELECT count(*), sum(arg0 IN (?, ?)) FROM events WHERE source = ? AND node = 'gpu-node-01'"
                n, fds = conn.execute(q, (USER_FD, TOOL_FD, NET)).fetchone()
                assert n > 50 and fds == n
        finally:
            conn.close()
        got[layout] = socket_calls(fr.args).of(PID)
    ours, theirs = got[RECORDED], got[INGERO]
    assert (ours.fd == theirs.fd).all() and (ours.nbytes == theirs.nbytes).all() and (ours.send == theirs.send).all()
    for x, y in ((ours.start, theirs.start), (ours.end, theirs.end)):  # the frame keeps µs-ish timestamps
        assert np.abs(x - y).max() <= 2_000
    assert set(ours.fd.tolist()) == {USER_FD, TOOL_FD}


def test_host_series_counts_socket_bytes_alike_in_both_layouts(tool_call_dbs: dict[str, Path]) -> None:
    """The host evidence's "N socket ops (X MB)" reads each layout's own columns (Ingero's arg0 is the
    fd): the same ops and bytes from both."""
    got = {}
    for layout in LAYOUTS:
        conn = open_readonly(tool_call_dbs[layout])
        try:
            fr = load_frames(conn, Window())["gpu-node-01"]
        finally:
            conn.close()
        grid = Grid.for_span(int(fr.ts_ns.min()) - NS_PER_S, int(fr.ts_ns.max()) + NS_PER_S)
        pids = np.asarray([PID], dtype=np.int64)
        h = HostSeries(fr, grid, pids, Snapshots.empty(grid), tree=pids)
        got[layout] = (int(h.net_n.sum()), int(h.net_bytes.sum()))
    sent = socket_calls(fr.args).of(PID)
    assert got[RECORDED] == got[INGERO] == (sent.nbytes.size, int(np.abs(sent.nbytes).sum())), got


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tool_call_inside_open_requests_is_lost_at_its_severity(tool_call_dbs: dict[str, Path], layout: str) -> None:
    r = explain_file(tool_call_dbs[layout])
    check_invariants(r)
    net = [c for c in r.chains if c.family == "idle/asleep_network"]
    assert [c.node for c in net] == ["gpu-node-01"], [(c.node, c.family, c.severity) for c in r.chains]
    ev = net[0].evidence
    assert ev["lost_share"] == pytest.approx(0.16, rel=TOLERANCE)
    assert net[0].severity == cz.severity_of_loss(ev["lost_share"], 1.0) == "MEDIUM"
    assert ev["requests_served"] > 10 and ev["calls_in_requests"] == {str(TOOL_FD): 12}
    assert 0 <= ev["between_requests_ms"] <= ev["lost_ms"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_server_idle_between_requests_loses_nothing(shared_dbs: SharedDbs, layout: str) -> None:
    p = Params(seed=4, magnitude=0.065, n_nodes=1, outlier=0)
    r = explain_file(shared_dbs.scenario("healthy-idle-server", p)[layout])
    asleep = r.ledger[0].idle_ns["asleep_network"]
    assert asleep > 0.5 * r.ledger[0].wall_ns  # the GPU idles most of the run, asleep on the network ...
    assert not [c for c in r.chains if c.family.startswith("idle/")]  # ... and nothing of it is lost


def test_without_connections_the_wait_stays_low_and_says_both(tool_call_dbs: dict[str, Path], tmp_path: Path) -> None:
    """Socket rows with no fd (all one connection, 0): no request can be seen open; a tool call and an
    idle server read the same — at most LOW, naming what is missing."""
    db = tmp_path / "no-fd.db"
    src = sqlite3.connect(tool_call_dbs[RECORDED])
    try:
        src.backup(dst := sqlite3.connect(db))
    finally:
        src.close()
    dst.execute("UPDATE events SET arg1 = 0 WHERE source = ?", (NET,))
    dst.commit()
    dst.close()
    net = [c for c in explain_file(db).chains if c.family == "idle/asleep_network"]
    assert [c.severity for c in net] == ["LOW"] and "file descriptors" in net[0].root_cause
