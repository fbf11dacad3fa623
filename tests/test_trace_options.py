"""Trace options users expect: -p lists, --user, --duration units, --record-all, --stack-samples,
and ``ingero annotate`` writing next to a running writer (the real StoreWriter holding its lock)."""

from __future__ import annotations

import ctypes
import json
import os
import pwd
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from ingero.agent.trace.procfilter import parse_pid_list, pids_of_uids, resolve_user
from ingero.agent.trace.recorder import Recorder, StoragePolicy
from ingero.agent.trace.ringbuf import EVENT_DTYPE
from ingero.agent.trace.stacks import Symbolizer
from ingero.cli.main import build_parser, main
from ingero.cli.trace import options_from
from ingero.errors import UsageError
from ingero.identity import Identity
from ingero.store.annotations import add_annotation, list_annotations
from ingero.store.db import open_readonly
from ingero.store.schema import SCHEMA_VERSION
from ingero.store.writer import StoreWriter

S = 1_000_000_000


def _trace_opts(tmp_path: Path, *argv: str):  # type: ignore[no-untyped-def]
    args = build_parser("trace", lazy=True).parse_args(["trace", "--db", str(tmp_path / "t.db"), *argv])
    return options_from(args)


def test_pid_lists_comma_separated_and_repeated() -> None:
    assert parse_pid_list(["4243,4242", "17", " 4242 ,"]) == [17, 4242, 4243]
    with pytest.raises(UsageError, match="not a process id"):
        parse_pid_list(["12,abc"])
    with pytest.raises(UsageError, match="positive"):
        parse_pid_list(["0"])


def test_trace_cli_options(tmp_path: Path) -> None:
    me = os.getpid()
    opts = _trace_opts(tmp_path, "-p", f"{me},1", "--pid", "1", "--duration", "1h30m", "--record-all")
    assert opts.pids == [1, me]
    assert opts.duration_s == 5400.0
    assert opts.store_mode == "all"
    assert opts.stack_samples == 0 and opts.uids == [] and opts.python_frames
    assert not _trace_opts(tmp_path, "--no-python-frames").python_frames
    opts = _trace_opts(tmp_path, "--stack-samples", "8", "--duration", "250ms", "--max-db", "64m")
    assert (opts.stack_samples, opts.duration_s, opts.max_db_bytes, opts.store_mode) == (8, 0.25, 64 << 20, "selective")
    with pytest.raises(UsageError, match="stack-samples"):
        _trace_opts(tmp_path, "--stack-samples", "-1")


def test_user_resolves_names_and_uids_and_finds_their_processes(tmp_path: Path) -> None:
    me = pwd.getpwuid(os.getuid())
    assert resolve_user(me.pw_name) == me.pw_uid == resolve_user(str(me.pw_uid))
    with pytest.raises(UsageError, match="no such user"):
        resolve_user("no-such-user-ingero")
    opts = _trace_opts(tmp_path, "--user", me.pw_name)
    assert opts.uids == [me.pw_uid]
    assert os.getppid() in opts.pids and os.getpid() not in opts.pids  # running processes, not itself
    assert os.getppid() in pids_of_uids([me.pw_uid])
    assert pids_of_uids([4_000_000_000]) == []


def _launches(n: int, pid: int, stack_ids: list[int]) -> np.ndarray:
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["ts"] = 1000 * S + np.arange(n, dtype=np.int64)
    ev["source"], ev["op"], ev["pid"], ev["tid"] = 1, 1, pid, pid  # cudaMalloc: always stored
    ev["duration"] = 500
    ev["stack_id"] = np.resize(np.array(stack_ids, dtype=np.int32), n)
    return ev


def test_stack_samples_keeps_at_most_n_distinct_stacks_per_process_and_op() -> None:
    libc = ctypes.CDLL(None)
    ip = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert ip
    pid = os.getpid()
    stacks = {sid: [ip, ip + sid] for sid in range(1, 6)}
    rec = Recorder(StoragePolicy(stack_samples=2), lambda sid: stacks[sid], symbolizer=Symbolizer())
    out = rec.process(_launches(10, pid, [1, 2, 3, 4, 5]), 0)
    assert len(out.stacks) == 2  # stack ids 1 and 2 (the first seen), not 3, 4, 5
    kept = {row[0] for row in out.stacks}
    hashes = [e[10] for e in out.events]
    assert len(out.events) == 10  # every event is still stored
    assert sum(1 for h in hashes if h in kept) == 4 and hashes.count(0) == 6
    assert rec.stacks_over_limit == 6
    again = rec.process(_launches(4, pid, [1, 2, 3, 4]), 0)  # known stacks keep their hash
    assert again.stacks == [] and [e[10] for e in again.events][:2] == [e[10] for e in out.events][:2]
    other = rec.process(_launches(3, pid + 1, [3]), 0)  # the limit is per process
    assert len(other.stacks) == 1
    unlimited = Recorder(StoragePolicy(), lambda sid: stacks[sid], symbolizer=Symbolizer())
    assert len(unlimited.process(_launches(10, pid, [1, 2, 3, 4, 5]), 0).stacks) == 5


def test_annotation_is_written_while_the_writer_holds_its_lock(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    with StoreWriter(db, Identity("node-a")) as writer:
        writer.write_batch([(1000 * S, 7, 7, 1, 1, 500, 0, 64, 0, 0, 0, 0)])
        note = add_annotation(db, "  deploy   v2.3 ", node="node-a", timestamp=1001 * S, author="ops@host")
        writer.write_batch([(1002 * S, 7, 7, 1, 1, 500, 0, 64, 0, 0, 0, 0)])  # the writer goes on
        assert (note.id, note.message) == (1, "deploy v2.3")
    conn = open_readonly(db)
    try:
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 2
        assert [a.as_dict() for a in list_annotations(conn)] == [
            {"id": 1, "timestamp": 1001 * S, "node": "node-a", "message": "deploy v2.3", "author": "ops@host"}
        ]
        assert list_annotations(conn, 1002 * S) == []
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


def test_annotate_command_writes_and_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "cli.db"
    assert main(["annotate", "--db", str(db), "--node", "n1", "--at", "1700000000", "lr 3e-4 -> 1e-4"]) == 0
    assert "annotated" in capsys.readouterr().out
    assert main(["annotate", "--db", str(db), "--list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["timestamp"], row["node"], row["message"]) == (1_700_000_000 * S, "n1", "lr 3e-4 -> 1e-4")
    assert main(["annotate", "--db", str(db), "   "]) == 2  # an empty message is a usage error
    assert "needs a message" in capsys.readouterr().err


def test_old_database_gains_the_annotations_table(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with StoreWriter(db, Identity("n")):
        pass
    conn = sqlite3.connect(db)
    conn.execute("DROP TABLE annotations")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    add_annotation(db, "after upgrade", node="n", author="a")
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("SELECT labels ->> 'message' FROM annotations").fetchall() == [("after upgrade",)]
        cols = {r[1] for r in conn.execute("PRAGMA table_info(cgroup_metadata)")}
        assert {"job_id", "seen_at"} <= cols
    finally:
        conn.close()
