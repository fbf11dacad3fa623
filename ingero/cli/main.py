"""``ingero`` command line: the parser and the one place where errors become exit codes.

Each subcommand lives in its own module under ``ingero/cli/`` and exposes
``register(subparsers, parents)``; the module imports only argparse-level things at the top and does
heavy imports (trio, httpx, bcc, numpy) inside its handler, so ``ingero --help`` stays fast.
Handlers take the parsed ``argparse.Namespace`` and return an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from ingero import __version__
from ingero.errors import IngeroError

COMMAND_MODULES = [
    "ingero.cli.query",
    "ingero.cli.explain",
    "ingero.cli.demo",
    "ingero.cli.investigations",
    "ingero.cli.trace",
    "ingero.cli.check",
    "ingero.cli.serve",
    "ingero.cli.cert",
    "ingero.cli.fleet",
    "ingero.cli.merge",
    "ingero.cli.export",
    "ingero.cli.mcp",
]

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


def common_parent() -> argparse.ArgumentParser:
    """Options every subcommand accepts (also accepted before the subcommand)."""
    p = argparse.ArgumentParser(add_help=False)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ingero",
        description="GPU causal observability: trace CUDA/NCCL and host events on every node, "
        "query and explain the whole fleet from one place.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ingero {__version__}")
    parser.add_argument("--config", metavar="PATH", default=None, help="config file")
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parents = [common_parent()]
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, parents)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("INGERO_DEBUG") == "1"
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
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
    except BaseExceptionGroup as group:  # trio may deliver Ctrl-C inside a nursery's group
        if group.split(KeyboardInterrupt)[1] is None:
            print("ingero: interrupted (Ctrl-C)", file=sys.stderr)
            return 130
        return _internal_error(group, debug)
    except BrokenPipeError:
        # stdout closed early (| head): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as e:
        return _internal_error(e, debug)


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
