"""A throwaway 2-shard ClickHouse cluster on 127.0.0.1: two ``clickhouse-server`` processes (Debian's
package), each with its own config, data directory and free ports, and a ``remote_servers`` cluster of
both. Used by tests/test_clickhouse.py and bench/bench_clickhouse.py. Its own ports: a system service
the package may have started (8123/9000) is neither used nor disturbed.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

CLUSTER = "ingero_test"
SERVER_BIN = shutil.which("clickhouse-server") or shutil.which("clickhouse-server", path="/usr/sbin:/usr/bin")
READY_S = 30.0

CONFIG = """<?xml version="1.0"?>
<yandex>
  <logger><level>warning</level><log>{dir}/server.log</log><errorlog>{dir}/error.log</errorlog>
    <size>10M</size><count>1</count></logger>
  <listen_host>127.0.0.1</listen_host>
  <http_port>{http}</http_port>
  <tcp_port>{tcp}</tcp_port>
  <path>{dir}/data/</path>
  <tmp_path>{dir}/tmp/</tmp_path>
  <user_files_path>{dir}/user_files/</user_files_path>
  <format_schema_path>{dir}/format_schemas/</format_schema_path>
  <mark_cache_size>67108864</mark_cache_size>
  <uncompressed_cache_size>67108864</uncompressed_cache_size>
  <max_concurrent_queries>50</max_concurrent_queries>
  <users_config>{dir}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <remote_servers><{cluster}>{shards}</{cluster}></remote_servers>
</yandex>
"""
SHARD = "<shard><replica><host>127.0.0.1</host><port>{tcp}</port></replica></shard>"
USERS = """<?xml version="1.0"?>
<yandex>
  <profiles><default><max_memory_usage>2000000000</max_memory_usage></default></profiles>
  <users><default><password></password><networks><ip>127.0.0.1</ip></networks>
    <profile>default</profile><quota>default</quota></default></users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors>
    <result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time></interval></default></quotas>
</yandex>
"""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """One clickhouse-server process with its own directory; ``stop(kill=True)`` is a crash."""

    def __init__(self, root: Path, http: int, tcp: int) -> None:
        self.dir, self.http, self.tcp = root, http, tcp
        self.url = f"http://127.0.0.1:{http}"
        self.proc: subprocess.Popen[bytes] | None = None

    def configure(self, tcps: list[int]) -> None:
        for sub in ("data", "tmp", "user_files", "format_schemas"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        shards = "".join(SHARD.format(tcp=t) for t in tcps)
        (self.dir / "config.xml").write_text(
            CONFIG.format(dir=self.dir, http=self.http, tcp=self.tcp, cluster=CLUSTER, shards=shards)
        )
        (self.dir / "users.xml").write_text(USERS)

    def start(self) -> None:
        if SERVER_BIN is None:
            raise RuntimeError("clickhouse-server is not installed (apt-get install clickhouse-server)")
        out = open(self.dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the child, closed at stop
        self.proc = subprocess.Popen(
            [SERVER_BIN, f"--config-file={self.dir / 'config.xml'}"],
            cwd=self.dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        out.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/ping", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        tail = ""
        for name in ("stdout.log", "error.log"):
            p = self.dir / name
            if p.exists():
                tail += p.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"clickhouse-server on {self.url} not ready in {READY_S}s: {tail}")

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.start()
        self.wait_ready()


@contextlib.contextmanager
def local_cluster(root: Path) -> Iterator[list[Server]]:
    """Two servers under ``root``, ready, with ingero's schema applied; killed on exit (throwaway data)."""
    from ingero.clickhouse.client import ClickHouse
    from ingero.clickhouse.schema import ddl

    h1, t1, h2, t2 = _free_ports(4)
    servers = [Server(root / "s1", h1, t1), Server(root / "s2", h2, t2)]
    try:
        for s in servers:
            s.configure([t1, t2])
            s.start()
        for s in servers:
            s.wait_ready()
            with ClickHouse(s.url) as ch:
                for sql in ddl(CLUSTER):
                    ch.execute(sql)
        yield servers
    finally:
        for s in servers:
            s.stop(kill=True)  # a graceful shutdown only costs seconds
