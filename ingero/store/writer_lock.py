"""One writer per database: an exclusive ``flock`` on a side file, taken before the database opens.

The lock lives in ``<db>.lock`` (holding the writer's pid), not on the database file itself:
SQLite locks the database with POSIX ``fcntl`` locks, and closing *any* descriptor of that file
drops every such lock the process holds — an extra descriptor on the database could silently
unlock the API's readers in the same process. Readers never touch the side file, so read-only
connections (the API, ``query``, ``explain``) are never blocked.

``flock`` locks belong to the open file description: the kernel releases them when the holder
exits, even by ``kill -9``, so a crashed tracer never leaves a stale lock behind. The side file
is removed on release while still locked; a taker checks that the path still names the file it
locked (else the holder removed it meanwhile) and takes the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from ingero.errors import StoreError, WriterLockedError

LOCK_SUFFIX = ".lock"
_ATTEMPTS = 5


def lock_path(db: Path) -> Path:
    return db.with_name(db.name + LOCK_SUFFIX)


class WriterLock:
    """The exclusive writer lock of ``db``; raises WriterLockedError (naming the holder) when taken."""

    def __init__(self, db: Path) -> None:
        self.path = lock_path(db)
        self._fd = -1
        for _ in range(_ATTEMPTS):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"pid {holder}" if holder else "another process"
                raise WriterLockedError(
                    f"{db} is already being recorded by {who}",
                    hint="stop that tracer first, or record to another --db (readers are not affected)",
                ) from None
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return
            os.close(fd)  # the previous holder removed it between our open and our lock: again
        raise StoreError(f"cannot take the writer lock {self.path}: it keeps being replaced")

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreError(f"cannot create the writer lock {self.path}: {e.strerror}") from None

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Remove the side file and unlock. Safe to call twice."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        with contextlib.suppress(OSError):
            if _same_file(fd, self.path):
                self.path.unlink()
        os.close(fd)  # unlocks


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_pid(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else 0
    except OSError:
        return 0
