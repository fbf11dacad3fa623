"""``ingero trace --inference``: scrape every serving engine's metrics once a second into the recording.

Engines are found by command line (:mod:`ingero.agent.trace.engines`), again every ``detect_every`` seconds,
so one started after the agent is picked up and one that exited is dropped. Each engine is scraped on
its own clock, in a worker thread (its own kept-alive connection, a short timeout: a slow engine
never holds the others, the trio loop or the recording back): the families the engine publishes under
its own prefix are parsed with prometheus_client's parser and the rows handed to the tracer's single
writer (``sink``: the pipeline's ``add_rows``). Names are kept exactly as published (:mod:`ingero.store.engine_metrics`); a sample is
stored when it changed since the engine's previous scrape, and every sample once a minute. Each series
line goes through the parser once; later scrapes read its value only (:func:`parse`).

A failing endpoint (refused, timed out, not Prometheus text) is noted once — a warning on the
``ingero.inference`` logger, and in :attr:`Scraper.failing` — and retried at every tick; its recovery
is noted too.
"""

from __future__ import annotations

import http.client
import logging
import math
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from prometheus_client.parser import text_string_to_metric_families

from ingero.agent.trace.engines import PREFIXES, Engine, detect
from ingero.store.engine_metrics import EngineMetricRow, labels_text

log = logging.getLogger("ingero.inference")
INTERVAL_S = 1.0
DETECT_EVERY_S = 5.0
TIMEOUT_S = 0.5
FULL_EVERY_NS = 60 * 1_000_000_000  # every sample stored at least this often
MAX_BODY = 4 << 20  # a metrics page larger than this is not read whole
MAX_SERIES = 100_000  # series lines remembered per engine (parse's ``known``)


def parse(engine: str, text: str, known: dict[str, tuple[str, str]] | None = None) -> list[tuple[str, str, float]]:
    """(metric, labels, value) of every sample ``engine`` publishes under its prefix, names as published.

    Each sample line is parsed by prometheus_client's parser; ``known`` (one per engine, kept across
    scrapes) remembers what the parser made of a series' line up to its value (``name{labels}``), so the
    next scrape reads only the value of a series already parsed — a line with a timestamp, or one the
    parser has not seen, goes to the parser whole."""
    prefixes = PREFIXES[engine]
    out: list[tuple[str, str, float]] = []
    for line in text.splitlines():
        if not line.startswith(prefixes):  # comments (# HELP, # TYPE) and other families
            continue
        head, _, last = line.rpartition(" ")
        hit = known.get(head) if known is not None else None
        if hit is not None:
            try:
                value = float(last)
            except ValueError:
                hit = None
            else:
                if not math.isnan(value):
                    out.append((*hit, value))
                continue
        for family in text_string_to_metric_families(line + "\n"):
            for smp in family.samples:
                key = (smp.name, labels_text(dict(smp.labels)))
                if known is not None and smp.timestamp is None and len(known) < MAX_SERIES:
                    known[head] = key
                if not math.isnan(smp.value):
                    out.append((*key, float(smp.value)))
    return out


class _Fetcher:
    """One endpoint's kept-alive HTTP/1.1 connection (the standard library's http.client: about half
    httpx's CPU per request, which matters at one request a second per engine on every node)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        u = urllib.parse.urlsplit(url)
        self.path = u.path or "/metrics"
        self.conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout_s)

    def get(self) -> str:
        """The page (at most MAX_BODY bytes); OSError or http.client.HTTPException when it fails. A kept-alive
        connection the server closed meanwhile is opened again once."""
        for attempt in (0, 1):
            reused = self.conn.sock is not None
            try:
                self.conn.request("GET", self.path, headers={"Accept": "text/plain"})
                resp = self.conn.getresponse()
                body = resp.read(MAX_BODY)
            except (OSError, http.client.HTTPException):
                self.conn.close()
                if reused and attempt == 0:
                    continue
                raise
            if not resp.isclosed():  # a page over MAX_BODY: the rest is never read
                self.conn.close()
            if resp.status != 200:
                raise http.client.HTTPException(f"HTTP {resp.status}")
            return body.decode("utf-8", "replace")
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


@dataclass
class _State:
    engine: Engine
    fetcher: _Fetcher  # its own connection, kept alive between scrapes
    last: dict[tuple[str, str], float] = field(default_factory=dict)
    known: dict[str, tuple[str, str]] = field(default_factory=dict)  # see parse
    full_at: int = 0  # when every sample was last stored
    failing: str | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class Scraper:
    """The scrape loop; :meth:`run` in the tracer's nursery."""

    def __init__(
        self,
        sink: Callable[[list[EngineMetricRow]], bool],
        *,
        interval_s: float = INTERVAL_S,
        detect_every_s: float = DETECT_EVERY_S,
        timeout_s: float = TIMEOUT_S,
        find: Callable[[], list[Engine]] = detect,
    ) -> None:
        self.sink, self.interval_s, self.detect_every_s, self.timeout_s = sink, interval_s, detect_every_s, timeout_s
        self.find = find
        self.engines: dict[tuple[int, str], _State] = {}
        self.scrapes = self.rows = self.errors = 0

    @property
    def failing(self) -> dict[str, str]:
        """url -> why, of the endpoints failing now."""
        return {s.engine.url: s.failing for s in self.engines.values() if s.failing}

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    await self._detect(nursery)
                    await trio.sleep(self.detect_every_s)
            finally:
                for st in self.engines.values():
                    st.fetcher.close()

    async def _detect(self, nursery: trio.Nursery) -> None:
        """Start a loop for each new engine, stop the loops of those gone."""
        found = {(e.pid, e.url): e for e in await trio.to_thread.run_sync(self.find)}
        for key in list(self.engines):
            if key not in found:
                self.engines.pop(key).scope.cancel()
        for key, e in found.items():
            if key not in self.engines:
                st = self.engines[key] = _State(e, _Fetcher(e.url, self.timeout_s))
                nursery.start_soon(self._engine_loop, st)
                log.info("inference: %s (pid %d): scraping %s", e.engine, e.pid, e.url)

    async def _engine_loop(self, st: _State) -> None:
        """One engine's scrapes, on its own clock and off the trio loop (a worker thread fetches and
        parses): a slow endpoint delays no other engine, and no other task of the agent."""
        with st.scope:
            try:
                tick = trio.current_time()
                while True:
                    rows, why = await trio.to_thread.run_sync(self._scrape, st, abandon_on_cancel=True)
                    self._scraped(st, rows, why)
                    tick += self.interval_s
                    await trio.sleep_until(max(tick, trio.current_time()))
            finally:
                st.fetcher.close()

    def _scrape(self, st: _State) -> tuple[list[EngineMetricRow], str | None]:
        """In a worker thread: one scrape's rows (the samples that changed, or all once a minute), or why
        it failed."""
        e = st.engine
        ts = time.time_ns()
        try:
            samples = parse(e.engine, st.fetcher.get(), st.known)
        except http.client.HTTPException as exc:
            return [], str(exc) or type(exc).__name__
        except OSError as exc:  # refused, reset, timed out
            return [], type(exc).__name__
        except ValueError as exc:  # prometheus_client's parser: not the text format
            return [], f"not Prometheus text ({type(exc).__name__})"
        full = ts - st.full_at >= FULL_EVERY_NS
        rows: list[EngineMetricRow] = []
        last = st.last
        for metric, labels, value in samples:
            key = (metric, labels)
            if full or last.get(key) != value:
                rows.append((ts, e.pid, e.engine, metric, labels, value))
            last[key] = value
        if full:
            st.full_at = ts
        return rows, None

    def _scraped(self, st: _State, rows: list[EngineMetricRow], why: str | None) -> None:
        e = st.engine
        if why is not None:
            self._failed(st, why)
            return
        self.scrapes += 1
        if st.failing:
            log.warning("inference: %s (pid %d) at %s answers again", e.engine, e.pid, e.url)
            st.failing = None
        if rows and self.sink(rows):
            self.rows += len(rows)

    def _failed(self, st: _State, why: str) -> None:
        self.errors += 1
        if st.failing is None:  # noted once; retried at every tick
            log.warning(
                "inference: %s (pid %d) at %s: %s (retrying every tick)",
                st.engine.engine,
                st.engine.pid,
                st.engine.url,
                why,
            )
        st.failing = why


__all__ = ["Scraper", "parse"]
