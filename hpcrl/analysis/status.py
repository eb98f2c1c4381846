"""``hpcrl status RUN_DIR``: a live, plain-text view of a run for a login node (works over ssh).

Every few seconds (``--interval-s``) it reads the run directory and prints:

- the knobs and a progress bar of the trainer's updates with an ETA (mean time
  per update over the last :data:`RECENT` updates times the updates left);
- one line per job: state, weight version, heartbeat age, idle ratio and
  counters; a job whose heartbeat is older than ``timeouts.heartbeat_stale_s``
  is flagged STALE, and one on this host whose process is gone is flagged GONE (a preempted or drained
  rollout job says so in its state); when the rollout fleet changed, a line naming the writers in it, those
  draining, preempted and those that left (``hpcrl scale``), and the fleet over time: groups/s per writer in
  time windows, each writer's lives (joined, left and why) and the last decisions (``logs/fleet/``);
- groups committed (shard manifests), consumed (trainer), the queue between
  them and the groups in flight (admission counter), and the lag of the last update;
- with an evaluation job, the last validated version and its score, the best so far
  and how many due versions were skipped (``logs/eval.jsonl``);
- problems, when there are any: reward errors, tool errors (each with the first message and sample
  id) and prompts filtered by length, per rollout job (:mod:`hpcrl.analysis.problems`).

It exits 0 when ``control/trainer_done.json`` appears, 1 when no job is alive
and the trainer has not finished (crashed or cancelled: resume with
``hpcrl run --resume``), 2 when RUN_DIR is not a run directory; ``--once``
prints one view and exits with the same codes (0 for a run still going).

It only reads: logs are tailed from the last complete line (a torn last line is
not read until it is complete; a log that shrank because a resumed trainer
rolled it back is read again from the start).
"""
from __future__ import annotations

import math
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, TextIO

from hpcrl.analysis.fleet import fleet_history, status_lines as fleet_status_lines
from hpcrl.analysis.load import read_config_leniently, read_json_tolerant
from hpcrl.analysis.problems import tally
from hpcrl.config.knobs import Knobs
from hpcrl.control.admission import read_claims
from hpcrl.control.fleet import drained_writers
from hpcrl.control.records import HeartbeatState, JobStats, TrainerDone, has_ended, read_heartbeats, read_trainer_done
from hpcrl.logs.eval_log import EVALUATED, JOB, SKIPPED, EvalRow
from hpcrl.control.fatal import read_fatal
from hpcrl.rundir.fsio import JsonlTail
from hpcrl.rundir.disk import free_bytes, size_text, tree_bytes
from hpcrl.process.pids import pid_running
from hpcrl.rundir.paths import EVAL_JOB, RunDir
from hpcrl.logs import metric_names as M

RECENT = 20
"""Updates the ETA and the recent trainer idle ratio are averaged over."""
BAR_WIDTH = 30


@dataclass
class JobView:
    """One job's line of the status view, from its heartbeat."""

    job: str
    state: str
    version: int
    age_s: float
    host: str
    pid: int
    flag: str = ""
    """``STALE`` (no heartbeat for too long), ``GONE`` (process not running on this host), or ``""``."""
    step: str = ""
    """The start-up step it is in (or failed in), from its heartbeat."""
    step_s: float = 0.0
    """Seconds in that step: until now, or, for a job that ended in it, until its last beat."""
    stats: JobStats = field(default_factory=JobStats)
    """The heartbeat's counters."""

    @property
    def alive(self) -> bool:
        return not self.flag and not has_ended(self.state)


def _process_gone(host: str, pid: int) -> bool:
    if host != socket.gethostname() or pid <= 0:
        return False  # another node: only the heartbeat age can tell
    return not pid_running(pid)


@dataclass
class StatusView:
    """The refreshing status view of one run; tails the logs incrementally."""

    rd: RunDir
    knobs: Optional[Knobs]
    stale_s: float
    notes: list[str] = field(default_factory=list)
    knobs_eval: bool = False
    """The run has an evaluation job (say so while nothing is evaluated yet)."""

    def __post_init__(self):
        self._disk: tuple[float, str] = (-math.inf, "")  # (when measured, the line): the tree is walked once a minute
        self.metrics = JsonlTail(self.rd.metrics)
        self.evals = JsonlTail(self.rd.eval_log)
        self.rollout: dict[str, JsonlTail] = {}
        self.manifests: dict[str, JsonlTail] = {}

    def jobs(self, now: float) -> list[JobView]:
        out = []
        for job, h in read_heartbeats(self.rd).items():
            until = h.time_s if has_ended(h.state) else now
            v = JobView(job, h.state, h.param_version, h.age_s(now), h.host, h.pid, step=h.step,
                        step_s=until - h.step_started_s if h.step else 0.0, stats=h.stats)
            if not has_ended(v.state):
                if _process_gone(v.host, v.pid):
                    v.flag = "GONE"
                elif v.age_s > self.stale_s:
                    v.flag = "STALE"
            out.append(v)
        return sorted(out, key=lambda v: (v.job != RunDir.trainer_job(), v.job))

    def committed(self) -> dict[str, int]:
        for w in self.rd.writers():
            self.manifests.setdefault(w, JsonlTail(self.rd.shard_manifest(w)))
        return {w: sum(int(_num(r.get("n_groups"), 0)) for r in t.poll()) for w, t in self.manifests.items()}

    def rollout_rows(self) -> dict[str, list[dict]]:
        for writer, p in self.rd.rollout_metrics_logs().items():
            self.rollout.setdefault(writer, JsonlTail(p))
        return {w: t.poll() for w, t in self.rollout.items()}

    def render(self, now: float) -> tuple[str, int]:
        """The text of one view and what it implies: 0 finished, 1 stopped unfinished, -1 running."""
        done = read_trainer_done(self.rd)
        m = self.metrics.poll()
        jobs = self.jobs(now)
        stopped = done is None and bool(jobs) and not any(j.alive for j in jobs)
        lines = [f"hpcrl status  {self.rd.root}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}"]
        if self.knobs:
            lines.append("run: " + self.knobs.describe())
        lines += self.notes
        lines += [_progress(m, self.knobs, done, stopped), ""]
        committed = self.committed()
        lines += (self._job_lines(jobs, m, committed) + self._fleet_lines() + [""] + self._group_lines(m, committed)
                  + self._eval_lines()
                  + self._problem_lines() + self._disk_lines(now))
        fatal = read_fatal(self.rd)
        if fatal is not None:
            lines.append(f"run stopped by an error a restart would repeat: {fatal}")
        if done is not None:
            lines.append(f"run finished: {done.trainer_step} updates, version {done.param_version}, "
                         f"{done.consumed_groups} groups consumed")
            return "\n".join(lines), 0
        if stopped:
            lines.append(f"run stopped before finishing: no job alive and no {self.rd.trainer_done.name}; "
                         f"resume with `hpcrl run --resume --run-dir {self.rd.root}`")
            return "\n".join(lines), 1
        return "\n".join(lines), -1

    def _fleet_lines(self) -> list[str]:
        """The rollout fleet when it changed during the run: writers in it, draining, preempted (waiting to be
        requeued) and those that left; then the fleet over time (:mod:`hpcrl.analysis.fleet`) when it changed or
        has several writers."""
        book = read_claims(self.rd)
        draining = drained_writers(self.rd)
        preempted = sorted(w for job, beat in read_heartbeats(self.rd).items()
                           if (w := RunDir.writer_of_job(job)) is not None and beat.state == HeartbeatState.PREEMPTED)
        lines = []
        if book is not None and (book.left or draining or preempted):
            members = sorted(book.claims)
            line = f"fleet: {len(members)} writer(s) joined ({' '.join(members)})"
            if draining - set(book.left):
                line += f"; draining: {' '.join(sorted(draining - set(book.left)))}"
            if preempted:
                line += f"; preempted (waiting to be requeued): {' '.join(preempted)}"
            left = [f"{w} ({x.why}, {x.released} prompts handed back)" for w, x in sorted(book.left.items())]
            lines.append(line + (f"; left: {', '.join(left)}" if left else ""))
        return lines + fleet_status_lines(fleet_history(self.rd, stale_s=self.stale_s))

    def _job_lines(self, jobs: list[JobView], m: list[dict], committed: dict[str, int]) -> list[str]:
        """One line per job (plus a line explaining a STALE or GONE flag)."""
        if not jobs:
            return ["(no heartbeat yet: jobs pending or starting)"]
        ro = self.rollout_rows()
        last = m[-1] if m else {}
        lines = [f"{'job':<14}{'state':<22}{'version':>8}  {'heartbeat':>12}  {'idle':>5}  detail"]
        for j in jobs:
            age = f"{j.age_s:.1f}s ago" if j.age_s < 600 else f"{j.age_s / 60:.0f}min ago"
            writer = RunDir.writer_of_job(j.job)
            if j.job == EVAL_JOB:
                idle, detail = math.nan, _eval_detail(j)
            elif RunDir.reward_index(j.job) is not None:  # a reward job (hpcrl/reward/job.py)
                idle = _num(j.stats.idle_ratio)
                detail = f"{j.stats.items_scored or 0} responses scored"
            elif writer is None:
                if last:  # the heartbeat file is rewritten every few seconds; the metrics row is newer
                    published = _num(last.get(M.PARAM_SYNC_S)) > 0
                    j.version = max(j.version, int(_num(last.get("param_version"), -1)) + int(published))
                idle = _recent_trainer_idle(m)
                detail = (f"update {last.get('step', 0)}, {last.get('consumed_groups', 0)} groups consumed"
                          + _memory_detail(last) if last else "no update logged yet")
            else:
                rows = ro.get(writer, [])
                idle = _num(rows[-1].get(M.ROLLOUT_IDLE_RATIO)) if rows else math.nan
                tps = _num(rows[-1].get(M.TOKENS_PER_S)) if rows else math.nan
                detail = f"{committed.get(writer, 0)} groups committed" + (
                    f", {tps:.0f} tokens/s" if not math.isnan(tps) else "")
            state = j.state + (f" {j.flag}" if j.flag else "")
            idle_s = "-" if math.isnan(idle) else f"{idle:.2f}"
            if j.step:  # starting, or ended while starting: the step it is (was) in, and for how long
                detail = f"{'ended in' if has_ended(j.state) else 'step'}: {j.step} ({j.step_s:.0f}s)"
            lines.append(f"{j.job:<14}{state:<22}{'v' + str(j.version):>8}  {age:>12}  {idle_s:>5}  {detail}")
            if j.flag == "GONE":
                lines.append(f"{'':14}process {j.pid} is not running on {j.host} (killed or crashed)")
            elif j.flag == "STALE":
                lines.append(f"{'':14}no heartbeat for {j.age_s:.0f}s (> timeouts.heartbeat_stale_s={self.stale_s:g}): "
                             "dead, hung or its node is unreachable")
        lines.append(f"(idle: trainer over its last {RECENT} updates, rollout over its last finished weight version)")
        return lines

    def _group_lines(self, m: list[dict], committed: dict[str, int]) -> list[str]:
        """Groups committed / consumed / queued / in flight, and the last update's lag and reward."""
        last = m[-1] if m else {}
        consumed = int(_num(last.get("consumed_groups"), 0))
        total = sum(committed.values())
        admission = read_json_tolerant(self.rd.admission) or {}
        started = sum(int(v) for v in (admission.get("started") or {}).values())
        lines = [f"groups: committed {total} ({', '.join(f'{w} {n}' for w, n in committed.items()) or 'no writer yet'}),"
                 f" consumed {consumed}, queue {max(total - consumed, 0)}, in flight {max(started - total, 0)}"]
        if last:
            lines.append(f"last update: lag mean {_num(last.get('fully_async/lag/mean')):.2f} "
                         f"max {_num(last.get('fully_async/lag/max')):.0f}; reward {_num(last.get('reward/mean')):.3f} "
                         f"(mean of last {min(len(m), 10)}: {_mean(m[-10:], 'reward/mean'):.3f}); "
                         f"trainer {_num(last.get('throughput/tokens_per_s')):.0f} tokens/s")
        return lines


    def _eval_lines(self) -> list[str]:
        """The last validated version and its score, the best so far, skipped versions (``logs/eval.jsonl``)."""
        rows = []
        for d in self.evals.poll():
            try:
                rows.append(EvalRow.from_json(d))
            except ValueError:
                continue
        job = [r for r in rows if r.source == JOB] or rows
        done = [r for r in job if r.status == EVALUATED and r.score is not None]
        if not done:
            return ["validation: no version evaluated yet"] if job or self.knobs_eval else []
        last, best = done[-1], max(done, key=lambda r: r.score)
        skipped = sum(r.status == SKIPPED for r in job)
        return [f"validation: v{last.version} (step {last.trainer_step}) {last.score:.3f} {last.score_name}; best "
                f"{best.score:.3f} at v{best.version}; {len(done)} versions evaluated"
                + (f", {skipped} skipped (the evaluation fell behind)" if skipped else "")]

    def _disk_lines(self, now: float) -> list[str]:
        """The run directory's size and its filesystem's free space (the size measured at most once a minute)."""
        if now - self._disk[0] >= 60.0:
            size = tree_bytes(self.rd.root)
            free, total = free_bytes(self.rd.root)
            self._disk = (now, f"disk: run directory {size_text(size)}; {size_text(free)} free of {size_text(total)} "
                               "on its filesystem")
        return [self._disk[1]]

    def _problem_lines(self) -> list[str]:
        """Reward errors, tool errors and filtered prompts per writer (only when there are any)."""
        found = [tally(w, rows) for w, rows in self.rollout_rows().items()]
        found = [p for p in found if p.any]
        return ["problems: " + found[0].line()] + [f"          {p.line()}" for p in found[1:]] if found else []


def _eval_detail(j: JobView) -> str:
    """The evaluation job's line: its last version and score, what it evaluates now."""
    st = j.stats
    last = f"last v{st.last_version} {st.score:.3f}" if st.score is not None else "nothing evaluated yet"
    if st.evaluating_now is not None:
        return f"{last}; evaluating v{st.evaluating_now} ({st.prompts_done or 0}/{st.prompts or 0} prompts)"
    return last


def _memory_detail(row: dict) -> str:
    """The last update's peak memory (verl's perf/* metrics): GPU where it ran on one, else the host's."""
    gpu, host = _num(row.get(M.MAX_MEMORY_ALLOCATED_GB), 0.0), _num(row.get(M.CPU_MEMORY_USED_GB), math.nan)
    if gpu > 0:
        return f", peak {gpu:.1f} GiB GPU ({_num(row.get(M.MAX_MEMORY_RESERVED_GB), 0.0):.1f} reserved)"
    return "" if math.isnan(host) else f", peak {host:.1f} GiB host"


def _num(value, default: float = math.nan) -> float:
    """A number from a log row, or ``default`` when an older or torn row lacks it."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else float("nan")


def _recent_trainer_idle(m: list[dict]) -> float:
    rows = m[-RECENT:]
    wait = sum(_num(r.get(M.WAIT_SAMPLES_S)) for r in rows)
    total = wait + sum(_num(r.get(M.UPDATE_S)) + _num(r.get(M.PARAM_SYNC_S)) for r in rows)
    return wait / total if total > 0 else math.nan  # NaN also when an older log lacks a part


def _progress(m: list[dict], knobs: Optional[Knobs], done: Optional[TrainerDone], stopped: bool) -> str:
    step = int(m[-1].get("step", 0)) if m else 0
    if knobs is None:
        return f"trainer: {step} updates (total unknown)"
    total = knobs.total_updates
    frac = min(step / total, 1.0) if total else 0.0
    bar = "#" * int(round(frac * BAR_WIDTH)) + "." * (BAR_WIDTH - int(round(frac * BAR_WIDTH)))
    if done is not None:
        eta = "done"
    elif stopped:
        eta = "stopped (no job alive)"
    else:
        recent = m[-RECENT:]
        per_update = (_num(recent[-1].get("time_s")) - _num(recent[0].get("time_s"))) / (len(recent) - 1) \
            if len(recent) >= 2 else math.nan
        eta = "ETA unknown (fewer than 2 timed updates)" if math.isnan(per_update) else \
            f"ETA {_duration((total - step) * per_update)} ({per_update:.2f}s per update)"
    return f"trainer [{bar}] {step}/{total} updates {100 * frac:3.0f}%  {eta}"


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    mnt, s = divmod(rem, 60)
    return f"{h}h{mnt:02d}m{s:02d}s" if h else f"{mnt}m{s:02d}s" if mnt else f"{s}s"


def status_main(run_dir, interval_s: float = 5.0, once: bool = False, out: Optional[TextIO] = None) -> int:
    """Print the view every ``interval_s`` until the run ends (or once); return the exit code."""
    out = out or sys.stdout
    rd = RunDir(run_dir)
    if not rd.root.is_dir() or not (rd.config_path.is_file() or rd.logs.is_dir()):
        print(f"hpcrl status: error: {rd.root} is not an hpcrl run directory (no config.yaml, no logs/)", file=sys.stderr)
        return 2
    notes: list[str] = []
    cfg = read_config_leniently(rd, notes)
    view = StatusView(rd, cfg.knobs if cfg else None,
                      cfg.timeouts.heartbeat_stale_s if cfg else 60.0, [f"note: {n}" for n in notes],
                      knobs_eval=bool(cfg and cfg.eval.enabled))
    clear = out.isatty() and not once
    while True:
        text, code = view.render(time.time())
        if clear:
            out.write("\033[H\033[J")
        out.write(text + "\n")
        if not once and not clear and code < 0:
            out.write(f"--- next view in {interval_s:g}s ---\n")
        out.flush()
        if code >= 0:
            return code
        if once:
            return 0
        time.sleep(interval_s)

