"""Concurrent fan-out to every agent: one trio nursery, one task per node, one shared HTTPS transport.

:class:`FleetClient` owns one :class:`~ingero.fleet.transport.NodeTransport` (one SSL context, built
once; an ``httpx.AsyncClient`` per node with at most two keep-alive connections, so at most
``2 × fanout`` open at once) and a
:class:`trio.CapacityLimiter`. :meth:`FleetClient.fan_out` runs a *job* (an async function of a
:class:`NodeClient`) for every node at once; each node's job runs under its own deadline, concurrently
with that node's clock-skew sample over the same transport, and ends as a
:class:`~ingero.fleet.outcome.NodeOutcome` — a node's failure is recorded, never raised, so it cannot
cancel the others.
"""

from __future__ import annotations

import json as _json
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from types import TracebackType
from typing import Any
from urllib.parse import urlencode

import trio

from ingero import __version__
from ingero.config import NodeSpec
from ingero.fleet import skew as skewmod
from ingero.fleet.budget import AnswerBudget, BudgetExceeded, parsed_size
from ingero.fleet.outcome import Kind, NodeFailure, NodeOutcome, classify
from ingero.fleet.settings import ClientSettings, build_ssl_context, check_plaintext, load_system_trust
from ingero.fleet.transport import NodeTransport, Origin, Request, Response

NodeJob = Callable[["NodeClient"], Awaitable[Any]]
OutcomeCallback = Callable[[NodeOutcome], None]

_JSON_BODY = (("content-type", "application/json"),)
# Failures after which the node's skew samples are pointless (they would fail the same way).
_TRANSPORT_KINDS = frozenset({Kind.TIMEOUT, Kind.REFUSED, Kind.UNREACHABLE, Kind.TLS})


def base_url(spec: NodeSpec, settings: ClientSettings) -> str:
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    return f"{settings.scheme}://{host}:{spec.port}"


def origin_of(spec: NodeSpec, settings: ClientSettings) -> Origin:
    return (settings.scheme, spec.host, spec.port)


def common_headers(settings: ClientSettings) -> list[tuple[str, str]]:
    """Headers of every request of a fan-out (httpx adds ``host`` per node)."""
    headers = [("user-agent", f"ingero/{__version__}"), ("accept", "application/json")]
    if settings.token:
        headers.append(("authorization", f"Bearer {settings.token}"))
    return headers


class NodeClient:
    """One node's handle on the shared client: JSON requests that raise :class:`NodeFailure`."""

    def __init__(
        self,
        spec: NodeSpec,
        settings: ClientSettings,
        transport: NodeTransport,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.transport = transport
        self.base_url = base_url(spec, settings)
        self.origin = origin_of(spec, settings)
        self.node: str | None = None  # the agent's identity, from its first answer
        self.instance: str | None = None  # the agent's instance id, from its answers (older agents: None)
        self.samples: list[skewmod.TimeSample] = []  # clock samples carried on the answers' headers
        self._time_request: Request | None = None

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        return await self.request("GET", path, params=params)

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, json=body)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        return self.check(await self.send(method, path, json=json, params=params), path)

    def build(
        self, method: str, path: str, *, json: dict[str, Any] | None = None, params: dict[str, str] | None = None
    ) -> Request:
        target = f"{path}?{urlencode(params)}" if params else path
        if json is None:
            return Request(method, self.origin, target)
        body = _json.dumps(json, separators=(",", ":")).encode()
        return Request(method, self.origin, target, _JSON_BODY, body)

    async def send(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> Response:
        """One request; transport failures raise a classified :class:`NodeFailure`."""
        try:
            resp = await self.transport.request(self.build(method, path, json=json, params=params))
        except Exception as e:  # transport errors of every flavour → one classified outcome
            raise self.classify(e) from None
        sample = skewmod.sample_from_headers(resp.sent_ns, resp.first_byte_ns, resp.headers)
        if sample is not None:
            self.samples.append(sample)
        return resp

    def classify(self, exc: BaseException) -> NodeFailure:
        s = self.settings
        return classify(exc, s.timeout_s, tls=not s.plaintext, client_cert=bool(s.client_cert))

    def check(self, resp: Response, path: str) -> dict[str, Any]:
        """Validate the common envelope: JSON object, ``ok``, ``node``; map error answers to kinds."""
        body = self._parse(resp)
        status = resp.status
        if status >= 400:
            error = body.get("error") if isinstance(body, dict) else None
            text = " ".join(str(error).split()) if error else "error"
            kind = Kind.AUTH if status in (401, 403) else Kind.HTTP
            if status == 404 and not error:
                kind, text = Kind.SCHEMA, f"{path} not found (agent too old or not an ingero agent?)"
            raise NodeFailure(kind, f"HTTP {status}: {text}", status=status, node=self._node_of(body))
        if body is None:
            raise NodeFailure(Kind.PROTOCOL, f"{path}: the answer is not JSON", status=status)
        if not isinstance(body, dict) or body.get("ok") is not True:
            raise NodeFailure(Kind.SCHEMA, f"{path}: the answer lacks 'ok: true' (not an ingero agent?)", status=status)
        node = self._node_of(body)
        if node is None:
            raise NodeFailure(Kind.SCHEMA, f"{path}: the answer lacks the agent's 'node' name", status=status)
        self.node = node
        instance = body.get("instance")
        if isinstance(instance, str) and instance:
            self.instance = instance
        return body

    def _parse(self, resp: Response) -> Any:
        """The JSON body, or None when it is not JSON; its parsed size is charged to the fan-out's budget."""
        content = resp.content
        try:
            self.transport.budget.take(max(0, parsed_size(content) - len(content)))
        except BudgetExceeded as e:
            raise self.classify(e) from None
        try:
            return _json.loads(content)
        except (ValueError, RecursionError):
            return None

    @staticmethod
    def _node_of(body: Any) -> str | None:
        if isinstance(body, dict) and isinstance(body.get("node"), str) and body["node"]:
            return str(body["node"])
        return None

    async def time_sample(self) -> skewmod.TimeSample:
        """One ``/api/v1/time`` round trip for the skew estimate; ``t1``/``t4`` are the transport's,
        taken around the bytes on the wire."""
        # Built once per node and handed straight to the transport: a sample costs a round trip.
        if self._time_request is None:
            self._time_request = self.build("GET", "/api/v1/time")
        try:
            resp = await self.transport.request(self._time_request)
        except Exception as e:
            raise self.classify(e) from None
        body = self.check(resp, "/api/v1/time")
        try:
            return skewmod.sample_from_body(resp.sent_ns, resp.received_ns, body)
        except ValueError as e:
            raise NodeFailure(Kind.SCHEMA, str(e)) from None


class FleetClient:
    """Fan-out over one shared client. Use as ``async with FleetClient(nodes, settings) as fc: ...``."""

    def __init__(self, nodes: Sequence[NodeSpec], settings: ClientSettings | None = None) -> None:
        self.nodes = list(nodes)
        self.settings = s = settings or ClientSettings()
        check_plaintext(self.nodes, s)
        self._open = False
        ctx = build_ssl_context(s, defer_system_trust=True)  # the system store: at the first handshake
        self.transport = NodeTransport(
            ctx,
            before_tls=partial(load_system_trust, ctx) if ctx is not None and s.system_trust else None,
            headers=common_headers(s),
            timeout_s=s.timeout_s,
            per_node=2,
            # A skew sample waits up to half the deadline for the query's connection before opening its own.
            patience=s.timeout_s / 2,
            max_answer_bytes=s.max_answer_bytes,
            budget=AnswerBudget(s.max_total_bytes),
        )
        self._active = 0  # fan-outs running on this client (they share one answer budget)
        # Fleets wider than the fan-out drop each node's connections when it is done (bounded fds and
        # memory at 1,000 nodes); smaller ones keep them for the next operation on this client.
        self.release_nodes = len(self.nodes) > s.fanout
        self.limiter = trio.CapacityLimiter(max(1, s.fanout))

    async def __aenter__(self) -> FleetClient:
        self._open = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._open:
            with trio.CancelScope(shield=True):
                await self.transport.aclose()
            self._open = False

    # --- fan-out ----------------------------------------------------------------------------------

    async def fan_out(
        self,
        job: NodeJob,
        *,
        skew: bool = True,
        on_outcome: OutcomeCallback | None = None,
    ) -> list[NodeOutcome]:
        """Run ``job`` on every node at once; one outcome per node, in node-list order."""
        outcomes: list[NodeOutcome | None] = [None] * len(self.nodes)

        async def one(i: int, spec: NodeSpec) -> None:
            async with self.limiter:
                outcome = await self._run_node(spec, job, skew)
                if self.release_nodes:
                    await self.transport.release(origin_of(spec, self.settings))
            outcomes[i] = outcome
            if on_outcome is not None:
                on_outcome(outcome)

        if self._active == 0:  # a fresh budget per fan-out (concurrent fan-outs share one)
            self.transport.budget = AnswerBudget(self.settings.max_total_bytes)
        self._active += 1
        try:
            async with trio.open_nursery() as nursery:
                for i, spec in enumerate(self.nodes):
                    nursery.start_soon(one, i, spec)
        finally:
            self._active -= 1
        return flag_duplicates([o for o in outcomes if o is not None])

    async def _run_node(self, spec: NodeSpec, job: NodeJob, want_skew: bool) -> NodeOutcome:
        s = self.settings
        if not self._open:
            raise RuntimeError("FleetClient used outside 'async with'")
        conn = NodeClient(spec, s, self.transport)
        started = time.perf_counter()
        result: dict[str, Any] = {}
        time_samples: list[skewmod.TimeSample] = []
        sample_errors: list[str] = []
        job_done = trio.Event()

        async def run_job(scope: trio.CancelScope) -> None:
            try:
                result["data"] = await job(conn)
            except Exception as e:  # a node's failure is its outcome, whatever it was
                failure = conn.classify(e)
                result["failure"] = failure
                if failure.kind in _TRANSPORT_KINDS:
                    scope.cancel()  # its skew sample would only wait for the same failure
            finally:
                job_done.set()

        async def take_sample() -> None:
            try:
                time_samples.append(await conn.time_sample())
            except Exception as e:  # a failed sample never drops the node
                sample_errors.append(conn.classify(e).reason)

        async def run_skew() -> None:
            # One light /time sample alongside the job; the job's own answers carry a sample each
            # (the agent's receive/transmit times in headers). Only an agent whose answers carry none
            # (an older agent) gets the rest of ``skew_samples`` as /time round trips.
            await take_sample()
            await job_done.wait()
            if not conn.samples and "data" in result:
                for _ in range(s.skew_samples - 1):
                    await take_sample()

        with trio.move_on_after(s.timeout_s) as deadline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_job, nursery.cancel_scope)
                if want_skew and s.skew_samples > 0:
                    nursery.start_soon(run_skew)
        elapsed_ms = (time.perf_counter() - started) * 1000

        samples = [*conn.samples, *time_samples]
        est = skewmod.estimate(samples, failed=len(sample_errors)) if want_skew else None
        skew_error = None
        if want_skew and est is None and s.skew_samples > 0:
            skew_error = sample_errors[0] if sample_errors else "no clock sample completed in time"

        if "data" in result:
            data = result["data"]
            kind, reason = Kind.OK, ""
            if isinstance(data, dict) and data.get("truncated") is True:
                kind = Kind.TRUNCATED
                reason = str(data.get("truncated_reason") or "row limit")
            return NodeOutcome(
                spec, kind, conn.node, reason, data, 200, elapsed_ms, est, skew_error, instance=conn.instance
            )
        failure: NodeFailure | None = result.get("failure")
        if failure is None:  # the deadline struck first
            what = "answer" if conn.node is None else "complete answer"
            failure = NodeFailure(Kind.TIMEOUT, f"no {what} within {s.timeout_s:g}s")
            if deadline.cancelled_caught and time_samples:
                failure.reason += " (its /time answer did arrive: the agent is up but slow)"
        return NodeOutcome(
            spec,
            failure.kind,
            conn.node or failure.node,
            failure.reason,
            None,
            failure.status,
            elapsed_ms,
            est,
            skew_error,
            instance=conn.instance,
        )

    # --- building blocks for callers -------------------------------------------------------------

    async def request_all(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        skew: bool = True,
        on_outcome: OutcomeCallback | None = None,
    ) -> list[NodeOutcome]:
        """One request per node; each outcome's ``data`` is the agent's validated JSON body."""

        async def job(conn: NodeClient) -> dict[str, Any]:
            return await conn.request(method, path, json=json, params=params)

        return await self.fan_out(job, skew=skew, on_outcome=on_outcome)


def flag_duplicates(outcomes: list[NodeOutcome]) -> list[NodeOutcome]:
    """Tell one agent listed twice from two agents that share a name.

    * The same instance (same instance id; the same agent listed twice, or reached at two addresses):
      the first entry in list order keeps its answer, the others become ``duplicate`` outcomes.
    * Distinct instances that answered with one name (cloned VMs, recordings served without --node):
      every one is kept, marked ``twin`` so its label (node column, chains, stragglers) is
      ``name@host:port``; the fan-out's callers say so in one warning line
      (:func:`ingero.fleet.render.twin_warning`).
    * Older agents that send no instance id cannot be told from each other: of those that share a name,
      the first is kept and the others are ``duplicate`` (never counted twice).
    """
    by_instance: dict[str, NodeOutcome] = {}
    by_name: dict[str, list[NodeOutcome]] = {}
    for o in outcomes:
        if not o.answered or o.node is None:
            continue
        if o.instance is not None:
            seen = by_instance.setdefault(o.instance, o)
            if seen is not o:
                _mark_duplicate(o, seen, "the same agent instance")
                continue
        by_name.setdefault(o.node, []).append(o)
    for group in by_name.values():
        if len(group) < 2:
            continue
        # agents without an id are distinct from those with one, but not from each other: keep the first
        anonymous = [o for o in group if o.instance is None]
        for o in anonymous[1:]:
            _mark_duplicate(o, anonymous[0], "the same name as an agent that sends no instance id (too old to tell)")
        kept = [o for o in group if o.answered]
        if len(kept) > 1:
            for o in kept:
                o.twin = True
    return outcomes


def _mark_duplicate(o: NodeOutcome, first: NodeOutcome, why: str) -> None:
    o.kind = Kind.DUPLICATE
    o.reason = f"{why} as {first.spec.addr} ('{o.node}'): its answer is not counted twice (listed twice?)"
    o.data = None
