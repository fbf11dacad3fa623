"""A real ``ingero trace --inference`` (bcc): a stand-in vLLM server, started after the agent and calling
the CUDA-shaped library, is found by its command line; its metrics land in ``engine_metrics`` through
the tracer's single writer, beside its CUDA calls."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ingero.cli.main import main
from tests.bpf_support import ROOT, Built, build
from tests.engine_standin import free_port, launcher

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("bpf-build"))


def test_trace_inference_records_a_late_engine_beside_its_cuda_calls(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, ready = tmp_path / "serve.db", tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "ingero", "trace", "--db", str(db), "--cuda-lib", str(built.cudart)]
    cmd += ["--no-system-search", "--no-follow", "--quiet", "--node", "serve-node", "--inference"]
    metrics_port = free_port()  # --prometheus: the engine's series re-exported live, with the node
    cmd += ["--prometheus", f"127.0.0.1:{metrics_port}"]
    tracer = subprocess.Popen([*cmd, "--ready-file", str(ready)], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    engine = None
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert tracer.poll() is None and time.monotonic() < deadline, tracer.communicate()[1]
            time.sleep(0.05)
        port = free_port()  # started after the agent: found by the next detection (every 5 s)
        argv = ["serve", "m", "--port", str(port), "--scenario", "kv_pressure", "--cuda-lib", str(built.cudart)]
        engine = subprocess.Popen([str(launcher(tmp_path, "vllm")), *argv], stdout=subprocess.PIPE)
        assert engine.stdout is not None
        engine.stdout.readline()
        time.sleep(9)  # up to 5 s to be found, then a few scrapes at 1 s
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            exposition = r.read().decode()
    finally:
        if engine is not None:
            engine.kill()
            engine.wait()
        tracer.send_signal(signal.SIGTERM)
        _, err = tracer.communicate(timeout=120)
    assert tracer.returncode == 0, err
    conn = sqlite3.connect(db)
    try:
        metrics = conn.execute(
            "SELECT DISTINCT metric FROM engine_metrics WHERE pid = ? AND engine = 'vllm' AND node = 'serve-node'",
            (engine.pid,),
        ).fetchall()
        scrapes = conn.execute("SELECT count(DISTINCT ts) FROM engine_metrics WHERE pid = ?", (engine.pid,)).fetchone()
        calls = conn.execute("SELECT count(*) FROM events WHERE pid = ? AND source = 1", (engine.pid,)).fetchone()
    finally:
        conn.close()
    names = {m for (m,) in metrics}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"} <= names
    assert "vllm:time_to_first_token_seconds_bucket" in names and scrapes[0] >= 3
    assert calls[0] > 50  # its CUDA calls, recorded by the probes
    live = f'engine="vllm",engine_pid="{engine.pid}",model_name="llama-3-8b",node="serve-node"'
    assert f"ingero_engine_vllm_kv_cache_usage_perc{{{live}" in exposition
    assert f"ingero_engine_vllm_num_preemptions_total{{{live}" in exposition
    assert main(["explain", "--db", str(db), "--json"]) == 0  # reads the engine's rows (scenarios: test_inference)
    assert json.loads(capsys.readouterr().out)["events"] > 0
