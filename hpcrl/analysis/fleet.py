"""The rollout fleet over time: who joined when, who left when and why, and groups/s per writer in time windows.

Read from what the run already records (nothing here writes):

- ``logs/fleet/*.jsonl`` (``control/fleet_log.py``): each writer's ``joined`` and ``ended`` (its lives), the
  launcher's ``resubmitted`` (a life killed without a final state and brought back), and the decisions
  (``scale_*``, ``autoscale``, ``drain_requested``) for the list of what changed the fleet;
- ``samples/<writer>/manifest.jsonl``: ``committed_s`` and ``n_groups`` of every shard, for groups/s per writer
  in each window (committed groups: what a writer delivered, whether or not the trainer took them yet);
- the heartbeats: whether an open life is still running.

A writer with no fleet log (a run of an hpcrl before it) gets one life from its first to its last commit, ended as
its heartbeat says. Times are seconds since the fleet's first event.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from hpcrl.control.fleet_log import (AUTOSCALE, DRAIN_REQUESTED, ENDED, JOINED, RESUBMITTED, SCALE_APPLIED,
                                     SCALE_REFUSED, SCALE_REQUESTED, FleetEvent, read_fleet_events)
from hpcrl.control.records import has_ended, read_heartbeats, read_trainer_done
from hpcrl.rundir.fsio import read_jsonl
from hpcrl.rundir.paths import RunDir

DECISIONS = (SCALE_REQUESTED, SCALE_APPLIED, SCALE_REFUSED, AUTOSCALE, DRAIN_REQUESTED)
"""Events that say why the fleet changed (the rest say what each job did)."""


@dataclass
class Life:
    """One job of a writer, from its join to its end."""

    writer: str
    joined_s: float
    """Unix time it joined (took its lease)."""
    job_id: str = ""
    left_s: Optional[float] = None
    """Unix time it ended (its ``ended`` event; for a killed one its last commit or the launcher's resubmission);
    None while it runs."""
    how: str = "running"
    """``running``, ``drained``, ``preempted and requeued``, ``killed and resubmitted``, ``stopped``, ``done``,
    ``failed``, ``killed`` (no final state), ..."""
    groups: int = 0
    """Groups it committed."""
    lease: str = ""
    """Its lease on the writer's claims (matches its ``ended`` to it, even after a successor joined)."""


@dataclass
class Window:
    """A slice of the run's time and what the fleet delivered in it."""

    start_s: float
    """Seconds since the fleet's first event."""
    end_s: float
    writers: int
    """Writers with a life overlapping the window."""
    groups_per_s: dict[str, float] = field(default_factory=dict)
    """Writer -> groups committed in the window per second (writers present in it only)."""

    @property
    def total_per_s(self) -> float:
        """The fleet's groups per second in the window."""
        return sum(self.groups_per_s.values())


@dataclass
class FleetHistory:
    """A run's fleet over time (module docstring)."""

    t0_s: float
    """Unix time of the fleet's first event (times are shown relative to it)."""
    end_s: float
    """Unix time of the last thing seen (now, for a run still going)."""
    lives: list[Life]
    decisions: list[FleetEvent]
    commits: dict[str, list[tuple[float, int]]]
    """Writer -> (committed_s, n_groups) of its manifest lines."""

    @property
    def writers(self) -> list[str]:
        return sorted({life.writer for life in self.lives} | set(self.commits))

    @property
    def changed(self) -> bool:
        """The fleet was not one writer for the whole run: several writers, a writer with several lives, or a
        decision that changed it."""
        return len(self.writers) > 1 or len(self.lives) > len(self.writers) or bool(self.decisions)

    def windows(self, n: int) -> list[Window]:
        """``n`` equal windows from the first commit (start-up delivers nothing) to :attr:`end_s`."""
        first = min((c[0][0] for c in self.commits.values() if c), default=self.t0_s)
        span = max(self.end_s - first, 1e-9)
        out = []
        for i in range(n):
            a, b = first + span * i / n, first + span * (i + 1) / n
            here = {life.writer for life in self.lives if life.joined_s < b and (life.left_s or self.end_s) > a}
            rates = {}
            for w in self.writers:
                got = sum(g for t, g in self.commits.get(w, []) if a <= t < b or (i == n - 1 and t == b))
                if w in here or got:
                    rates[w] = got / (b - a)
            out.append(Window(a - self.t0_s, b - self.t0_s, len(here | {w for w, r in rates.items() if r}), rates))
        return out


def _commits(rd: RunDir) -> dict[str, list[tuple[float, int]]]:
    out = {}
    for w in rd.writers():
        rows = [r for r in read_jsonl(rd.shard_manifest(w)) if isinstance(r, dict)]
        out[w] = sorted((float(r.get("committed_s", 0.0)), int(r.get("n_groups", 0))) for r in rows)
    return out


def _close(life: Life, at_s: float, how: str) -> None:
    life.left_s, life.how = at_s, how


def _lives_of(writer: str, events: list[FleetEvent], resubmits: list[float], commits: list[tuple[float, int]],
              beat_state: Optional[str], stale: bool) -> list[Life]:
    """A writer's lives from its ``joined``/``ended`` events (module docstring); ``stale``: its heartbeat is."""
    lives: list[Life] = []
    for ev in events:
        if ev.event == JOINED:
            if lives and lives[-1].left_s is None:  # the one before never said how it ended: killed
                prev = lives[-1]
                last = max((t for t, _ in commits if prev.joined_s <= t < ev.time_s), default=prev.joined_s)
                back = any(prev.joined_s < t <= ev.time_s for t in resubmits)
                _close(prev, last, "killed and resubmitted" if back else "killed and requeued")
            elif lives and lives[-1].how in ("preempted", "stopped", "failed"):
                lives[-1].how += {"preempted": " and requeued", "stopped": ", then resumed",
                                  "failed": " and resubmitted"}[lives[-1].how]
            lives.append(Life(writer, ev.time_s, ev.job_id, lease=str(ev.numbers.get("lease", ""))))
        elif ev.event == ENDED:
            lease = str(ev.numbers.get("lease", ""))
            mine = [x for x in lives if x.left_s is None and (x.lease == lease or not lease)]
            if mine:  # a zombie's ``ended`` after its successor joined closes its own life, not the successor's
                _close(mine[-1], ev.time_s, ev.why or "ended")
    if lives and lives[-1].left_s is None and beat_state is not None and (has_ended(beat_state) or stale):
        last = max((t for t, _ in commits if t >= lives[-1].joined_s), default=lives[-1].joined_s)
        _close(lives[-1], last, "killed")  # no ``ended`` event, and its heartbeat ended or stopped: it died hard
    if not lives and commits:  # no fleet log: an hpcrl before it
        ended = beat_state if beat_state is not None and has_ended(beat_state) else "killed" if stale else None
        lives.append(Life(writer, commits[0][0], left_s=commits[-1][0] if ended else None, how=ended or "running"))
    for life in lives:
        life.groups = sum(g for t, g in commits if life.joined_s <= t <= (life.left_s or float("inf")))
    return lives


def fleet_history(rd: RunDir, now_s: Optional[float] = None, stale_s: float = 60.0) -> FleetHistory:
    """The fleet of the run in ``rd`` over time (module docstring); a job whose heartbeat is older than ``stale_s``
    without a final state was killed."""
    now = now_s if now_s is not None else time.time()
    events = read_fleet_events(rd)
    commits = _commits(rd)
    beats = read_heartbeats(rd)
    by_writer: dict[str, list[FleetEvent]] = {}
    for ev in events:
        if ev.event in (JOINED, ENDED) and ev.writer:
            by_writer.setdefault(ev.writer, []).append(ev)
    writers = sorted(set(by_writer) | set(commits))
    lives = []
    for w in writers:
        beat = beats.get(RunDir.rollout_job(w))
        resubmits = [e.time_s for e in events if e.event == RESUBMITTED and e.writer == w]
        lives += _lives_of(w, by_writer.get(w, []), resubmits, commits.get(w, []), beat.state if beat else None,
                           beat is not None and not beat.ended and beat.age_s(now) > stale_s)
    times = [e.time_s for e in events] + [t for c in commits.values() for t, _ in c]
    t0 = min(times, default=0.0)
    if read_trainer_done(rd) is None and any(life.left_s is None for life in lives):
        end = now
    else:
        end = max([*times, *(life.left_s or 0.0 for life in lives)], default=t0)
    return FleetHistory(t0, max(end, t0), lives, [e for e in events if e.event in DECISIONS], commits)


def decision_line(ev: FleetEvent, t0_s: float) -> str:
    """One decision in words: ``+40s scale 1 -> 3 (hpcrl scale --rollout-jobs 3)``."""
    at = f"+{ev.time_s - t0_s:.0f}s"
    if ev.event == AUTOSCALE:
        return f"{at} autoscale {ev.from_jobs} -> {ev.to_jobs}{'' if ev.applied else ' HELD'}: {ev.why}"
    if ev.event == DRAIN_REQUESTED:
        return f"{at} drain {ev.writer} ({ev.by}{'; ' + ev.why if ev.why else ''})"
    if ev.event == SCALE_REQUESTED:
        return f"{at} asked for {ev.to_jobs} rollout job(s) ({ev.by})"
    if ev.event == SCALE_REFUSED:
        return f"{at} scale to {ev.to_jobs} refused: {ev.why}"
    return f"{at} scale {ev.from_jobs} -> {ev.to_jobs} ({ev.by})"


def life_text(life: Life, t0_s: float) -> str:
    """``joined +12s (job 123), killed and resubmitted at +40s, 14 groups``."""
    job = f" (job {life.job_id})" if life.job_id else ""
    end = "running" if life.left_s is None else f"{life.how} at +{life.left_s - t0_s:.0f}s"
    return f"joined +{life.joined_s - t0_s:.0f}s{job}, {end}, {life.groups} groups"


def status_lines(h: FleetHistory, windows: int = 6, decisions: int = 5) -> list[str]:
    """The compact fleet-over-time view of ``hpcrl status`` (when the fleet changed or has several writers)."""
    if not h.lives or not h.changed:
        return []
    ws = h.windows(windows)
    writers = h.writers
    head = f"  {'window':<13}{'writers':>8}{'total':>8}" + "".join(f"{w:>7}" for w in writers)
    width = ws[0].end_s - ws[0].start_s
    lines = [f"fleet over time (groups/s committed per writer, {windows} windows of {width:.0f}s from the first "
             "commit; times since the first job was submitted):", head]
    for x in ws:
        cells = "".join(f"{x.groups_per_s[w]:>7.2f}" if w in x.groups_per_s else f"{'-':>7}" for w in writers)
        lines.append(f"  {f'{x.start_s:.0f}-{x.end_s:.0f}s':<13}{x.writers:>8}{x.total_per_s:>8.2f}{cells}")
    for w in writers:
        lives = [life for life in h.lives if life.writer == w]
        lines.append(f"  {w}: " + "; ".join(life_text(life, h.t0_s) for life in lives))
    applied = {(e.by, e.to_jobs) for e in h.decisions if e.event == SCALE_APPLIED}
    said = [e for e in h.decisions if not (e.event == SCALE_REQUESTED and (e.by, e.to_jobs) in applied)
            and not (e.event == SCALE_APPLIED and e.by == AUTOSCALE)]
    shown = said[-decisions:]  # a request the launcher applied is said once, an autoscale decision by itself
    if shown:
        more = f" (last {len(shown)} of {len(said)})" if len(said) > len(shown) else ""
        lines.append(f"  decisions{more}: " + "; ".join(decision_line(e, h.t0_s) for e in shown))
    return lines


def lives_table(h: FleetHistory):
    """One row per life of a writer: job id, joined and left (s since the fleet's first event), how, groups and
    groups/s over the life."""
    import pandas as pd

    rows = []
    for life in sorted(h.lives, key=lambda x: (x.writer, x.joined_s)):
        end = life.left_s if life.left_s is not None else h.end_s
        rows.append({"writer": life.writer, "job id": life.job_id or "n/a", "joined (s)": life.joined_s - h.t0_s,
                     "left (s)": end - h.t0_s if life.left_s is not None else float("nan"), "how": life.how,
                     "groups": life.groups, "groups/s": life.groups / max(end - life.joined_s, 1e-9)})
    return pd.DataFrame(rows)


def windows_table(h: FleetHistory, n: int):
    """One row per time window: writers in it, the fleet's groups/s and each writer's."""
    import pandas as pd

    writers = h.writers
    return pd.DataFrame([{"from (s)": x.start_s, "to (s)": x.end_s, "writers": x.writers,
                          "groups/s": x.total_per_s,
                          **{f"{w} groups/s": x.groups_per_s.get(w, float("nan")) for w in writers}}
                         for x in h.windows(n)])


def fleet_plot(data, out):
    """``fleet.png``: writers in the fleet over time (each writer's lives as bars, how each ended at its end) and
    groups/s per writer per window, stacked."""
    from hpcrl.analysis.plots import empty_note, new_figure, save, writer_color

    h = fleet_history(RunDir(data.root))
    fig, ax = new_figure(11, 6, nrows=2)
    top, bottom = ax[0, 0], ax[1, 0]
    writers = h.writers
    if not h.lives:
        empty_note(top, "no rollout writer joined or committed yet")
        return save(fig, out)
    for i, w in enumerate(writers):
        for life in (x for x in h.lives if x.writer == w):
            end = (life.left_s if life.left_s is not None else h.end_s) - h.t0_s
            top.barh(i, end - (life.joined_s - h.t0_s), left=life.joined_s - h.t0_s, color=writer_color(i), height=0.6)
            top.text(end, i, f" {life.how}", va="center", fontsize=8)
    for ev in h.decisions:
        top.axvline(ev.time_s - h.t0_s, color="#999999", linestyle=":", linewidth=1)
    top.set_yticks(range(len(writers)), writers)
    top.set_title("rollout writers' lives (dotted: fleet decisions)")
    ws = h.windows(10)
    mids = [(x.start_s + x.end_s) / 2 for x in ws]
    base = [0.0] * len(ws)
    for i, w in enumerate(writers):
        vals = [x.groups_per_s.get(w, 0.0) for x in ws]
        bottom.bar(mids, vals, width=(ws[0].end_s - ws[0].start_s) * 0.9, bottom=base, color=writer_color(i), label=w)
        base = [b + v for b, v in zip(base, vals)]
    bottom.set_ylim(0, max(base, default=0.0) * 1.1 or 1.0)
    bottom.set_xlabel("seconds since the fleet's first event")
    bottom.set_ylabel("groups/s committed")
    bottom.legend(fontsize=8)
    for a in (top, bottom):
        a.set_xlim(0, (h.end_s - h.t0_s) * 1.12)  # room for the last life's label
    return save(fig, out)
