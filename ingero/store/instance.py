"""Who a database is: the node recorded in it, and a stable instance id for the agent serving it.

Two agents may answer with one node name (cloned VMs that share a hostname; three recordings served
without ``--node``). The fleet client tells them apart by an *instance id*, which every agent sends
with its answers:

* a database ingero writes gets a random ``instance_id`` in ``schema_info`` when its schema is made
  or migrated (:func:`ensure_instance_id`); a merged database gets its own, never an input's (the
  offline merge tells two recordings of one node name apart by it);
* the file is named too, by device and inode (an Ingero recording has no stored id, and serving it
  never writes to it): one file reached by two paths is one database, two copies of it are two;
* the agent's instance id hashes those with this machine's ``/etc/machine-id`` and boot id and the
  agent's node name: two machines serving copies of one recording are two instances, and so are clones
  of one VM image (same machine-id, same files, but each booted on its own) and two agents serving one
  database under two names; one agent listed twice, or reached at two addresses, is one (and so are two
  agents serving one database under one name: their answers are the same). It stays the same while the
  host is up; a reboot gives the agent a new one, which the fleet client never needs to remember.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import uuid
from pathlib import Path

INSTANCE_KEY = "instance_id"
MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
INSTANCE_HEX = 16  # characters of the agent's instance id (64 bits)


def stored_instance_id(conn: sqlite3.Connection) -> str | None:
    """The database's own instance id from ``schema_info``; None when it has none (or no such table)."""
    try:
        row = conn.execute("SELECT value FROM schema_info WHERE key = ?", (INSTANCE_KEY,)).fetchone()
    except sqlite3.OperationalError:
        return None
    return str(row[0]) if row and row[0] else None


def ensure_instance_id(conn: sqlite3.Connection) -> None:
    """Give a writable database its instance id once (inside the caller's transaction, if any)."""
    conn.execute(
        "INSERT OR IGNORE INTO schema_info(key, value) VALUES (?, ?)",
        (INSTANCE_KEY, uuid.uuid4().hex),
    )


BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's random id: what two clones of one VM image (same machine-id, same files) never share."""
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""


def machine_id() -> str:
    """This machine's id (systemd's ``machine-id``), else the hostname: what two hosts do not share."""
    for path in MACHINE_ID_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return os.uname().nodename


def database_key(conn: sqlite3.Connection, path: str | Path) -> str:
    """Which database ``path`` is: its stored instance id and the file's device and inode (see the module
    docstring). Read once, when an agent starts; :func:`instance_of` makes the agent's instance id of it."""
    st = Path(path).expanduser().stat()
    return f"{stored_instance_id(conn) or ''}:{st.st_dev}:{st.st_ino}"


def instance_of(db_key: str, node: str) -> str:
    """The instance id an agent named ``node`` serving the database :func:`database_key` named sends with
    its answers."""
    host = f"{machine_id()}:{boot_id()}"
    digest = hashlib.sha256(f"{host}\0{db_key}\0{node}".encode()).hexdigest()
    return digest[:INSTANCE_HEX]


def agent_instance(conn: sqlite3.Connection, path: str | Path, node: str) -> str:
    """The instance id an agent named ``node`` serving ``path`` sends with its answers (see the module
    docstring)."""
    return instance_of(database_key(conn, path), node)
