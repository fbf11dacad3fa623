"""``ingero`` command line: the parser and the one place where errors become exit codes.

Each subcommand lives in its own module under ``ingero/cli/`` and exposes
``register(subparsers, parents)``; the module imports only argparse-level things at the top and does
heavy imports (trio, httpx, bcc, numpy) inside its handler, so ``ingero --help`` stays fast.
Handlers take the parsed ``argparse.Namespace`` and return an exit code.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ingero.cli.version import VersionAction
from ingero.errors import IngeroError, UsageError

# Every command: its module (which registers it) and its one line for ``ingero --help``. The summary
# is what the module registers as its ``help=``; tests/test_cli_help.py checks that the two agree, so
# that ``ingero --help`` and ``ingero COMMAND`` can build the parser without importing every module.
COMMANDS: dict[str, tuple[str, str]] = {
    "query": ("ingero.cli.query", "run read-only SQL on a trace database or on every node"),
    "explain": ("ingero.cli.explain", "per-op latency statistics and causal chains (root cause + fix)"),
    "demo": ("ingero.cli.demo", "synthetic GPU incidents: write a real trace database and explain it"),
    "investigations": (
        "ingero.cli.investigations",
        "regenerate the investigations/ sample databases (3-node cluster, one straggler)",
    ),
    "trace": ("ingero.cli.trace", "record CUDA/NCCL calls and host events with eBPF (root)"),
    "check": ("ingero.cli.check", "can this machine trace? every missing piece with its fix"),
    "serve": ("ingero.cli.serve", "serve the agent API (TLS 1.3 / mTLS) over a trace database"),
    "cert": ("ingero.cli.cert", "create a fleet CA and node/client certificates for mutual TLS"),
    "fleet": ("ingero.cli.fleet", "fleet overview: reachability, versions, clock skew of every node"),
    "merge": ("ingero.cli.merge", "merge node databases into one cluster database (offline analysis)"),
    "export": ("ingero.cli.export", "export a timeline for Perfetto (Chrome Trace Event JSON)"),
    "mcp": ("ingero.cli.mcp", "MCP server (stdio or HTTPS) so an AI assistant can query traces and the fleet"),
    "dashboard": ("ingero.cli.dashboard", "HTTPS browser dashboard for one database or the fleet"),
    "version": ("ingero.cli.version", "version, Python, platform, bcc, schema and API versions (--json for scripts)"),
    "completion": ("ingero.cli.completion", "print a shell completion script (bash), generated from the parser"),
    "clickhouse-schema": (
        "ingero.cli.clickhouse",
        "the ClickHouse DDL of the fleet's history (sharded by node); --apply runs it on each server",
    ),
    "ship": ("ingero.cli.ship", "ship a recording's new rows to ClickHouse (resumable; --follow keeps shipping)"),
    "annotate": (
        "ingero.cli.annotate",
        "label a live recording (step, epoch, task) or mark a moment (a deploy) in the database",
    ),
}
COMMAND_MODULES = [module for module, _ in COMMANDS.values()]
# commands that run until stopped: they keep the C heap's defaults (memory freed goes back), or the agent's
# own policy (ingero.explain.memory_policy.long_lived, from its API server); the others are one-shot
KEEPS_RUNNING = frozenset({"trace", "serve", "mcp", "dashboard", "ship"})

EPILOG = """\
examples:
  ingero demo incident                       synthetic incident → HIGH causal chain
  ingero query --db trace.db "SELECT node, source, count(*) AS cnt FROM events GROUP BY node, source"
  ingero explain --db trace.db --since 5m    causal chains for the last five minutes
  sudo ingero trace --db trace.db --listen 0.0.0.0:8080   record and serve the agent API
  ingero query --nodes gpu-node-01:8080,gpu-node-02:8080 "SELECT count(*) FROM events"
  ingero explain --nodes gpu-node-01:8080,gpu-node-02:8080   fleet diagnosis + straggler verdict
  ingero fleet status                        reachability, skew, versions of every node

Run 'ingero COMMAND --help' for a command's options and examples.
"""


class Parser(argparse.ArgumentParser):
    """Every ingero parser: no prefix abbreviations (``--dur`` is not ``--duration``), so that a new
    option never changes what an old command line means. Subparsers inherit the class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def common_parent() -> argparse.ArgumentParser:
    """Options every subcommand accepts (also accepted before the subcommand)."""
    p = Parser(add_help=False)
    g = p.add_argument_group("global options")
    g.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="config file (default: $INGERO_CONFIG, ./ingero.yaml, ~/.config/ingero/ingero.yaml, "
        "/etc/ingero/ingero.yaml)",
    )
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    return p


def build_parser(command: str | None = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The whole parser; with ``lazy``, only ``command``'s module is imported and registered (the
    others are listed by their one-line summary), which keeps start-up to what that command needs."""
    parser = Parser(
        prog="ingero",
        description="GPU causal observability: trace CUDA/NCCL and host events on every node, "
        "query and explain the whole fleet from one place.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=VersionAction, help="show build details (as 'ingero version') and exit")
    parser.add_argument("--config", metavar="PATH", default=None, help="config file")
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    parents = [common_parent()]
    for name, (module, summary) in COMMANDS.items():
        if lazy and name != command:
            sub.add_parser(name, help=summary, add_help=False)
        else:
            importlib.import_module(module).register(sub, parents)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not a global option), if any."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--config":
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _unknown_command(word: str) -> UsageError:
    close = difflib.get_close_matches(word, COMMANDS, n=1)
    hint = f"did you mean '{close[0]}'?" if close else "run 'ingero --help' for the list of commands"
    return UsageError(f"unknown command '{word}'", hint=hint)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_of(argv)
    if command is not None and command not in COMMANDS:
        print(f"ingero: error: {_unknown_command(command).one_line()}", file=sys.stderr)
        return 2
    parser = build_parser(command, lazy=True)
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("INGERO_DEBUG") == "1"
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from ingero.explain import memory_policy  # process-wide choices: the C heap keeps freed memory
    from ingero.explain.hugepages import prefer_small_pages  # numpy's large arrays: no huge-page hint

    prefer_small_pages()
    if command not in KEEPS_RUNNING:
        memory_policy.one_shot()  # its memory goes back at exit
    try:
        code = args.func(args)
        sys.stdout.flush()
        return int(code or 0)
    except IngeroError as e:
        if debug:
            traceback.print_exc()
        print(f"ingero: error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ingero: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BaseExceptionGroup as group:  # trio may deliver Ctrl-C (or an IngeroError) inside a nursery's group
        if group.split(KeyboardInterrupt)[1] is None:
            print("ingero: interrupted (Ctrl-C)", file=sys.stderr)
            return 130
        ours, rest = group.split(IngeroError)
        if ours is not None and rest is None:
            first = _first_leaf(ours)
            if debug:
                traceback.print_exception(group)
            print(f"ingero: error: {first.one_line()}", file=sys.stderr)
            return first.exit_code
        return _internal_error(group, debug)
    except BrokenPipeError:
        # stdout closed early (| head): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as e:
        return _internal_error(e, debug)


def _first_leaf(group: BaseExceptionGroup[IngeroError]) -> IngeroError:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _internal_error(e: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(e)
    print(
        f"ingero: internal error: {type(e).__name__}: {' '.join(str(e).split())} (rerun with --debug for the traceback)",
        file=sys.stderr,
    )
    return 70


if __name__ == "__main__":
    raise SystemExit(main())
