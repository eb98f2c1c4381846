"""The optimisation's own curves: loss, KL, entropy, gradient norm, clip fraction, response length.

All from ``logs/metrics.jsonl`` (one row per local update, the trainer's names); a curve whose
metric the run did not log (e.g. no KL term) says so in place instead of vanishing.
"""
from __future__ import annotations

from pathlib import Path

from hpcrl.analysis.load import RunData
from hpcrl.analysis.plots import COLORS, empty_note, label, new_figure, rolling, save

PANELS = [
    ("actor/pg_loss", "policy loss (actor/pg_loss)"),
    (("actor/ppo_kl", "actor/kl_loss"), "KL: to the anchor (actor/ppo_kl), to the reference (actor/kl_loss)"),
    ("actor/entropy", "entropy per token, nats (actor/entropy)"),
    ("actor/grad_norm", "gradient norm before clipping (actor/grad_norm)"),
    ("actor/pg_clipfrac", "share of tokens clipped (actor/pg_clipfrac)"),
    ("response_length/mean", "mean response length, tokens (response_length/mean)"),
]
"""(metric or metrics, panel title) of the 2 x 3 grid."""


def training(data: RunData, out: Path) -> Path:
    """The 2 x 3 grid of :data:`PANELS` against the trainer update, raw and rolling mean."""
    fig, ax = new_figure(14, 7, ncols=3, nrows=2)
    m = data.metrics
    styles = [COLORS["trainer"], COLORS["rollout"]]
    for i, (cols, title) in enumerate(PANELS):
        a = ax[i // 3, i % 3]
        cols = (cols,) if isinstance(cols, str) else cols
        present = [c for c in cols if not m.empty and c in m.columns and m[c].notna().any()]
        for c, colour in zip(present, styles):
            a.plot(m["step"], m[c], color=colour, lw=0.6, alpha=0.35)
            a.plot(m["step"], rolling(m[c]), color=colour, lw=2, label=c)
        if not present:
            empty_note(a, "not in this run's metrics" if not m.empty else "no metrics logged yet")
        elif len(present) > 1:
            a.legend(loc="best", fontsize=8)
        a.set_title(title, fontsize=9)
        a.set_xlabel("trainer update (step)")
    fig.suptitle(f"Training curves (thin: per update, thick: rolling mean) - {label(data)}")
    return save(fig, out)


PLOTS = {"training.png": training}
"""This module's plots, by file name (the report adds them to :data:`hpcrl.analysis.plots.PLOTS`)."""
