"""A stand-in serving engine for the inference tests: an HTTP server publishing an engine's real metric
names (through prometheus_client, as vLLM, SGLang and TGI publish theirs), with values that move at
every scrape along a scenario.

Run as a process whose command line looks like the engine's (``<dir>/vllm serve MODEL --port N``,
``<dir>/python3 -m sglang.launch_server --port N``, ``<dir>/text-generation-launcher --port N``) so the
tracer's detection finds it; or in-process with :func:`serve`.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROOT = Path(__file__).resolve().parents[1]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# scenario: at scrape k of n -> (running, waiting, kv usage 0..1, preemptions added, TTFT seconds)
State = tuple[float, float, float, int, float]
N = 30


def healthy_busy(k: int) -> State:
    """A full batch, a cache well used, a queue that comes and goes, steady first tokens."""
    return (64.0, float((k * 7) % 5), 0.80 + 0.05 * ((k * 3) % 3), 0, 0.08 + 0.01 * (k % 3))


def full_cache_no_preemption(k: int) -> State:
    """The cache near full, nothing preempted: well used, not a problem."""
    return (48.0, float(k % 3), 0.97, 0, 0.09)


def kv_pressure(k: int) -> State:
    """From a third in, the cache is full and preemptions rise (recomputed prefill)."""
    hot = k >= N // 3
    return (48.0, float(k % 3), 0.985 if hot else 0.7, 3 if hot else 0, 0.09)


def queue_growth(k: int) -> State:
    """Arrivals beyond capacity: the queue grows every scrape and first tokens slow; the cache is fine."""
    return (32.0, float(2 + 6 * k), 0.75, 0, 0.08 * (1 + k / 3))


SCENARIOS: dict[str, Callable[[int], State]] = {
    f.__name__: f for f in (healthy_busy, full_cache_no_preemption, kv_pressure, queue_growth)
}
NAMES = {  # engine: (running, waiting, kv usage, preemptions counter, TTFT histogram), as each publishes
    "vllm": (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
        "vllm:time_to_first_token_seconds",
    ),
    "sglang": (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_retracted_reqs",
        "sglang:time_to_first_token_seconds",
    ),
}


# vLLM's other families (a real page's weight, for the scrape-cost bench): histograms and counters
FULL_PAGE = (
    "e2e_request_latency_seconds",
    "time_per_output_token_seconds",
    "inter_token_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_max_tokens",
)
FULL_COUNTERS = ("prompt_tokens", "generation_tokens", "request_success")


class Engine:
    """The metrics of one stand-in engine; each :meth:`page` is one scrape (the scenario advances).
    ``full``: also the rest of a real page (:data:`FULL_PAGE`, :data:`FULL_COUNTERS`)."""

    def __init__(self, engine: str, scenario: str, *, full: bool = False) -> None:
        self.scenario = SCENARIOS[scenario]
        self.k = 0
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        run, wait, kv, pre, ttft = NAMES[engine]
        self.running = Gauge(run, "Number of requests running", labels, registry=self.registry)
        self.waiting = Gauge(wait, "Number of requests waiting", labels, registry=self.registry)
        self.kv = Gauge(kv, "KV-cache usage (1 = 100%)", labels, registry=self.registry)
        self.pre = Counter(pre, "Cumulative preemptions", labels, registry=self.registry)
        self.ttft = Histogram(ttft, "Time to first token", labels, buckets=TTFT_BUCKETS, registry=self.registry)
        finished = "vllm:request_success" if engine == "vllm" else "sglang:num_requests"
        self.finished = Counter(finished, "Requests finished", labels, registry=self.registry)
        Gauge("process_open_fds", "not the engine's own", registry=self.registry).set(12)
        prefix = run.split(":")[0] + ":"
        self.extra = (
            [Histogram(prefix + n, n, labels, buckets=TTFT_BUCKETS, registry=self.registry) for n in FULL_PAGE]
            if full
            else []
        )
        self.counters = [Counter(prefix + n, n, labels, registry=self.registry) for n in FULL_COUNTERS] if full else []

    def page(self) -> bytes:
        with self.lock:
            running, waiting, kv, pre, ttft = self.scenario(self.k)
            m = "llama-3-8b"
            self.running.labels(m).set(running)
            self.waiting.labels(m).set(waiting)
            self.kv.labels(m).set(kv)
            self.pre.labels(m).inc(pre)
            self.finished.labels(m).inc(running // 8)  # a moving batch finishes requests
            for _ in range(4):
                self.ttft.labels(m).observe(ttft)
            for i, h in enumerate(self.extra):
                h.labels(m).observe(0.01 * (1 + (self.k + i) % 50))
            for c in self.counters:
                c.labels(m).inc(running)
            self.k += 1
            return generate_latest(self.registry)


def serve(engine: Engine, port: int = 0) -> ThreadingHTTPServer:
    """Serve ``engine`` on 127.0.0.1:``port`` (0: any) from a daemon thread; ``server_address`` says where."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn (vLLM, SGLang) and TGI's router serve

        def setup(self) -> None:
            super().setup()  # no Nagle (asyncio's default too): headers and body never wait for an ACK
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = engine.page()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher(directory: Path, name: str) -> Path:
    """An executable named like the engine's entry point (``vllm``, ``text-generation-launcher``) that
    runs :func:`main`: its command line is the engine's."""
    path = directory / name
    path.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.engine_standin import main\nmain(sys.argv)\n"
    )
    path.chmod(0o755)
    return path


def main(argv: list[str]) -> None:
    """``<launcher> ... --port N [--scenario NAME] [--engine vllm|sglang] [--full-page] [--cuda-lib PATH]``:
    serve until killed (with ``--cuda-lib``, calling its cudaMalloc every 10 ms meanwhile)."""

    def arg(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default

    engine = Engine(arg("--engine", "vllm"), arg("--scenario", "healthy_busy"), full="--full-page" in argv)
    server = serve(engine, int(arg("--port", "0")))
    print(server.server_address[1], flush=True)
    if "--cuda-lib" in argv:  # the engine's GPU side: the CUDA-shaped library, called as a serving loop would
        import ctypes
        import time

        lib, ptr = ctypes.CDLL(arg("--cuda-lib", "")), ctypes.c_void_p()
        while True:
            lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(4096))
            time.sleep(0.01)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv)
