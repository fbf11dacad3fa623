"""``ingero cert``: a fleet CA, node (server) and client certificates for mutual TLS, in a few commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ingero.cli import common

if TYPE_CHECKING:
    from ingero.tls.pki import IssuedFiles

DEFAULT_DIR = "~/.ingero/pki"

EXAMPLES = """\
examples:
  ingero cert ca                                              fleet CA in ~/.ingero/pki (ca.pem, ca-key.pem)
  ingero cert node gpu-node-01 --san gpu-node-01.cluster --san 10.0.0.11
  ingero cert node local-a --san 127.0.0.1,localhost          a node reached on loopback (demo, tests)
  ingero cert client laptop                                   client certificate for the fleet commands
  ingero cert show ~/.ingero/pki/node-gpu-node-01.pem          subject, SANs, validity, SHA-256 fingerprint
  ingero cert ca --out ./pki --force --json                   replace a CA, machine-readable report

a three-node mTLS fleet on one machine (what the README demo does):
  ingero cert ca --out pki
  for n in a b c; do ingero cert node $n --san 127.0.0.1,localhost --ca-dir pki; done
  ingero cert client me --ca-dir pki
  ingero serve --db a.db --node a --listen 127.0.0.1:8441 --tls-cert pki/node-a.pem --tls-key pki/node-a-key.pem --client-ca pki/ca.pem
  ingero query --nodes 127.0.0.1:8441,127.0.0.1:8442,127.0.0.1:8443 --ca-cert pki/ca.pem \\
      --client-cert pki/client-me.pem --client-key pki/client-me-key.pem "SELECT count(*) AS n FROM events"

Keys are ECDSA P-256, written with mode 0600; existing files are never overwritten without --force.
Node certificates default to one SAN, the node name; give every name and address clients use (--san,
repeatable or comma-separated; DNS:name and IP:addr prefixes are optional).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cert",
        parents=parents,
        help="create a fleet CA and node/client certificates for mutual TLS",
        description="Certificates for the agent API: a fleet CA, node (server) certificates with the "
        "names and addresses clients dial, and client certificates for mutual TLS.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    cmds = p.add_subparsers(dest="cert_command", metavar="ACTION", required=True)

    ca = cmds.add_parser(
        "ca", parents=parents, help="create a fleet CA", epilog=EXAMPLES, formatter_class=common.help_formatter()
    )
    ca.add_argument(
        "-o",
        "--out",
        metavar="DIR",
        default=DEFAULT_DIR,
        help=f"directory for ca.pem and ca-key.pem (default {DEFAULT_DIR})",
    )
    ca.add_argument("--name", default="ingero fleet CA", help="the CA's common name")
    ca.add_argument("--days", type=int, default=3650, help="validity in days (default 3650)")
    _common_flags(ca)

    for kind, what in (("node", "a node (server) certificate"), ("client", "a client certificate")):
        c = cmds.add_parser(
            kind, parents=parents, help=f"issue {what}", epilog=EXAMPLES, formatter_class=common.help_formatter()
        )
        c.add_argument("name", help="node name (e.g. gpu-node-01)" if kind == "node" else "client name (e.g. laptop)")
        if kind == "node":
            c.add_argument(
                "--san",
                action="append",
                default=[],
                metavar="NAME|IP",
                help="a DNS name or IP address clients use to reach the node; repeatable, comma-separated "
                "(default: the node name)",
            )
        c.add_argument(
            "--ca-dir", metavar="DIR", default=DEFAULT_DIR, help=f"the CA's directory (default {DEFAULT_DIR})"
        )
        c.add_argument("-o", "--out", metavar="DIR", help="where to write the certificate and key (default: --ca-dir)")
        c.add_argument("--days", type=int, default=825, help="validity in days (default 825)")
        _common_flags(c)

    show = cmds.add_parser(
        "show", parents=parents, help="describe a certificate", epilog=EXAMPLES, formatter_class=common.help_formatter()
    )
    show.add_argument("pem", help="certificate file (PEM or DER)")
    show.add_argument(
        "--json", dest="format", action="store_const", const="json", default="table", help="JSON for machines"
    )
    p.set_defaults(func=run)


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument(
        "--json", dest="format", action="store_const", const="json", default="table", help="JSON for machines"
    )


def run(args: argparse.Namespace) -> int:
    from ingero.errors import UsageError
    from ingero.tls import pki

    action = args.cert_command
    if action == "show":
        _show(Path(args.pem).expanduser(), args.format)
        return 0
    if args.days < 1:
        raise UsageError(f"--days must be at least 1, got {args.days}")
    if action == "ca":
        issued = pki.create_ca(Path(args.out).expanduser(), args.name, days=args.days, force=args.force)
        _report(
            "created fleet CA", issued, args.format, next_step=f"ingero cert node NAME --san ADDR --ca-dir {args.out}"
        )
        return 0
    ca_dir = Path(args.ca_dir).expanduser()
    out = Path(args.out).expanduser() if args.out else None
    sans = pki.split_sans(getattr(args, "san", []))
    issued = pki.issue_cert(ca_dir, action, args.name, sans, out_dir=out, days=args.days, force=args.force)
    if action == "node":
        step = f"ingero serve --tls-cert {issued.cert} --tls-key {issued.key} --client-ca {ca_dir / pki.CA_CERT} ..."
    else:
        step = f"ingero query --ca-cert {ca_dir / pki.CA_CERT} --client-cert {issued.cert} --client-key {issued.key} --nodes ..."
    _report(f"issued {action} certificate for {args.name}", issued, args.format, next_step=step)
    return 0


def _report(title: str, issued: IssuedFiles, fmt: str, *, next_step: str) -> None:
    from ingero.cli.output import emit_json

    if fmt == "json":
        emit_json(issued.as_dict())
        return
    lines = [
        title,
        f"  certificate  {issued.cert}",
        f"  key          {issued.key} (mode 0600)",
        f"  subject      {issued.subject}",
    ]
    if issued.sans:
        lines.append(f"  SANs         {', '.join(issued.sans)}")
    lines += [f"  expires      {issued.not_after}", f"  SHA-256      {issued.fingerprint_sha256}", f"next: {next_step}"]
    print("\n".join(lines))


def _show(path: Path, fmt: str) -> None:
    from ingero.cli.output import emit_json
    from ingero.tls import pki

    doc: dict[str, Any] = {"path": str(path), **pki.describe(pki.load_cert(path))}
    if fmt == "json":
        emit_json(doc)
        return
    width = max(len(k) for k in doc)
    for k, v in doc.items():
        shown = ", ".join(v) if isinstance(v, list) else v
        print(f"{k:<{width}}  {shown}")
