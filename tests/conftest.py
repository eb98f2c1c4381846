"""Shared helpers: a prepared run directory and real job processes.

Jobs run as real processes (``python -m hpcrl trainer|rollout RUN``) so tests
can kill them with real signals; each process's output goes to a file in the
run directory and every wait has a deadline.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.launcher.prepare import prepare_run_dir

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def make_run(tmp_path: Path, *overrides: str, name: str = "run"):
    cfg = load_config(TINY, ["timeouts.wait_samples_s=120", "timeouts.wait_weights_s=120", *overrides])
    return prepare_run_dir(cfg, tmp_path / name, resume=False)


WRAPPER = Path(__file__).resolve().parent / "fault_wrapper.py"


class Job:
    """``python -m hpcrl ARGS`` as a real process; ``env`` adds variables (e.g. a fault to inject),
    ``wrapped`` runs it through ``tests/fault_wrapper.py``."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, wrapped: bool = False):
        self.args = list(args)
        """The job's own arguments (``trainer RUN``, ...), whichever way it is started."""
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, str(WRAPPER)] if wrapped else [sys.executable, "-m", "hpcrl"]
        self.proc = subprocess.Popen([*cmd, *args], stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _JOBS.append(self)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job {self.proc.args} did not end in {timeout_s}s; log:\n{self.tail()}") from None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def start_trainer(rd, **kw) -> Job:
    return Job(["trainer", str(rd.root)], rd.root / "trainer.out", **kw)


def start_rollout(rd, rank: int = 0, **kw) -> Job:
    return Job(["rollout", str(rd.root), "--writer-rank", str(rank)], rd.root / f"rollout{rank}.out", **kw)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1, jobs: tuple = ()):
    """Poll ``predicate``; fail at once if one of ``jobs`` exits meanwhile."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        for job in jobs:
            if job.proc.poll() is not None:
                raise AssertionError(f"job {job.args} exited ({job.proc.returncode}) while waiting for "
                                     f"{what}:\n{job.tail()}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


_JOBS: list = []


class RunsAhead:
    """The learning runs of one parametrized test, started two at a time: the test of run K starts K's jobs and
    those of the next selected run, then waits for K's; the next test finds its run well on. On 2 cores two
    runs take ~0.6 of their time one after the other (on-policy jobs wait on each other half the time). Each
    run's assertions stay in its own test; its jobs outlive the test that started them and are killed when the
    module ends (``close``)."""

    def __init__(self, folder: Path, runs: dict[str, list[str]], selected: list[str]):
        self.folder, self.runs = folder, runs
        self.order = [k for k in runs if k in selected]
        """The runs this session's tests ask for, in the order they run."""
        self.started: dict[str, tuple] = {}

    def _start(self, key: str) -> None:
        rd = make_run(self.folder, *self.runs[key], name=key)
        jobs = (start_trainer(rd), start_rollout(rd))
        for job in jobs:  # not the autouse fixture's: they outlive the test that starts them
            _JOBS.remove(job)
        self.started[key] = (rd, *jobs)

    def finish(self, key: str, trainer_s: float = 300, rollout_s: float = 120):
        """Start ``key`` (if not yet) and the run after it, wait for both of ``key``'s jobs to end with 0; its
        run directory."""
        at = self.order.index(key) if key in self.order else len(self.order)
        for k in [key, *self.order[at + 1:at + 2]]:
            if k not in self.started:
                self._start(k)
        rd, trainer, rollout = self.started[key]
        assert trainer.wait(trainer_s) == 0, trainer.tail()
        assert rollout.wait(rollout_s) == 0, rollout.tail()
        return rd

    def close(self) -> None:
        for _, *jobs in self.started.values():
            for job in jobs:
                job.kill()


def selected_params(request, test_name: str, argname: str) -> list:
    """The values of ``argname`` that this session's collected items of ``test_name`` take, in order."""
    return [item.callspec.params[argname] for item in request.session.items
            if getattr(item, "originalname", None) == test_name and argname in getattr(item, "callspec", {}).params]


@pytest.fixture(autouse=True)
def _kill_leftover_jobs():
    """A failed test must not leave job processes running into the next one."""
    yield
    while _JOBS:
        _JOBS.pop().kill()


@pytest.fixture
def tiny_run(tmp_path):
    return lambda *overrides, name="run": make_run(tmp_path, *overrides, name=name)


def check_exactly_once(rd, max_in_flight: int) -> dict:
    """Manifests vs staleness log (:mod:`hpcrl.analysis.exactly_once`): every prompt index
    trained on exactly once, even one whose first commit was in a shard the trainer skipped;
    every committed group before the trainer's final cursor consumed, none after; none lost."""
    from hpcrl.analysis.exactly_once import audit

    a = audit(rd, max_in_flight)
    assert a.consumed_groups > 0
    assert not a.problems(), f"exactly-once violated: {a.problems()}"
    return {"consumed_groups": a.consumed_groups, "unconsumed_after_cursor": a.unconsumed_after_cursor,
            "skipped_groups": a.skipped_groups}


@pytest.fixture
def veth(tmp_path):
    """A veth pair: hpcrlt0 (10.231.7.1/24) here, hpcrlt1 (10.231.7.2/24) in namespace hpcrl-t (a second
    "node"); skipped where namespaces are not allowed."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    cmds = [["ip", "netns", "add", "hpcrl-t"], ["ip", "link", "add", "hpcrlt0", "type", "veth", "peer", "name", "hpcrlt1"],
            ["ip", "link", "set", "hpcrlt1", "netns", "hpcrl-t"], ["ip", "addr", "add", "10.231.7.1/24", "dev", "hpcrlt0"],
            ["ip", "link", "set", "hpcrlt0", "up"],
            ["ip", "netns", "exec", "hpcrl-t", "ip", "addr", "add", "10.231.7.2/24", "dev", "hpcrlt1"],
            ["ip", "netns", "exec", "hpcrl-t", "ip", "link", "set", "hpcrlt1", "up"]]
    try:
        for c in cmds:
            r = subprocess.run(c, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"network namespaces are not allowed here: {' '.join(c)}: {r.stderr.strip()}")
        yield "10.231.7.2"
    finally:
        subprocess.run(["ip", "link", "del", "hpcrlt0"], capture_output=True)
        subprocess.run(["ip", "netns", "del", "hpcrl-t"], capture_output=True)
