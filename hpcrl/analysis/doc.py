"""A tiny document builder that renders the same report as Markdown and as HTML.

Markdown reads well in a terminal, on GitHub and in editors; the HTML file opens
in any browser with the PNGs next to it (no server, no JavaScript). Numbers are
written plainly (no thousands separators) so the tables can be read back by
tools and tests: integers as integers, percentages with 1 decimal, other floats
with 3; NaN as ``n/a``.
"""
from __future__ import annotations

import html
import math
import numbers
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd


def fmt(value, column: str = "") -> str:
    """A table cell rounded to what it means: integers as integers, ``%`` columns with 1 decimal,
    other reals to 3 significant digits (at most 4 decimals; whole numbers from 100 on):
    ``1934`` tokens/s, ``12.3`` s, ``0.812`` idle, ``0.0123`` lag."""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if value is None or value is pd.NA or (isinstance(value, numbers.Real) and math.isnan(value)):
        return "n/a"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        x = float(value)
        if column.startswith("%"):
            return f"{x:.1f}"
        if math.isinf(x) or abs(x) >= 100 or x == 0:
            return f"{x:.0f}"
        return f"{x:.{min(4, max(0, 2 - math.floor(math.log10(abs(x)))))}f}"
    return str(value)


def _inline_html(text: str) -> str:
    """Escape, then render `code` and **bold** (the only inline markup the report uses)."""
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


@dataclass
class Doc:
    """A report being written: Markdown and HTML built side by side, section by section."""

    title: str
    blocks: list[tuple] = field(default_factory=list)

    def heading(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def para(self, text: str) -> None:
        self.blocks.append(("p", text))

    def bullets(self, items: list[str]) -> None:
        if items:
            self.blocks.append(("ul", list(items)))

    def table(self, df: pd.DataFrame) -> None:
        header = [str(c) for c in df.columns]
        rows = [[fmt(v, c) for c, v in zip(header, row)] for row in df.itertuples(index=False)]
        self.blocks.append(("table", header, rows))

    def image(self, rel_path: str, alt: str) -> None:
        self.blocks.append(("img", rel_path, alt))

    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for b in self.blocks:
            if b[0] == "h":
                out += [f"{'#' * b[1]} {b[2]}", ""]
            elif b[0] == "p":
                out += [b[1], ""]
            elif b[0] == "ul":
                out += [f"- {item}" for item in b[1]] + [""]
            elif b[0] == "table":
                header, rows = b[1], b[2]
                out.append("| " + " | ".join(h.replace("|", "/") for h in header) + " |")
                out.append("|" + "|".join("---" for _ in header) + "|")
                out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
                out.append("")
            elif b[0] == "img":
                out += [f"![{b[2]}]({b[1]})", ""]
        return "\n".join(out)

    def html(self) -> str:
        body = [f"<h1>{_inline_html(self.title)}</h1>"]
        for b in self.blocks:
            if b[0] == "h":
                body.append(f"<h{b[1]}>{_inline_html(b[2])}</h{b[1]}>")
            elif b[0] == "p":
                body.append(f"<p>{_inline_html(b[1])}</p>")
            elif b[0] == "ul":
                body.append("<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in b[1]) + "</ul>")
            elif b[0] == "table":
                head = "".join(f"<th>{html.escape(h)}</th>" for h in b[1])
                rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in b[2])
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
            elif b[0] == "img":
                body.append(f'<p><img src="{html.escape(b[1])}" alt="{html.escape(b[2])}"></p>')
        style = ("body{font-family:sans-serif;max-width:1250px;margin:2em auto;line-height:1.4}"
                 "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:3px 8px;"
                 "text-align:right}th{background:#eee}td:first-child{text-align:left}img{max-width:100%}"
                 "code{background:#f3f3f3;padding:0 3px}")
        return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(self.title)}</title>"
                f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
