"""``ingero version`` (and ``ingero --version``): what this build is and what it can do here."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

SUMMARY = "version, Python, platform, bcc, schema and API versions (--json for scripts)"

EXAMPLES = """\
examples:
  ingero version                   ingero 0.1.0, Python, platform, bcc available or not, schema/API versions
  ingero version --json            {"version", "python", "platform", "bcc", "bcc_detail", "schema_version", "api_version"}
  ingero --version                 the same as 'ingero version'
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    from ingero.cli import common  # here, not at the top: ingero.cli.main imports this module for --version

    p = sub.add_parser(
        "version",
        parents=parents,
        help=SUMMARY,
        description="Print the build details a bug report needs: ingero's version, the Python running it, the "
        "platform, whether bcc can be imported (tracing), the database schema version this build writes and "
        "the agent API version it speaks.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)


def details() -> dict[str, Any]:
    """The build details, one key each (the --json document)."""
    import platform

    from ingero import API_VERSION, __version__
    from ingero.agent.trace.probes import bcc_status
    from ingero.store.schema import SCHEMA_VERSION

    bcc_ok, bcc_detail = bcc_status()
    return {
        "version": __version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "bcc": bcc_ok,
        "bcc_detail": bcc_detail,
        "schema_version": SCHEMA_VERSION,
        "api_version": API_VERSION,
    }


def render(d: dict[str, Any]) -> str:
    bcc = f"available ({d['bcc_detail']})" if d["bcc"] else f"not available ({d['bcc_detail']})"
    return (
        f"ingero {d['version']}\n"
        f"python:   {d['python_implementation']} {d['python']}\n"
        f"platform: {d['platform']} ({d['machine']})\n"
        f"bcc:      {bcc}\n"
        f"schema:   {d['schema_version']}\n"
        f"api:      v{d['api_version']}\n"
    )


def run(args: argparse.Namespace) -> int:
    d = details()
    sys.stdout.write(json.dumps(d) + "\n" if args.json else render(d))
    return 0


class VersionAction(argparse.Action):
    """``ingero --version``: the same text as ``ingero version``, then exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        sys.stdout.write(render(details()))
        parser.exit(0)
