"""Helpers shared by the benchmarks (table printing)."""
from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned plain-text table with a dashed rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])
