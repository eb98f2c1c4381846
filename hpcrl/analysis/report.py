"""``hpcrl report RUN_DIR [RUN_DIR ...] --out DIR``: the offline staleness report.

Writes ``DIR/report.md`` and ``DIR/report.html`` (same content) with tables and
PNG plots (``DIR/<run>/*.png`` per run, ``DIR/compare_*.png`` for several runs),
reading nothing but the run directories (see :mod:`hpcrl.analysis.load`).

It opens with four plain lines per run (``glance.py``: is it learning, how stale, which job waits, what to change).
Sections per run: recommendation, notes, summary, problems (reward errors, tool errors, prompts
filtered, with the first message and sample id), lag (groups and tokens, over
time), partial spans, idle ratios per version, timeline of generation / training
/ weight sync, group life times, the rollout fleet over time (each writer's lives, groups/s per writer, what
changed the fleet), throughput and queue, reward, held-out validation
(``logs/eval.jsonl``), samples dropped.
Several runs add the side-by-side (ablation) table and overlaid curves.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.analysis import compare, fleet, plots, reward_model, tables, training_plots, validation
from hpcrl.analysis.ceiling import run_ceiling, speedup_line
from hpcrl.analysis.doc import Doc
from hpcrl.analysis.glance import glance
from hpcrl.analysis.load import LOG_PATHS, RunData, load_run
from hpcrl.analysis.problems import problems_of, problems_table
from hpcrl.analysis.recommend import recommend_run
from hpcrl.rundir.paths import RunDir
from hpcrl.logs import metric_names as M

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What ``hpcrl report`` wrote: the runs, the files, and the plots that failed."""

    markdown: Path
    html: Path
    runs: list[RunData]
    plots: list[Path] = field(default_factory=list)
    failed_plots: list[str] = field(default_factory=list)
    """Plots or sections that could not be drawn, with the error (the report says so where they belong)."""


def _unique_names(paths: list[Path]) -> list[str]:
    names: list[str] = []
    for p in paths:
        base = Path(p).resolve().name or "run"
        name, i = base, 2
        while name in names:
            name, i = f"{base}-{i}", i + 1
        names.append(name)
    return names


def _plot(doc: Doc, rep: Report, draw, out: Path, rel: str, alt: str, *args) -> None:
    try:
        rep.plots.append(draw(*args, out))
        doc.image(rel, alt)
    except Exception as e:  # one bad plot must not cost the user the rest of the report
        log.exception("plot %s failed", out)
        rep.failed_plots.append(f"{out}: {e!r}")
        doc.para(f"(plot `{out.name}` could not be drawn: {e!r})")


ALL_PLOTS = {**plots.PLOTS, **training_plots.PLOTS, "validation.png": validation.validation,
             "fleet.png": fleet.fleet_plot}
"""Every per-run plot, by file name."""


class _Section:
    """Context for one run's sections: where its plots go and how they are linked."""

    def __init__(self, doc: Doc, rep: Report, d: RunData, out_dir: Path):
        self.doc, self.rep, self.d, self.out_dir = doc, rep, d, out_dir

    def img(self, name: str, alt: str) -> None:
        _plot(self.doc, self.rep, ALL_PLOTS[name], self.out_dir / self.d.name / name, f"{self.d.name}/{name}", alt,
              self.d)


def _lag(x: _Section) -> None:
    d, doc = x.d, x.doc
    why = d.unavailable("Lag", staleness=["group_id", "lag", "n_tokens", "sample_id", "trainer_step"])
    if why:
        return doc.para(why)
    doc.table(tables.lag_table(d))
    doc.para("Lag = trainer version when it took the group - version that generated its oldest token. Groups by "
             "their largest trajectory lag, tokens by their trajectory's lag."
             + (_bound_sentence(d.knobs) if d.knobs else ""))
    x.img("lag_distribution.png", "lag distribution")
    x.img("lag_over_time.png", "lag over time")


def _bound_sentence(knobs) -> str:
    if knobs.partial_rollout:
        return (f" With partial rollout the admission budget bounds the lag of a group's newest token by "
                f"{knobs.max_lag_bound} (one writer); its oldest token adds the group's span (below).")
    return f" The admission budget bounds it by {knobs.max_lag_bound} (one writer)."


def _partial(x: _Section) -> None:
    d, doc = x.d, x.doc
    why = d.unavailable("Partial spans", staleness=["version_start", "version_end", "n_tokens"])
    if why:
        return doc.para(why)
    pt = tables.partial_table(d)
    if len(pt) and (pt["span (versions)"] == 0).all():
        doc.para(f"None: all {int(pt['trajectories'].sum())} trained trajectories were generated under one "
                 "weight version (version_end = version_start; partial rollout is off or not implemented).")
    else:
        doc.table(pt)
    x.img("partial_spans.png", "partial rollout spans")


def _idle(x: _Section) -> None:
    d, doc = x.d, x.doc
    why = d.unavailable("Idle ratios", partial=True, metrics=tables.STEP_PARTS + ["param_version"],
                        rollout=["wall_s", M.ROLLOUT_IDLE_RATIO, "param_version"])
    if why:
        doc.para(why)
    doc.table(tables.version_table(d))
    doc.para("Per range of weight versions: trainer idle = share of its time waiting for samples while it held those "
             "versions; rollout idle = share of time with no group in flight while generating with them (both "
             "time-weighted); lag of the groups the trainer took then; mean reward of the trajectories they generated.")
    x.img("idle_ratios.png", "idle ratios per version")


def _timeline(x: _Section) -> None:
    d, doc = x.d, x.doc
    why = d.unavailable("Timeline", partial=True, metrics=tables.STEP_PARTS + ["time_s"],
                        staleness=["created_s", "finished_s", "committed_s", "consumed_s"])
    if why:
        doc.para(why)
    doc.table(tables.timing_table(d))
    doc.table(tables.group_life_table(d))
    doc.para("Group life: `created_s`, `finished_s`, `committed_s` from the staleness log; taken = end of the "
             "update's wait (metrics `time_s` - `timing_s/param_sync` - `timing_s/update`); `consumed_s` is stamped "
             "after the update and its weight publish.")
    x.img("timeline.png", "timeline")


def _fleet(x: _Section) -> None:
    h = fleet.fleet_history(RunDir(x.d.root))
    if not h.lives:
        return x.doc.para("No rollout writer has joined or committed yet.")
    if not h.changed:
        life = h.lives[0]
        return x.doc.para(f"One rollout writer ({life.writer}) for the whole run: {fleet.life_text(life, h.t0_s)}.")
    x.doc.table(fleet.lives_table(h))
    x.doc.para("One row per life of a writer (a job of it, from joining the fleet to leaving it), from "
               "`logs/fleet/` (`control/fleet_log.py`) and the shard manifests; times in seconds since the fleet's "
               "first event. how: drained (left for good), preempted and requeued, killed and resubmitted (no final "
               "state; the launcher submitted it again), stopped, done (the run finished), running.")
    x.doc.table(fleet.windows_table(h, 10))
    x.doc.para("Groups committed per second in equal windows, in all and per writer (n/a: not in the fleet then).")
    if h.decisions:
        x.doc.para("What changed the fleet (requests, autoscale decisions with their numbers, drains):")
        x.doc.bullets([fleet.decision_line(e, h.t0_s) for e in h.decisions])
    x.img("fleet.png", "rollout fleet over time")


def _throughput(x: _Section) -> None:
    doc = x.doc
    doc.table(tables.throughput_table(x.d))
    doc.table(tables.queue_depth_table(x.d))
    x.img("throughput.png", "throughput and queue depth")


def _reward(x: _Section) -> None:
    row = tables.summary_row(x.d)
    x.doc.para(f"Final reward {row['final reward']:.3f} (mean `reward/mean` of the last "
               f"{tables.final_window(len(x.d.metrics))} update(s)).")
    model = [line for line in (reward_model.rollout_wait_line(x.d.rollout),
                               *reward_model.reward_job_lines(RunDir(x.d.root))) if line]
    if model:
        x.doc.bullets(model)
    x.img("reward.png", "reward against version and wall time")


def _training(x: _Section) -> None:
    x.img("training.png", "loss, KL, entropy, gradient norm, clip fraction and response length per update")


def _validation(x: _Section) -> None:
    d, doc = x.d, x.doc
    doc.para(validation.evaluation_line(d))
    if d.evals.empty:
        return
    doc.table(validation.validation_table(d))
    doc.para("score: the row's headline (mean over data sources of their core mean@N); the next columns: each data "
             "source's first core metric; published (s): the version's publish time since the run's first event. "
             "Metrics as verl's `process_validation_metrics` (docs/validation.md).")
    x.img("validation.png", "held-out validation curves against trainer step and wall time")
    skipped = validation.skipped_versions(d)
    if skipped:
        doc.bullets([f"v{v} {status}: {reason}" for v, status, reason in skipped])
    ex = validation.examples(d)
    if not ex.empty:
        doc.para("Responses of the last evaluated version (logs/eval_samples.jsonl.gz):")
        doc.table(ex)


def _drops(x: _Section) -> None:
    d, doc = x.d, x.doc
    dt = tables.drops_table(d)
    if dt.empty:
        ms = d.knobs.max_staleness if d.knobs else None
        doc.para(f"None: no group was dropped for staleness (`max_staleness` {'off' if ms is None else ms}) or for "
                 "lack of spread (`algorithm.filter_groups`), and no shard was damaged "
                 "(`fully_async/count/corrupt_groups_skipped` 0).")
    else:
        doc.table(dt)
    x.img("drops.png", "samples dropped and why")


def _problems(x: _Section) -> None:
    found = [p for p in problems_of(x.d.rollout) if p.any]
    if not found:
        x.doc.para("None: no reward function raised, no tool call failed, no prompt was filtered or cut for length.")
        return
    x.doc.table(problems_table(x.d.rollout))
    x.doc.para(f"Counted by the rollout jobs ({LOG_PATHS['rollout']}): a response whose reward function raised "
               "scored 0; a failed tool call ended its episode; prompts over data.max_prompt_length were filtered "
               "or cut (data.truncation). Each first error names its weight version and sample id "
               "(`hpcrl samples RUN` shows the sample).")
    for p in found:
        x.doc.para(f"`{p.line()}`")


SECTIONS = [("Problems: reward errors, tool errors, prompts filtered", _problems), ("Lag", _lag), ("Partial rollout spans", _partial), ("Idle ratios per version", _idle),
            ("Timeline: generation, training, weight sync", _timeline), ("Rollout fleet over time", _fleet),
            ("Throughput and queue", _throughput),
            ("Reward", _reward), ("Training curves", _training), ("Held-out validation", _validation),
            ("Samples dropped", _drops)]


def _ceiling_of(d: RunData):
    try:
        return run_ceiling(d)
    except KeyError:  # logs of an older hpcrl
        return None


def _speedups(runs: list[RunData]) -> list[str]:
    """Each run's speedup over the first on-policy run (s=0, K=1, no partial) and its ceiling."""
    base = next((d for d in runs if d.knobs and d.knobs.staleness_threshold == 0
                 and d.knobs.trigger_parameter_sync_step == 1 and not d.knobs.partial_rollout), None)
    base_c = _ceiling_of(base) if base is not None else None
    if base_c is None:
        return []
    out = []
    for d in runs:
        c = _ceiling_of(d) if d is not base else None
        if c is not None:
            out.append(speedup_line(d.name, c, base.name, base_c))
    return out


def _ceiling_line(d: RunData) -> str:
    """Measured throughput next to the bound of the run's own phase times (hpcrl/analysis/ceiling.py), and next to
    the budget-aware bound (hpcrl/analysis/budget_bound.py)."""
    try:
        c = run_ceiling(d)
    except KeyError as e:  # logs of an older hpcrl
        return f"{d.name}: no bound (the logs lack {e})"
    if c is None:
        return f"{d.name}: no bound (fewer than two updates, or no rollout rows)"
    return f"{d.name}: " + c.line(d.knobs.time_scale if d.knobs else 1.0)


def _run_section(doc: Doc, rep: Report, d: RunData, out_dir: Path, level: int) -> None:
    doc.para(f"Run directory `{d.root}`; {'finished' if d.finished else 'NOT finished'}; "
             + (d.knobs.describe() if d.knobs else "knobs unknown") + ".")
    doc.para("**Recommendation:** " + recommend_run(d).line)
    if d.notes:
        doc.heading(level + 1, "Notes")
        doc.bullets(d.notes)
    x = _Section(doc, rep, d, out_dir)
    for title, build in SECTIONS:
        doc.heading(level + 1, title)
        try:
            build(x)
        except Exception as e:  # data we did not foresee: say so in place, keep the other sections
            log.exception("report section %r of %s failed", title, d.root)
            rep.failed_plots.append(f"section {title!r} of {d.name}: {e!r}")
            doc.para(f"(this section could not be built from the logs: {e!r})")


def build_report(run_dirs: list, out_dir, names: list[str] | None = None) -> Report:
    """Load every run, write ``report.md``, ``report.html`` and the PNGs into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = names or _unique_names([Path(p) for p in run_dirs])
    runs = [load_run(p, name=n) for p, n in zip(run_dirs, names)]
    rep = Report(out_dir / "report.md", out_dir / "report.html", runs)
    title = f"hpcrl report: {runs[0].name}" if len(runs) == 1 else f"hpcrl report: {len(runs)} runs side by side"
    doc = Doc(title)
    doc.heading(2, "At a glance")
    doc.bullets([line if len(runs) == 1 else f"{d.name}: {line}" for d in runs for line in glance(d)])
    doc.para(f"Written {time.strftime('%Y-%m-%d %H:%M:%S')} by `hpcrl report` from the run directories only. "
             "Times in seconds; versions are weight versions; plots' time axes start at each run's first event.")

    simulated = [f"{d.name}: SIMULATED {d.knobs.simulated} (GPU time modelled and slept, time_scale "
                 f"{d.knobs.time_scale:g}; nothing real was trained)" for d in runs if d.knobs and d.knobs.simulated]
    if simulated:
        doc.para("**Simulated run(s)** - " + "; ".join(simulated) + ".")
    doc.heading(2, "Summary" if len(runs) == 1 else "Side by side")
    doc.table(tables.ablation_table(runs))
    doc.bullets([f"{k}: {v}" for k, v in tables.COLUMN_DEFINITIONS.items()])
    doc.heading(2, "Throughput against the ideal-overlap and budget-aware bounds")
    doc.bullets([_ceiling_line(d) for d in runs] + _speedups(runs))
    if len(runs) > 1:
        doc.heading(2, "Recommendations")
        doc.bullets([f"{d.name}: {recommend_run(d).line}" for d in runs])
        doc.heading(2, "Overlaid curves")
        for name, draw in compare.COMPARE_PLOTS.items():
            _plot(doc, rep, draw, out_dir / name, name, name[:-4].replace("_", " "), runs)
        if any(len(d.evals) for d in runs):
            _plot(doc, rep, validation.compare_validation, out_dir / "compare_validation.png",
                  "compare_validation.png", "compare validation", runs)
    for d in runs:
        doc.heading(2, f"Run {d.name}" if len(runs) > 1 else "Details")
        _run_section(doc, rep, d, out_dir, 2)
    rep.markdown.write_text(doc.markdown())
    rep.html.write_text(doc.html())
    return rep
