"""Opt-in autoscaling of the rollout fleet (``resources.rollout_autoscale``), run by the launcher following the run.

The rule, on the measured idle ratios of the last ``versions`` weight versions:

- the trainer waited for samples more than ``idle_ratio`` of each of its last ``versions`` updates
  (``trainer/idle_ratio``), and the fleet is below ``max_jobs``: add one rollout job;
- every rollout job was idle more than ``idle_ratio`` over those versions (``rollouter/idle_ratio``, the mean of
  its rows), the trainer was not, and the fleet is above ``min_jobs``: drain the newest one (the fleet is ahead of
  the trainer, or waits on the admission budget);
- otherwise nothing. After a decision the rule waits ``versions`` more versions (the new job starts, the drained
  one leaves, the ratios settle).

:func:`decide` is the rule alone (rows in, a decision with its numbers out); :class:`Autoscaler` feeds it the
run's logs. It does not look at the Slurm queue: a job added while the queue is full waits there like any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hpcrl import metric_names as M
from hpcrl.config.resources import RolloutAutoscale
from hpcrl.fsio import JsonlTail
from hpcrl.run_dir import RunDir


@dataclass
class Decision:
    """A change of the fleet size and why, with the numbers."""

    rollout_jobs: int
    why: str
    version: int
    """The newest trainer version the rule saw."""


def decide(cfg: RolloutAutoscale, jobs: int, trainer_rows: list[dict], rollout_rows: dict[str, list[dict]],
           last_decision_version: int) -> Optional[Decision]:
    """The rule of the module docstring: ``jobs`` is the fleet size now, ``trainer_rows`` the metrics rows so far,
    ``rollout_rows`` each writer's rows (the writers of the current fleet)."""
    if not trainer_rows:
        return None
    version = int(trainer_rows[-1].get(M.PARAM_VERSION, len(trainer_rows)))
    recent = trainer_rows[-cfg.versions:]
    if len(recent) < cfg.versions or version - last_decision_version < cfg.versions:
        return None
    trainer_idle = [float(r.get(M.TRAINER_IDLE_RATIO, 0.0)) for r in recent]
    since = int(recent[0].get(M.PARAM_VERSION, 0))
    if min(trainer_idle) > cfg.idle_ratio and jobs < cfg.max_jobs:
        return Decision(jobs + 1, f"trainer idle {min(trainer_idle):.2f}-{max(trainer_idle):.2f} > "
                                  f"{cfg.idle_ratio:g} in each of the last {cfg.versions} updates", version)
    per_writer = {}
    for writer, rows in rollout_rows.items():
        ratios = [float(r.get(M.ROLLOUT_IDLE_RATIO, 0.0)) for r in rows if int(r.get(M.PARAM_VERSION, -1)) >= since]
        if ratios:
            per_writer[writer] = sum(ratios) / len(ratios)
    if (len(per_writer) == jobs and per_writer and min(per_writer.values()) > cfg.idle_ratio
            and max(trainer_idle) <= cfg.idle_ratio and jobs > cfg.min_jobs):
        shown = ", ".join(f"{w} {v:.2f}" for w, v in sorted(per_writer.items()))
        return Decision(jobs - 1, f"every rollout job idle > {cfg.idle_ratio:g} since version {since} ({shown}) "
                                  f"while the trainer was busy (idle <= {max(trainer_idle):.2f})", version)
    return None


class Autoscaler:
    """Reads the run's logs for :func:`decide` and remembers its last decision."""

    def __init__(self, rd: RunDir, cfg: RolloutAutoscale):
        self.rd = rd
        self.cfg = cfg
        self._metrics = JsonlTail(rd.metrics)
        self._rollout: dict[str, JsonlTail] = {}
        self.last_version = -10**9
        """The trainer version of the last decision (the rule waits ``versions`` after it)."""

    def poll(self, writers: list[str]) -> Optional[Decision]:
        """A decision for a fleet of ``writers`` (those running and not draining), or None."""
        for writer, path in self.rd.rollout_metrics_logs().items():
            self._rollout.setdefault(writer, JsonlTail(path))
        rows = {w: self._rollout[w].poll() for w in writers if w in self._rollout}
        decision = decide(self.cfg, len(writers), self._metrics.poll(), rows, self.last_version)
        if decision is not None:
            self.last_version = decision.version
        return decision
