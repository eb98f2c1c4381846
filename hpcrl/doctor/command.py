"""``hpcrl doctor``: what this node offers a run, as a table; exit 1 if a required check failed.

    hpcrl doctor [--dir RUN_PARENT] [--require cuda,vllm] [--json OUT.json]
    hpcrl doctor --gloo-rank 0 --gloo-peer nodeB --gloo-port 29555  # on node A (listens, waits for B)
    hpcrl doctor --gloo-rank 1 --gloo-peer nodeA --gloo-port 29555  # on node B

Always required: gloo (loopback, or the pair between two nodes), ``/dev/shm`` with ``--shm-min-gib`` free, and
a durable write+fsync+rename in ``--dir``. ``cuda`` and each engine's package (``vllm``: the registry's
``EngineSpec.package``) are checked and reported, required only when named in ``--require`` (a CPU node reports them as failed and still passes). ``hostname`` only warns.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcrl.config.registries import ENGINES
from hpcrl.doctor.checks import FAIL, OK, SKIP, Check, check_cuda, check_filesystem, check_gloo, check_hostname, \
    check_package, check_shm

PACKAGES = tuple(dict.fromkeys(s.package for s in ENGINES.values() if s.package))
"""The packages the engines of the registry need beyond hpcrl's own (``EngineSpec.package``: vllm)."""
OPTIONAL = ("cuda", *PACKAGES)
"""Checks that are required only when ``--require`` names them."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=".", help="folder on the shared filesystem to time write+fsync+rename in "
                                              "(the run directory's parent; default: here)")
    p.add_argument("--require", default="", help=f"comma-separated, of {', '.join(OPTIONAL)}: fail without them "
                                                       "(default: none required)")
    p.add_argument("--skip", default="", help="comma-separated checks not to run (e.g. vllm: its import is slow; "
                                                    "default: run all)")
    p.add_argument("--shm-min-gib", type=float, default=1.0, help="free /dev/shm wanted in GiB (one weight version; "
                                                                       "default 1)")
    p.add_argument("--gloo-peer", default=None, help="the other node of a gloo pair across two nodes (run the "
                                                     "doctor on both, each naming the other)")
    p.add_argument("--gloo-rank", type=int, default=0, help="this node's rank in the pair (0 listens; default 0)")
    p.add_argument("--gloo-port", type=int, default=0, help="rank 0's port (0, the default: any free port, "
                                                                  "loopback only)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="deadline of the gloo pair and of each wait, in "
                                                                         "seconds (default 60)")
    p.add_argument("--json", default=None, help="also write the checks and their figures to this file")


def _check_args(a: argparse.Namespace) -> list[str]:
    """One line per bad argument."""
    bad = [f"--require {n!r}: allowed {', '.join(OPTIONAL)}" for n in _names(a.require) if n not in OPTIONAL]
    if a.gloo_rank not in (0, 1):
        bad.append(f"--gloo-rank {a.gloo_rank}: allowed 0 (listens) or 1 (connects to --gloo-peer)")
    if a.gloo_rank == 1 and not a.gloo_peer:
        bad.append("--gloo-rank 1 needs --gloo-peer HOST (the other node, rank 0)")
    if a.gloo_peer and not a.gloo_port:
        bad.append("--gloo-peer needs --gloo-port (the same on both nodes)")
    return bad


def _names(csv: str) -> list[str]:
    return [n.strip() for n in csv.split(",") if n.strip()]


def run_checks(a: argparse.Namespace) -> list[Check]:
    """Every check, in the table's order (a skipped one as a ``skip`` row)."""
    from hpcrl.process.network import free_port

    required, skipped = set(_names(a.require)), set(_names(a.skip))
    peer = a.gloo_peer if a.gloo_peer else None
    port = a.gloo_port or free_port()
    makers = {"hostname": check_hostname, "cuda": check_cuda,
              **{pkg: (lambda pkg=pkg: check_package(pkg, max(a.timeout_s, 180.0))) for pkg in PACKAGES},
              "gloo": lambda: check_gloo(peer, a.gloo_rank, port, a.timeout_s),
              "shm": lambda: check_shm(a.shm_min_gib), "filesystem": lambda: check_filesystem(Path(a.dir).resolve())}
    out = []
    for name, make in makers.items():
        c = Check(name, SKIP, "--skip") if name in skipped else make()
        c.required = c.required or name in required
        out.append(c)
    return out


def table(checks: list[Check]) -> str:
    """The checks as an aligned text table."""
    rows = [("check", "status", "required", "detail")] + [
        (c.name, c.status, "yes" if c.required else "no", c.detail) for c in checks]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows)


def doctor_command(a: argparse.Namespace) -> int:
    bad = _check_args(a)
    if bad:
        for line in bad:
            print(f"hpcrl doctor: error: {line}", file=sys.stderr)
        return 2
    checks = run_checks(a)
    print(table(checks))
    failed = [c.name for c in checks if c.required and c.status == FAIL]
    print(f"required checks failed: {', '.join(failed)}" if failed else
          f"all required checks passed ({sum(c.status == OK for c in checks)} of {len(checks)} ok)")
    if a.json:
        Path(a.json).write_text(json.dumps({"ok": not failed, "checks": [c.__dict__ for c in checks]}, indent=1) + "\n")
    return 1 if failed else 0
