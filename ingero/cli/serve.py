"""``ingero serve``: serve the agent API (TLS 1.3 / mTLS, bearer token) over an existing trace database."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingero.cli import common, metrics_flags
from ingero.config import DEFAULT_PORT

if TYPE_CHECKING:
    from ingero.agent.api.server import BoundServer, ServerSettings, TLSSetup
    from ingero.identity import Identity

DEFAULT_HOST = "127.0.0.1"  # loopback unless told otherwise
DEFAULT_LISTEN = f"{DEFAULT_HOST}:{DEFAULT_PORT}"  # the one agent port (what --nodes HOST means too)

EXAMPLES = """\
examples:
  ingero serve --db trace.db                                   https on 127.0.0.1:8080, self-signed cert
  ingero serve --db trace.db --listen 0.0.0.0:8443 --token-file /etc/ingero/token
  ingero serve --db tests/data/ingero-samples/sample-gpu-node-01.db --listen 127.0.0.1:0 --ready-file /tmp/agent.json
  ingero serve --db trace.db --listen 0.0.0.0:8443 --node gpu-node-01 \\
      --tls-cert ~/.ingero/pki/node-gpu-node-01.pem --tls-key ~/.ingero/pki/node-gpu-node-01-key.pem \\
      --client-ca ~/.ingero/pki/ca.pem                          mutual TLS: only holders of a client cert
  ingero serve --db trace.db --listen 127.0.0.1:8080 --no-tls  plain HTTP, loopback only
  ingero serve --db trace.db --prometheus :9464 --otlp http://otelcol:4318   + metrics for Prometheus / OTel

then, from the laptop:
  ingero query --nodes gpu-node-01:8443 --ca-cert ca.pem --client-cert client-me.pem --client-key client-me-key.pem \\
      "SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source"
  curl --cacert ~/.ingero/tls/server-cert.pem https://127.0.0.1:8080/api/v1/health

Without --tls-cert/--tls-key the agent makes (once) a self-signed ECDSA P-256 certificate in
~/.ingero/tls/ (mode 0600) covering this host's names and addresses, and prints its SHA-256
fingerprint. Only TLS 1.3 is spoken. --client-ca turns on mutual TLS; --token-file (or $INGERO_TOKEN,
agent.token_file) requires 'Authorization: Bearer <token>' on every request; the token never needs to be
on the command line, where 'ps' shows it. Listening beyond loopback with neither --client-ca nor a
token is refused unless --insecure-no-auth is given. Queries are admitted fairly per client: cheap
ones are never stuck behind heavy ones; when saturated the agent answers 503 with Retry-After.
--ready-file gets
{"host","port","url","pid","tls","fingerprint_sha256","node"} once listening (use port 0 for a free
port). SIGINT/SIGTERM stop the agent cleanly. Endpoints: docs/API.md.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        parents=parents,
        help="serve the agent API (TLS 1.3 / mTLS) over a trace database",
        description="Serve this node's agent API over an existing trace database: health, info, clock "
        "(for skew), read-only SQL, causal chains, per-op statistics. What 'ingero trace --listen' serves "
        "while recording, usable on its own for replays and air-gapped copies.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    common.add_db_arg(p)
    p.add_argument(
        "--listen", metavar="HOST:PORT", help=f"address to listen on (default: agent.listen or {DEFAULT_LISTEN})"
    )
    common.add_node_arg(p)
    add_server_args(p, p.add_argument_group("security"))
    lim = p.add_argument_group("limits")
    add_limit_args(lim)
    p.add_argument("--ready-file", metavar="PATH", help="write the bound address as JSON here once listening")
    metrics_flags.add_metrics_args(p)
    p.set_defaults(func=run)


def add_server_args(p: argparse.ArgumentParser, g: argparse._ArgumentGroup) -> None:
    """TLS / mTLS / token flags, shared with ``ingero trace --listen``."""
    g.add_argument("--tls-cert", metavar="PEM", help="server certificate (default: agent.tls_cert, else self-signed)")
    g.add_argument("--tls-key", metavar="PEM", help="its private key")
    g.add_argument("--client-ca", metavar="PEM", help="require client certificates signed by this CA (mutual TLS)")
    g.add_argument(
        "--token-file",
        metavar="PATH",
        help="require the bearer token held in this file (else $INGERO_TOKEN, agent.token_file, agent.token)",
    )
    g.add_argument("--token", metavar="TOKEN", help="the bearer token itself (visible in 'ps': prefer --token-file)")
    g.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback address with neither --client-ca nor a token (anyone reaching it reads the traces)",
    )
    g.add_argument("--tls-dir", metavar="DIR", help="where the self-signed certificate lives (default ~/.ingero/tls)")
    g.add_argument("--no-tls", action="store_true", help="plain HTTP (loopback only unless --allow-plaintext-remote)")
    g.add_argument(
        "--allow-plaintext-remote",
        action="store_true",
        help="with --no-tls, accept serving unencrypted, unauthenticated-by-TLS traffic on a non-loopback address",
    )


def add_limit_args(g: argparse._ArgumentGroup, *, hidden: bool = False) -> None:
    def helptext(text: str) -> str:
        return argparse.SUPPRESS if hidden else text

    from ingero.agent.api.workers import AdmissionLimits
    from ingero.store import budget

    g.add_argument(
        "--max-rows",
        type=int,
        metavar="N",
        default=budget.MAX_ROWS,
        help=helptext(f"row cap a query may ask for (default and most {budget.MAX_ROWS})"),
    )
    g.add_argument(
        "--max-timeout-ms",
        type=int,
        metavar="MS",
        default=budget.DEFAULT_TIMEOUT_MS,
        help=helptext(
            f"longest a query may run, not counting its wait for a worker "
            f"(default {budget.DEFAULT_TIMEOUT_MS}, at most {budget.MAX_TIMEOUT_MS})"
        ),
    )
    short = AdmissionLimits().short_slots
    g.add_argument(
        "--workers",
        type=int,
        metavar="N",
        default=short,
        help=helptext(f"queries run at once in the short lane (default {short}; the heavy lane gets half)"),
    )


def warn_about_exposure(settings: ServerSettings) -> None:
    """The warnings every command that serves the API prints before listening."""
    from ingero.cli.output import warn
    from ingero.config import is_loopback

    if settings.no_tls:
        warn("serving plain HTTP: queries, answers and the token cross the wire unencrypted")
    elif not is_loopback(settings.host) and not settings.token and not settings.client_ca:
        warn(
            f"--insecure-no-auth: anyone who can reach {settings.host}:{settings.port} can read this node's traces; "
            "add --client-ca (mutual TLS) or --token-file"
        )


def parse_listen(text: str) -> tuple[str, int]:
    """``host:port`` (port 0 = any free port), ``[v6]:port``, ``host``, ``port`` (on the default host).
    Raises UsageError."""
    from ingero.config import parse_addr
    from ingero.errors import UsageError

    t = text.strip()
    if t.isdigit():  # a bare number is a port on the default host
        t = f"{DEFAULT_HOST}:{t}"
    zero = t.endswith(":0")
    try:
        host, port = parse_addr(t[:-2] + ":1" if zero else t)
    except ValueError as e:
        raise UsageError(f"--listen {text}: {e}", hint="use HOST:PORT, e.g. 0.0.0.0:8080 or 127.0.0.1:0") from None
    return host, 0 if zero else port


def token_from(args: argparse.Namespace, configured: str | None, configured_file: str | None = None) -> str | None:
    """The bearer token of ``ingero serve`` / ``trace --listen``: see :func:`bearer_token`; --token and
    --token-file together are an error."""
    from ingero.errors import UsageError

    if args.token_file and args.token is not None:
        raise UsageError("--token and --token-file conflict", hint="keep --token-file (ps does not show it)")
    return bearer_token(args.token_file, args.token, configured, configured_file)


def bearer_token(
    token_file: str | None,
    token_flag: str | None = None,
    configured: str | None = None,
    configured_file: str | None = None,
) -> str | None:
    """The bearer token a server requires: --token-file > --token > $INGERO_TOKEN > agent.token_file >
    agent.token; None when there is none. A token that is given but empty (an empty file, ``--token ""``)
    is an error, never "no auth". --token works but warns: every local user sees it in 'ps'."""
    from ingero.cli.output import warn
    from ingero.errors import UsageError

    if token_file or (token_flag is None and "INGERO_TOKEN" not in os.environ and configured_file):
        flag = "--token-file" if token_file else "agent.token_file"
        path = Path(token_file or configured_file or "").expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else "not readable UTF-8 text"
            raise UsageError(f"{flag} {path}: {reason}") from None
        source, token = f"{flag} {path}", text.strip()
    elif token_flag is not None:
        source, token = "--token", token_flag.strip()
    elif "INGERO_TOKEN" in os.environ:
        source, token = "$INGERO_TOKEN", os.environ["INGERO_TOKEN"].strip()
    elif configured is not None:
        source, token = "agent.token", configured.strip()
    else:
        return None
    if not token:
        raise UsageError(f"{source} is empty", hint="give a non-empty token, or no token setting at all")
    if any(c.isspace() for c in token):
        raise UsageError(f"{source} holds whitespace inside the token", hint="a token is one word")
    if source == "--token":
        warn("--token is visible to every local user in 'ps'; prefer --token-file or $INGERO_TOKEN")
    return token


def served_database(args: argparse.Namespace, db_path: Path) -> tuple[Identity, str]:
    """One read-only open of the recording ``ingero serve`` serves, at start-up: it checks the database,
    gives the node recorded in it (the agent's name when neither --node nor agent.node does) and which
    database it is (the agent's instance id)."""
    from ingero.store.db import open_readonly, recorded_node
    from ingero.store.instance import database_key

    conn = open_readonly(db_path)
    try:
        return common.identity_from(args, recorded=lambda: recorded_node(conn)), database_key(conn, db_path)
    finally:
        conn.close()


def settings_from(args: argparse.Namespace, *, recording: bool = True) -> ServerSettings:
    """``recording``: the database is a recording to serve (its recorded node names the agent when neither
    --node nor agent.node does); ``ingero trace --listen`` serves the database it is writing, as itself."""
    from ingero.agent.api.server import ServerSettings, check_exposure
    from ingero.agent.api.workers import AdmissionLimits
    from ingero.errors import UsageError
    from ingero.store.budget import QueryBudget

    cfg = common.config_from(args).agent
    host, port = parse_listen(args.listen or cfg.listen or DEFAULT_LISTEN)
    token = token_from(args, cfg.token, cfg.token_file)
    cert, key = args.tls_cert or cfg.tls_cert, args.tls_key or cfg.tls_key
    client_ca = args.client_ca or cfg.client_ca
    if args.no_tls and (args.tls_cert or args.tls_key or args.client_ca):
        raise UsageError("--no-tls conflicts with --tls-cert/--tls-key/--client-ca", hint="drop one of them")
    if args.allow_plaintext_remote and not args.no_tls:
        raise UsageError("--allow-plaintext-remote only makes sense with --no-tls")
    if args.insecure_no_auth and (token or client_ca):
        raise UsageError("--insecure-no-auth conflicts with a token or --client-ca", hint="drop one of them")
    try:
        budget = QueryBudget(max_rows=args.max_rows, max_timeout_ms=args.max_timeout_ms)
    except UsageError as e:
        raise UsageError("--" + e.message, hint=e.hint) from None
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    db_path = common.db_path_from(args)
    identity, db_key = served_database(args, db_path) if recording else (common.identity_from(args), None)
    settings = ServerSettings(
        db_path=db_path,
        identity=identity,
        db_key=db_key,
        host=host,
        port=port,
        tls_cert=None if args.no_tls or not cert else Path(cert).expanduser(),
        tls_key=None if args.no_tls or not key else Path(key).expanduser(),
        client_ca=None if args.no_tls or not client_ca else Path(client_ca).expanduser(),
        token=token,
        no_tls=args.no_tls,
        allow_plaintext_remote=args.allow_plaintext_remote,
        insecure_no_auth=args.insecure_no_auth,
        budget=budget,
        admission=AdmissionLimits.for_workers(args.workers),
        tls_dir=Path(args.tls_dir).expanduser() if args.tls_dir else None,
    )
    check_exposure(settings)  # before 'ingero trace' attaches anything
    return settings


def run(args: argparse.Namespace) -> int:
    import logging

    import trio

    from ingero.agent.api.server import preflight
    from ingero.cli.output import note

    settings = settings_from(args)
    setup = preflight(settings)  # makes the self-signed certificate now, so that we can say so
    if setup.created and setup.cert is not None:
        note(f"created a self-signed certificate {setup.cert} (key beside it, mode 0600)")
    warn_about_exposure(settings)
    logging.basicConfig(level=logging.WARNING, format="ingero serve: %(levelname)s: %(name)s: %(message)s")
    ready = Path(args.ready_file).expanduser() if args.ready_file else None
    exporters = metrics_flags.start(args, settings.identity, settings.db_path, "serve")
    for line in exporters.lines if exporters else []:
        note(line)
    try:
        stopped_by = trio.run(_serve, settings, setup, ready)
    finally:
        if exporters is not None:
            exporters.close()
        if ready is not None:
            remove_ready_file(ready)
    return 130 if stopped_by == signal.SIGINT else 0  # Ctrl-C: 130 as for every command; SIGTERM: a clean stop


async def _serve(settings: ServerSettings, setup: TLSSetup, ready: Path | None) -> int:
    """Serve until SIGINT or SIGTERM; returns that signal's number."""
    from functools import partial

    import trio

    from ingero.agent.api.server import serve_api
    from ingero.tools.http import node_tools

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            bound: BoundServer = await nursery.start(
                partial(serve_api, settings, tls_setup=setup, app_wrapper=node_tools(settings))
            )
            if ready is not None:  # before the line on stderr: a reader of either finds both
                write_ready_file(ready, bound, settings.identity.node)
            fp = f" fingerprint=SHA256:{bound.fingerprint_sha256}" if bound.fingerprint_sha256 else ""
            auth = "token" if settings.token else "none"
            print(
                f"ingero serve: listening on {bound.url} node={settings.identity.node} tls={bound.tls_mode} auth={auth}{fp}",
                file=sys.stderr,
                flush=True,
            )
            signum: int = signal.SIGTERM
            async for signum in signals:
                said = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "stopping (SIGTERM)"
                print(f"ingero serve: {said}", file=sys.stderr, flush=True)
                nursery.cancel_scope.cancel()
                break
    return int(signum)


def write_ready_file(path: Path, bound: BoundServer, node: str) -> None:
    write_ready_json(
        path,
        {
            "host": bound.host,
            "port": bound.port,
            "url": bound.url,
            "pid": os.getpid(),
            "tls": bound.tls_mode,
            "fingerprint_sha256": bound.fingerprint_sha256,
            "node": node,
        },
    )


def write_ready_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomically write a ready file (scripts and tests poll for it instead of sleeping)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, path)


def remove_ready_file(path: Path) -> None:
    """Remove the ready file if this process wrote it (never another agent's)."""
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(doc, dict) and doc.get("pid") == os.getpid():
        path.unlink(missing_ok=True)
