"""Helpers shared by the benchmarks (command line, table printing)."""
from __future__ import annotations

import argparse


def bench_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The options every benchmark has: ``--quick`` and ``--dir`` (where its temporary runs go)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--dir", default=None, help="parent folder for the temporary run dirs "
                   "(default: a tempdir under $TMPDIR or /tmp); put it on the disk you want to measure")
    return p


def table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned plain-text table with a dashed rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])
