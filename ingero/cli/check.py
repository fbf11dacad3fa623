"""``ingero check``: what this machine needs for ``ingero trace``, each missing piece with its fix."""

from __future__ import annotations

import argparse
import sys

from ingero.cli import common

EXAMPLES = """\
examples:
  ingero check                     kernel, BTF, headers, tracefs, uprobes, bcc, privileges, GPU libraries
  sudo ingero check --compile      also compile and load the BPF programs (the end-to-end proof)
  ingero check --json              {"ready": true|false, "checks": [{"name", "ok", "required", "detail", "fix"}]}
  ingero check --cuda-lib /opt/app/lib/libcudart.so.12   check with the library you will pass to trace

Exit status: 0 when every required check passes (tracing will work), 1 otherwise. The GPU library
and driver checks are informational: without them ingero still records host events.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        parents=parents,
        help="can this machine trace? every missing piece with its fix",
        description="Check the kernel (version, BTF, headers for bcc, tracefs, uprobes), bcc, privileges, "
        "the CUDA runtime / driver / NCCL libraries and the GPU driver, printing the fix for each failure.",
        epilog=EXAMPLES,
        formatter_class=common.help_formatter(),
    )
    p.add_argument("--json", action="store_true", help="JSON for machines")
    p.add_argument("--compile", action="store_true", help="also compile and load the BPF programs (root, ~2 s)")
    p.add_argument("--cuda-lib", action="append", default=[], metavar="PATH", help="a libcudart.so to check")
    p.add_argument("--driver-lib", action="append", default=[], metavar="PATH", help="a libcuda.so to check")
    p.add_argument("--nccl-lib", action="append", default=[], metavar="PATH", help="a libnccl.so to check")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from ingero.agent.trace.check import compile_check, ready, run_checks

    overrides = {"cudart": args.cuda_lib, "cuda": args.driver_lib, "nccl": args.nccl_lib}
    results = run_checks(overrides)
    if args.compile:
        results.append(compile_check())
    ok = ready(results)
    if args.json:
        json.dump({"ready": ok, "checks": [r.as_dict() for r in results]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if ok else 1
    width = max(len(r.name) for r in results)
    print("ingero check: can this machine trace?")
    for r in results:
        mark = "✓" if r.ok else "✗"
        optional = "" if r.required or r.ok else " (optional)"
        print(f"  {mark} {r.name:<{width}}  {r.detail}{optional}")
        if not r.ok and r.fix:
            print(f"      fix: {r.fix}")
    failed = [r.name for r in results if r.required and not r.ok]
    if ok:
        print("ready: 'sudo ingero trace' will work" if not args.compile else "ready: tracing works here")
    else:
        print(f"not ready: {', '.join(failed)} failed")
    return 0 if ok else 1
