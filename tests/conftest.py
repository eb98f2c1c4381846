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
import threading
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

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, wrapped: bool = False,
                 base_env: dict | None = None, prefix: tuple[str, ...] = (), killed_after_the_test: bool = True):
        self.args = list(args)
        """The job's own arguments (``trainer RUN``, ...), whichever way it is started."""
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = dict(os.environ if base_env is None else base_env, PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, str(WRAPPER)] if wrapped else [sys.executable, "-m", "hpcrl"]
        self.proc = subprocess.Popen([*prefix, *cmd, *args], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO)
        if killed_after_the_test:
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


LOWEST_PRIORITY = ("ionice", "-c", "3", "nice", "-n", "19")
"""Both exec the next program: the job's pid is the Python process's."""
PATIENT = ["timeouts.wait_samples_s=1800", "timeouts.wait_weights_s=1800", "timeouts.heartbeat_stale_s=1800",
           "timeouts.job_start_s=1800"]
"""A background run's jobs may get no CPU for minutes while the suite runs: none of their waits may end them."""


class BackgroundRuns:
    """Learning runs whose tests only read the finished run, started when the session starts, ``width`` at a time,
    at the lowest CPU and I/O priority (nice 19, idle I/O class): they take the cores the rest of the suite leaves
    idle (tests waiting on Slurm, on a deadline, on the other job of an on-policy pair) and barely slow it (the
    kernel gives a nice-19 process ~1.5% of a core another process wants). Their tests run last
    (``pytest_collection_modifyitems``), so most runs have finished by then. A test module takes part by defining
    ``BACKGROUND_RUNS`` (run key -> overrides) and ``background_key(item)`` (its test item's run key, or None).

    Every run directory is prepared before the first test (``prepare_run_dir`` seeds torch's global generator, so
    never beside a running test), and jobs get the environment of that moment (a test's ``monkeypatch.setenv`` must
    not reach them)."""

    def __init__(self, folder: Path, runs: dict[str, list[str]], width: int = 2):
        self.width = width
        self._env = dict(os.environ)
        self._ready = {key: make_run(folder, *overrides, *PATIENT, name=key.replace(":", "-"))
                       for key, overrides in runs.items()}
        self._pending = list(runs)
        self.started: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep_width_going, name="background-runs", daemon=True)
        self._thread.start()

    def _start(self, key: str) -> None:
        rd = self._ready[key]
        background = dict(base_env=self._env, prefix=LOWEST_PRIORITY, killed_after_the_test=False)  # they outlive it
        jobs = (Job(["trainer", str(rd.root)], rd.root / "trainer.out", **background),
                Job(["rollout", str(rd.root), "--writer-rank", "0"], rd.root / "rollout0.out", **background))
        self._pending.remove(key)
        self.started[key] = (rd, *jobs)

    def _keep_width_going(self) -> None:
        """Start the next pending run whenever fewer than ``width`` are running; ends when all have started."""
        while not self._closed.wait(0.5):
            with self._lock:
                if self._closed.is_set() or not self._pending:
                    return
                running = sum(1 for _, t, r in self.started.values() if t.proc.poll() is None or r.proc.poll() is None)
                for key in self._pending[:max(self.width - running, 0)]:
                    self._start(key)

    def finish(self, key: str, trainer_s: float = 300, rollout_s: float = 120):
        """Wait for both of ``key``'s jobs to end with 0 (starting them now if they have not started); its run
        directory. The deadlines count from now, when the run has the cores to itself."""
        with self._lock:
            if key not in self.started:
                self._start(key)
        rd, trainer, rollout = self.started[key]
        assert trainer.wait(trainer_s) == 0, trainer.tail()
        assert rollout.wait(rollout_s) == 0, rollout.tail()
        return rd

    def close(self) -> None:
        with self._lock:
            self._closed.set()
        for _, *jobs in self.started.values():
            for job in jobs:
                job.kill()


def _background_keys(items) -> dict:
    """Run key -> (the module that defines it, its test items), in the order the items run."""
    keys: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        key = module.background_key(item) if hasattr(module, "background_key") else None
        if key is not None:
            keys.setdefault(key, (module, []))[1].append(item)
    return keys


def pytest_collection_modifyitems(session, config, items):
    """The tests that read background runs go last (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "background_key")
               and item.module.background_key(item) is not None)


@pytest.fixture(scope="session")
def background_runs(request, tmp_path_factory):
    """The session's :class:`BackgroundRuns` (started by ``_start_background_runs`` before the first test)."""
    return request.getfixturevalue("_start_background_runs")


@pytest.fixture(scope="session", autouse=True)
def _start_background_runs(request, tmp_path_factory):
    keys = _background_keys(request.session.items)
    if not keys:
        yield None
        return
    runs = BackgroundRuns(tmp_path_factory.mktemp("background"),
                          {key: module.BACKGROUND_RUNS[key] for key, (module, _) in keys.items()})
    yield runs
    runs.close()


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
