"""What ``hpcrl run`` prints while it follows a run, from the run directory only.

- **Start-up**: until the first update, each job's start-up step from its heartbeat (``trainer: building
  DeepSpeed's ops``), a line whenever one changes, and every :data:`STARTUP_EVERY_S` a line with how long
  each step has taken so far; so a slow first start says what it waits for.
- **One line per weight version** from the trainer's metrics rows: step, reward, lag, idle ratios,
  tokens/s, elapsed time and an ETA from the steady-state speed only (the median time between two
  updates over the last :data:`RECENT` updates, from the rows' own time stamps: start-up, restarts and a
  resume's pause do not count; a resumed run has its ETA at once). Only updates not printed before are
  printed: a resumed run, or a trainer restarted from a checkpoint, does not print its versions again.
- **The rollout jobs' idle ratios** on each version line: each job's with up to :data:`IDLE_EACH_UP_TO` jobs, else
  their mean, min and max. Their logs (one per job) are read at most :data:`ROLLOUT_LOGS_PER_S` per second, so a
  fleet of 768 is read every 3.8 s, not 768 files every poll.
- **Problems**, counted per version when non-zero, from the rollout jobs' rows: reward functions that
  raised, tool calls that failed (with the first message and sample id), prompts filtered by length.
- **A sampled response** under every ``logging.show_samples`` version lines (prompt, response, reward,
  cut to one line).
- On a terminal, a progress bar (tqdm) under the lines, with the step, reward and the same ETA.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from hpcrl.logs import metric_names as M
from hpcrl.config import RunConfig
from hpcrl.control.records import read_heartbeats
from hpcrl.rundir.fsio import JsonlTail
from hpcrl.rundir.paths import RunDir

RECENT = 20
"""Intervals between updates the ETA's median is taken over."""
STARTUP_EVERY_S = 30.0
"""While the jobs start: a line saying what each waits for, this often (and whenever a step changes)."""
LINE_CHARS = 160
"""A sampled response is cut to this many characters, to stay one line."""
IDLE_EACH_UP_TO = 4
"""A version line shows each rollout job's idle ratio up to this many jobs, then their mean, min and max."""
ROLLOUT_LOGS_PER_S = 200.0
"""The rollout jobs' logs the console reads per second at most: up to 200 jobs it reads them at every poll (the
follower's, each second), with W more every W / 200 s; a version line's rollout figures are that old at most."""


def hms(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def steady_seconds_per_update(rows: list[dict]) -> Optional[float]:
    """Median seconds between consecutive updates over the last :data:`RECENT` pairs (None with fewer than 2)."""
    rows = rows[-(RECENT + 1):]
    gaps = [b[M.TIME_S] - a[M.TIME_S] for a, b in zip(rows, rows[1:])
            if b.get(M.STEP) == a.get(M.STEP, -2) + 1 and isinstance(a.get(M.TIME_S), (int, float))
            and isinstance(b.get(M.TIME_S), (int, float))]
    return statistics.median(gaps) if gaps else None


def one_line(text: str, limit: int = LINE_CHARS) -> str:
    """Whitespace folded, cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Bar:
    """A tqdm bar at the bottom of a terminal; the lines are written above it. Off (plain lines) elsewhere."""

    def __init__(self, total: int, on: bool, start: int = 0):
        self._bar = None
        if on:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="update", dynamic_ncols=True, leave=True,
                             bar_format="{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} updates {postfix}")

    @property
    def on(self) -> bool:
        """A bar is shown (a terminal)."""
        return self._bar is not None

    def write(self, line: str, emit: Callable[[str], None]) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            emit(line)

    def show(self, step: Optional[int] = None, desc: str = "", postfix: str = "") -> None:
        if self._bar is None:
            return
        if step is not None:
            self._bar.n = step
        self._bar.set_description_str(desc, refresh=False)
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Console:
    """The lines (and bar) of one ``hpcrl run`` session (module docstring)."""

    def __init__(self, rd: RunDir, cfg: RunConfig, emit: Callable[[str], None], resume: bool, bar: bool = False):
        self.rd, self.cfg, self.emit = rd, cfg, emit
        self._metrics = JsonlTail(rd.metrics)
        self._rows: list[dict] = self._metrics.poll()
        """Every metrics row so far (the ETA reads their time stamps)."""
        self._printed_step = self._rows[-1][M.STEP] if resume and self._rows else 0
        """Updates up to this one were printed (by this session or, with resume, an earlier one)."""
        self._initial_step = self._printed_step
        self._started_s = time.monotonic()
        self._pending: dict[int, list[dict]] = {}
        self._rollout: dict[Path, JsonlTail] = {}
        self._rollout_new: list[dict] = []
        """Rollout rows not yet reported on a version line."""
        self._latest: dict[str, dict] = {}
        """Each writer's newest rollout row (its idle ratio)."""
        self._seen: dict[Path, int] = {}
        self._samples: list[dict] = []
        """Rollout rows with a sampled response, by version (the last 50)."""
        self._errors_seen = {M.REWARD_ERRORS: False, M.TOOL_ERRORS: False}
        self._filtered_said = False
        self._lines = 0
        self._startup: dict[str, str] = {}
        self._startup_said_s = time.monotonic()
        self._rollout_due_s = -1.0
        """When the rollout jobs' logs are read next (:data:`ROLLOUT_LOGS_PER_S`)."""
        self.bar = Bar(cfg.total_updates, bar, self._printed_step)

    def say(self, line: str) -> None:
        """One line for the user, above the bar when there is one."""
        self.bar.write(line, self.emit)

    @property
    def first_update_seen(self) -> bool:
        """An update of this session was logged (until then the start-up steps are shown)."""
        return self._lines > 0 or any(r[M.STEP] > self._initial_step for r in self._rows)

    def eta(self, step: int) -> str:
        """``eta 3m05s`` from the steady-state speed (module docstring), or ``eta ?`` before two timed updates."""
        per = steady_seconds_per_update(self._rows)
        return f"eta {hms(per * (self.cfg.total_updates - step))}" if per is not None else "eta ?"

    def poll(self, every_log: bool = False) -> None:
        """Print what is new: start-up steps before the first update, then version lines (``every_log``: read the
        rollout jobs' logs now, whenever they were last read)."""
        self._rows = self._metrics.poll()  # all rows (a log a restarted trainer cut back is read again)
        if every_log or time.monotonic() >= self._rollout_due_s:
            self._poll_rollout()
            logs = len(self._rollout)
            self._rollout_due_s = time.monotonic() + (logs / ROLLOUT_LOGS_PER_S if logs > ROLLOUT_LOGS_PER_S else 0.0)
        if not self.first_update_seen:
            self._startup_lines()
            return
        K = self.cfg.async_training.trigger_parameter_sync_step
        for row in self._rows:
            if row[M.STEP] <= self._printed_step:
                continue  # printed already (before a resume, or before the trainer rolled back)
            self._pending.setdefault(row[M.PARAM_VERSION], []).append(row)
            if row[M.STEP] % K == 0 or row[M.STEP] == self.cfg.total_updates:
                self._version_line(row, self._pending.pop(row[M.PARAM_VERSION]))
                self._printed_step = row[M.STEP]

    def _version_line(self, row: dict, rs: list[dict]) -> None:
        reward = sum(r[M.REWARD_MEAN] for r in rs) / len(rs)
        lag_mean = sum(r[M.LAG_MEAN] for r in rs) / len(rs)
        lag_max = max(r[M.LAG_MAX] for r in rs)
        idle = sum(r[M.TRAINER_IDLE_RATIO] for r in rs) / len(rs)
        tps = sum(r[M.TOKENS_PER_S] for r in rs) / len(rs)
        step, eta = row[M.STEP], self.eta(row[M.STEP])
        line = (f"v{row[M.PARAM_VERSION] + 1:<4d} step {step:>5d}/{self.cfg.total_updates} reward {reward:.3f}  "
                f"lag mean {lag_mean:.2f} max {lag_max}  idle trainer {idle:.2f} rollout {self._rollout_idle()}  "
                f"tokens/s {tps:.0f}  elapsed {hms(time.monotonic() - self._started_s)} {eta}")
        problems = self._problems()
        self.bar.write(line + (f"  | {problems}" if problems else ""), self.emit)
        self._lines += 1
        every = self.cfg.logging.show_samples
        if every and self._lines % every == 1 % every:
            self._sample_line(row[M.PARAM_VERSION])
        self.bar.show(step, postfix=f"reward {reward:.3f} {eta}")

    # ---- the rollout jobs' rows: idle ratio, problems, samples
    def _poll_rollout(self) -> None:
        fresh: list[dict] = []
        for p in self.rd.rollout_metrics_logs().values():
            rows = self._rollout.setdefault(p, JsonlTail(p)).poll()
            known = self._seen.get(p, 0)
            fresh += rows[known:] if len(rows) >= known else rows  # a log cut back is read again
            self._seen[p] = len(rows)
        self._rollout_new += fresh
        for r in fresh:
            self._latest[str(r.get(M.WRITER))] = r
        self._samples = sorted(self._samples + [r for r in fresh if r.get(M.SAMPLE_ID)],
                               key=lambda r: r.get(M.PARAM_VERSION, -1))[-50:]

    def _rollout_idle(self) -> str:
        """Each rollout job's idle ratio (``0.12/0.30``), or with more than :data:`IDLE_EACH_UP_TO` jobs their mean,
        min and max (``0.21 (mean of 768, 0.00-0.45)``)."""
        vals = [r.get(M.ROLLOUT_IDLE_RATIO) for r in self._latest.values()]
        vals = [v for v in vals if isinstance(v, (int, float))]
        if len(vals) > IDLE_EACH_UP_TO:
            return f"{statistics.fmean(vals):.2f} (mean of {len(vals)}, {min(vals):.2f}-{max(vals):.2f})"
        return "/".join(f"{v:.2f}" for v in vals) if vals else "n/a"

    def _problems(self) -> str:
        """``reward errors 5 (first: w000/3/1: ZeroDivisionError: ...)`` for the rollout rows new since the last
        line (the first message once per run), prompts filtered on the first line."""
        rows, self._rollout_new = self._rollout_new, []
        out = []
        for key, what, first_key in ((M.REWARD_ERRORS, "reward errors", M.REWARD_FIRST_ERROR),
                                     (M.TOOL_ERRORS, "tool errors", M.TOOL_FIRST_ERROR)):
            n = sum(int(r.get(key) or 0) for r in rows)
            if n:
                first = next((r[first_key] for r in rows if r.get(first_key)), "")
                said = self._errors_seen[key]
                self._errors_seen[key] = True
                out.append(f"{what} {n}" + (f" (first: {one_line(first, 120)})" if first and not said else ""))
        filtered = max((int(r.get(M.PROMPTS_FILTERED) or 0) for r in rows), default=0)
        if filtered and not self._filtered_said:
            self._filtered_said = True
            out.append(f"{filtered} prompts filtered (over data.max_prompt_length)")
        return "; ".join(out)

    def _sample_line(self, version: int) -> None:
        """A response generated with ``version`` (the one the update trained on), else the newest before it."""
        rows = [r for r in self._samples if r.get(M.PARAM_VERSION, -1) <= version] or self._samples[:1]
        if not rows:
            return
        r = rows[-1]
        text = (f"sample {r[M.SAMPLE_ID]} (v{r.get(M.PARAM_VERSION)}, reward {float(r.get(M.SAMPLE_REWARD, 0)):.3f}): "
                f"{one_line(r.get(M.SAMPLE_PROMPT, ''), 60)!r} -> {r.get(M.SAMPLE_RESPONSE, '')!r}")
        self.bar.write("  " + one_line(text), self.emit)

    # ---- start-up
    def _startup_lines(self) -> None:
        now, beats = time.time(), read_heartbeats(self.rd)
        steps = {job: (f"{b.step} ({hms(now - b.step_started_s)})" if b.step else
                       "waiting" if b.state == "starting" else f"started, {str(b.state).replace('_', ' ')}")
                 for job, b in sorted(beats.items()) if not b.ended}
        names = {job: s.rsplit(" (", 1)[0].split(",")[0] for job, s in steps.items()}
        waited = hms(time.monotonic() - self._started_s)
        summary = "; ".join(f"{job}: {s}" for job, s in steps.items()) or "no job has started yet (queued?)"
        if steps and all(s.startswith("started") for s in steps.values()):  # a long first update, not a slow start
            summary = "every job started, the first version not yet published; " + summary
        if names != self._startup:
            for job, name in names.items():
                if self._startup.get(job) != name:
                    self.bar.write(f"  {job}: {steps[job]}", self.emit)
            self._startup, self._startup_said_s = names, time.monotonic()
        elif time.monotonic() - self._startup_said_s > STARTUP_EVERY_S and not self.bar.on:
            self.emit(f"  starting for {waited}: {summary}")
            self._startup_said_s = time.monotonic()
        self.bar.show(desc=f"starting {waited}: {one_line(summary, 80)} ")

    def close(self) -> None:
        """Print what is left and take the bar down."""
        self.poll(every_log=True)
        self.bar.close()
