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
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:  # imported where used: a stand-in engine process starts without the tracer's modules
    from ingero.agent.trace.engine_scrape import Scraper
    from ingero.agent.trace.engines import Engine as Found
    from ingero.store.engine_metrics import EngineMetricRow

ROOT = Path(__file__).resolve().parents[1]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
# scenario: at scrape k of n -> (running, waiting, kv usage 0..1, preemptions added, TTFT seconds), and
# optionally (prompt tokens, generated tokens, time per output token) of the scrape interval; without them a
# steady mix: PROMPT_LEN tokens per request admitted (as many as finished), a token per running request
# per decode step of STEADY_TPOT.
State = tuple[float, ...]
N = 30
PROMPT_LEN = 512
STEADY_TPOT = 0.02


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


def _burst(k: int) -> bool:
    """Prefill bursts (long prompts arriving together): now and then early on, most of the last third."""
    return k in (3, 13, 17) or (k >= 2 * N // 3 and k % 5 != 0)


def mixed_phases(k: int) -> State:
    """A healthy server whose mix shifts to long prompts: in a burst 16 prompts of 2,000 tokens are
    prefilled, first tokens take 0.5 s and the decode steps in between slow to 60 ms (prefill shares the
    GPU); between bursts a steady decode at 20 ms a token. Each phase is as fast as it always was."""
    if _burst(k):
        return (64.0, 3.0, 0.85, 0, 0.5, 16 * 2000.0, 64 / 0.06, 0.06)
    return (64.0, 1.0, 0.8, 0, 0.08, 4 * PROMPT_LEN, 64 / STEADY_TPOT, STEADY_TPOT)


def decode_regression(k: int) -> State:
    """The same mix with bursts spread evenly, and decode slowing 2.5x from the second half on (another
    tenant's kernels, clocks throttled): the decode steps between bursts take 50 ms a token."""
    slow = k >= N // 2
    if k % 4 == 3:
        return (64.0, 3.0, 0.85, 0, 0.5, 16 * 2000.0, 64 / 0.06, 0.06)
    tpot = 2.5 * STEADY_TPOT if slow else STEADY_TPOT
    return (64.0, 1.0, 0.8, 0, 0.08, 4 * PROMPT_LEN, 64 / tpot, tpot)


def idle(k: int) -> State:
    """Low load: no request running or waiting (nothing observed: no first token, no decode step)."""
    return (0.0, 0.0, 0.0, 0, 0.0)


SCENARIOS: dict[str, Callable[[int], State]] = {
    f.__name__: f
    for f in (healthy_busy, full_cache_no_preemption, kv_pressure, queue_growth, mixed_phases, decode_regression, idle)
}
NAMES = {  # engine: (running, waiting, kv usage, preemptions counter, TTFT histogram, finished counter,
    # prompt and generated token counters, time-per-output-token histogram), as each publishes them
    "vllm": (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
        "vllm:time_to_first_token_seconds",
        "vllm:request_success",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_per_output_token_seconds",
    ),
    "sglang": (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_retracted_reqs",
        "sglang:time_to_first_token_seconds",
        "sglang:num_requests",
        "sglang:prompt_tokens",
        "sglang:generation_tokens",
        "sglang:time_per_output_token_seconds",
    ),
}


# vLLM's other families (a real page's weight, for the scrape-cost bench): histograms and counters
FULL_PAGE = (
    "e2e_request_latency_seconds",
    "inter_token_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_max_tokens",
)
FULL_COUNTERS = ("num_aborted_requests",)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Engine:
    """The metrics of one stand-in engine; each :meth:`page` is one scrape (the scenario advances).
    ``full``: also the rest of a real page (:data:`FULL_PAGE`, :data:`FULL_COUNTERS`)."""

    def __init__(self, engine: str, scenario: str, *, full: bool = False) -> None:
        self.scenario = SCENARIOS[scenario]
        self.k = 0
        self.lock = threading.Lock()
        self.scraped = threading.Event()  # set by the first scrape
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        run, wait, kv, pre, ttft, finished, prompt, gen, tpot = NAMES[engine]
        self.running = Gauge(run, "Number of requests running", labels, registry=self.registry)
        self.waiting = Gauge(wait, "Number of requests waiting", labels, registry=self.registry)
        self.kv = Gauge(kv, "KV-cache usage (1 = 100%)", labels, registry=self.registry)
        self.pre = Counter(pre, "Cumulative preemptions", labels, registry=self.registry)
        self.ttft = Histogram(ttft, "Time to first token", labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.finished = Counter(finished, "Requests finished", labels, registry=self.registry)
        self.prompt = Counter(prompt, "Prefill tokens processed", labels, registry=self.registry)
        self.gen = Counter(gen, "Generation tokens processed", labels, registry=self.registry)
        self.tpot = Histogram(tpot, "Time per output token", labels, buckets=TPOT_BUCKETS, registry=self.registry)
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
            state = self.scenario(self.k)
            running, waiting, kv, pre, ttft = state[:5]
            prompt, gen, tpot = (
                state[5:] if len(state) > 5 else (PROMPT_LEN * (running // 8), running / STEADY_TPOT, STEADY_TPOT)
            )
            m = "llama-3-8b"
            self.running.labels(m).set(running)
            self.waiting.labels(m).set(waiting)
            self.kv.labels(m).set(kv)
            self.pre.labels(m).inc(pre)
            self.finished.labels(m).inc(running // 8)  # a moving batch finishes requests
            busy = bool(running or waiting)  # an idle engine observes no first token and no decode step
            for _ in range(4 if busy else 0):
                self.ttft.labels(m).observe(ttft)
            self.prompt.labels(m).inc(prompt)
            self.gen.labels(m).inc(gen)
            for _ in range(8 if busy else 0):
                self.tpot.labels(m).observe(tpot)
            for i, h in enumerate(self.extra):
                h.labels(m).observe(0.01 * (1 + (self.k + i) % 50))
            for c in self.counters:
                c.labels(m).inc(running)
            self.k += 1
            self.scraped.set()
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
    # serve_forever notices shutdown() at its next poll: 0.5 s by default, paid by every test that stops one
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


def scrape(
    find: Callable[[], list[Found]], seconds: float, interval: float = 0.02, *, until: int = 0, **kw: float
) -> tuple[Scraper, list[EngineMetricRow]]:
    """Run a scraper for ``seconds``; with ``until``, until it has scraped that many pages (at most 60 s:
    a loaded machine slows the ticks, never the count a scenario needs)."""
    import trio

    from ingero.agent.trace.engine_scrape import Scraper

    rows: list[EngineMetricRow] = []

    def sink(batch: list[EngineMetricRow]) -> bool:
        rows.extend(batch)
        return True

    scraper = Scraper(sink, interval_s=interval, find=find, **kw)

    async def main() -> None:
        with trio.move_on_after(60 if until else seconds):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(scraper.run)
                if until:
                    while scraper.scrapes < until:
                        await trio.sleep(interval / 2)
                    nursery.cancel_scope.cancel()

    trio.run(main)
    return scraper, rows


def recording(path: Path, node: str, engines: list[tuple[int, str, str]], scrapes: int, *, full: bool = False) -> Path:
    """A recording of ``engines`` ((pid, engine, scenario) each, served in-process) scraped ``scrapes``
    times by the real scraper and written through the tracer's writer as ``node``."""
    from ingero.agent.trace.engines import Engine as Found
    from ingero.identity import Identity
    from ingero.store.writer import StoreWriter

    servers = {pid: serve(Engine(engine, scenario, full=full)) for pid, engine, scenario in engines}
    try:
        found = [
            Found(pid, engine, f"http://127.0.0.1:{servers[pid].server_address[1]}/metrics")
            for pid, engine, _ in engines
        ]
        scraper, rows = scrape(lambda: found, 0, interval=0.01, until=scrapes * len(engines))
    finally:
        for s in servers.values():
            s.shutdown()
    assert not scraper.failing
    with StoreWriter(path, Identity(node)) as w:
        w.write_batch(engine_metrics=rows)
    return path


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
    """``<launcher> ... --port N [--scenario NAME] [--engine vllm|sglang] [--full-page] [--cuda-lib PATH]
    [--run CMD ...]``: serve until killed (with ``--cuda-lib``, calling its cudaMalloc every 10 ms meanwhile).
    With ``--run`` (the rest of the line), once the engine has been scraped (a tracer found it), start CMD as
    this process's child — the engine's serving loop in a worker process, as vLLM's engine core runs — print
    ``child PID``, pass its output through and exit with its status."""
    child = argv[argv.index("--run") + 1 :] if "--run" in argv else []
    argv = argv[: argv.index("--run")] if child else argv

    def arg(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default

    engine = Engine(arg("--engine", "vllm"), arg("--scenario", "healthy_busy"), full="--full-page" in argv)
    server = serve(engine, int(arg("--port", "0")))
    print(server.server_address[1], flush=True)
    if child:
        import subprocess

        if not engine.scraped.wait(timeout=120):
            sys.exit("never scraped")
        loop = subprocess.Popen(child, stdin=subprocess.DEVNULL)
        print(f"child {loop.pid}", flush=True)
        sys.exit(loop.wait())
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
