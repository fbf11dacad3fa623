"""Which processes ``ingero trace`` follows: ``--pid`` lists and ``--user`` (name or uid).

``--user`` works at two levels: the user's processes running at start are targets from the first
moment (host events too), and the BPF programs enrol any later process of that uid on its first
probed GPU call (the ``target_uids`` map, see ingero/agent/trace/bpf/gpu_probes.c), so jobs the user starts
after the tracer are traced as well.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable
from pathlib import Path

from ingero.errors import UsageError

PROC = Path("/proc")


def parse_pid_list(values: Iterable[str | int]) -> list[int]:
    """``["4242", "4243,4244"]`` -> [4242, 4243, 4244] (sorted, unique). Raises UsageError."""
    pids: set[int] = set()
    for value in values:
        for part in str(value).split(","):
            word = part.strip()
            if not word:
                continue
            try:
                pid = int(word)
            except ValueError:
                raise UsageError(f"--pid {word!r}: not a process id", hint="e.g. -p 4242,4243") from None
            if pid <= 0:
                raise UsageError(f"--pid {pid}: process ids are positive")
            pids.add(pid)
    return sorted(pids)


def resolve_user(name: str) -> int:
    """A user name or numeric uid -> uid. Raises UsageError for an unknown name."""
    word = name.strip()
    if word.isdigit():
        return int(word)
    try:
        return pwd.getpwnam(word).pw_uid
    except KeyError:
        raise UsageError(f"--user {word!r}: no such user", hint="give a user name or a numeric uid") from None


def resolve_users(names: Iterable[str]) -> list[int]:
    return sorted({resolve_user(n) for n in names})


def process_uid(pid: int) -> int | None:
    """Real uid of a running process (None once it is gone)."""
    try:
        return os.stat(PROC / str(pid)).st_uid
    except OSError:
        return None


def pids_of_uids(uids: Iterable[int]) -> list[int]:
    """Running processes (tgids) owned by any of ``uids``, this one excluded."""
    wanted = set(uids)
    me = os.getpid()
    found: list[int] = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        uid = process_uid(int(entry.name))
        if uid is not None and uid in wanted:
            found.append(int(entry.name))
    return sorted(found)


__all__ = ["parse_pid_list", "pids_of_uids", "process_uid", "resolve_user", "resolve_users"]
