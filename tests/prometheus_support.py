"""A real Prometheus (Debian ``prometheus``) for the tests: its own config and data directory in a
temporary folder, listening on a free loopback port, stopped (and reaped) on exit.

Tests that use it skip, with the reason, where the binary is missing (``scripts/setup.sh --system``
installs it; CI runs that as root).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "configs" / "prometheus" / "ingero-rules.yml"
RULE_TESTS = ROOT / "configs" / "prometheus" / "ingero-rules.test.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "ingero-dashboard.json"

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian 'prometheus' (with promtool) is not installed; scripts/setup.sh --system installs it",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Any, timeout: float = 60.0, step: float = 0.2) -> Any:
    """Poll ``check()`` until it returns something truthy (servers starting, scrapes landing)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as e:
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]

    def get(self, path: str, **params: str) -> Any:
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{q}", timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets_up(self, n: int) -> bool:
        active = self.get("/api/v1/targets")["activeTargets"]
        return len(active) == n and all(t["health"] == "up" for t in active)


@contextmanager
def running_prometheus(tmp: Path, targets: dict[str, str], *, rules: bool = True) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (node name -> host:port) every second."""
    tmp.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "ingero",
                "static_configs": [{"targets": [addr], "labels": {"agent": name}} for name, addr in targets.items()],
            }
        ],
    }
    if rules:
        config["rule_files"] = [str(RULES)]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}", proc)

        def ready() -> bool:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                return r.status == 200

        wait_until("prometheus to start", ready)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
