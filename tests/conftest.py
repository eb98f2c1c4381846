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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

# CUDA's tensor rules on CPU, here and in every job a test starts (tests/cuda_rules/cuda_rules.py)
_CUDA_RULES = str(Path(__file__).resolve().parent / "cuda_rules")
sys.path.insert(0, _CUDA_RULES)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_CUDA_RULES, os.environ.get("PYTHONPATH")) if p)
import cuda_rules  # noqa: E402

cuda_rules.install()

from hpcrl.config import load_config  # noqa: E402
from hpcrl.launcher.prepare import prepare_run_dir  # noqa: E402
from hpcrl.launcher.submit import JOB_PYTHON_ENV, job_python  # noqa: E402
from hpcrl.process.environment import environment_restored  # noqa: E402
from hpcrl.trainer.ops import node_extensions_dir  # noqa: E402
from preloaded import Preloaded  # noqa: E402

# DeepSpeed's built ops in the folder the trainer uses (install.sh builds it), for every process of the session: the
# peers and in-process tests that start DeepSpeed themselves would otherwise build them into torch's own folder
# (30 CPU-s on a fresh CI machine). A test of the build itself sets its own (tests/test_startup.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(node_extensions_dir()))

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
                 base_env: dict | None = None, prefix: tuple[str, ...] = (), killed_after_the_test: bool = True,
                 program: tuple[str, ...] | None = None, new_session: bool = False):
        self.args = list(args)
        """The job's own arguments (``trainer RUN``, ...), whichever way it is started."""
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = dict(os.environ if base_env is None else base_env, PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [sys.executable, str(WRAPPER)] if wrapped else [sys.executable, "-m", "hpcrl"]
        if program is not None:  # ARGS are a whole command line of their own
            cmd = list(program)
        argv = [*cmd, *args]
        server = _preloaded()
        self.proc = server.start(argv, env, REPO, log_path, new_session, prefix == LOWEST_PRIORITY,
                                 prefixed=prefix not in ((), LOWEST_PRIORITY)) if server is not None else None
        if self.proc is None:  # cold: a command the preloaded server must not fork
            self.proc = subprocess.Popen([*prefix, *argv], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO, start_new_session=new_session)
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


_PRELOADED: list = []


def _preloaded() -> Preloaded | None:
    """The session's preloaded server (tests/preloaded.py; fixture ``preloaded``), None outside a session or with
    ``HPCRL_TEST_COLD_JOBS=1``."""
    return _PRELOADED[0] if _PRELOADED else None


def python() -> str:
    """The Python for a command a test starts itself (``python -m hpcrl run ...``): what the jobs run, in the session
    ``HPCRL_PYTHON``, whose command the preloaded server forks where that cannot change it (``preloaded.as_python``)."""
    return job_python()


def start_trainer(rd, **kw) -> Job:
    return Job(["trainer", str(rd.root)], rd.root / "trainer.out", **kw)


def start_rollout(rd, rank: int = 0, **kw) -> Job:
    return Job(["rollout", str(rd.root), "--writer-rank", str(rank)], rd.root / f"rollout{rank}.out", **kw)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1, jobs: tuple = (),
               describe: Callable[[], str] | None = None):
    """Poll ``predicate``; fail at once if one of ``jobs`` exits meanwhile. ``describe``: what the failure message
    adds on a timeout (the state of what was waited for)."""
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
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}" + (f":\n{describe()}" if describe else ""))


_JOBS: list = []


LOWEST_PRIORITY = ("sh", "-c", 'echo 19 > /proc/self/autogroup 2>/dev/null; exec "$@"', "sh",
                   "ionice", "-c", "3", "nice", "-n", "19")
"""All three exec the next program: the job's pid is the Python process's. Started in a session of its own (a new
scheduler autogroup where the kernel has them, as here), the autogroup itself is given nice 19: nice alone orders
processes within one autogroup only, so a background run niced 19 still took an equal share of the cores against the
jobs a test starts in sessions of their own (Slurm's, submitit's), about half of them."""
PATIENT = ["timeouts.wait_samples_s=1800", "timeouts.wait_weights_s=1800", "timeouts.heartbeat_stale_s=1800",
           "timeouts.job_start_s=1800"]
"""A background run's jobs may get no CPU for minutes while the suite runs: none of their waits may end them."""


@dataclass
class BackgroundCommand:
    """A background run that is one command: ``prepare(folder)`` writes its inputs into an empty folder before the
    first test and returns its command line; its own limits must allow for a starved run. ``hpcrl_args`` (a
    launch like a user's, ``python -m hpcrl ARGS``) builds the usual one, with the patient timeouts."""

    prepare: Callable[[Path], list[str]]

    @staticmethod
    def hpcrl_args(prepare: Callable[[Path], list[str]]) -> "BackgroundCommand":
        return BackgroundCommand(lambda folder: [sys.executable, "-m", "hpcrl", *prepare(folder), *PATIENT])


class BackgroundRuns:
    """Learning runs whose tests only read the finished run, started when the session starts, ``width`` at a time,
    at the lowest CPU and I/O priority (nice 19, idle I/O class): they take the cores the rest of the suite leaves
    idle (tests waiting on Slurm, on a deadline, on the other job of an on-policy pair) and barely slow it (the
    kernel gives a nice-19 process ~1.5% of a core another process wants). Their tests run last
    (``pytest_collection_modifyitems``), so most runs have finished by then. A test module takes part by defining
    ``BACKGROUND_RUNS`` (run key -> overrides of a trainer + rollout pair, or a :class:`BackgroundCommand`; the
    commands start first, then the pairs in :meth:`_pair_order`: a long run started last kept the suite's last
    minutes at one busy core) and
    ``background_keys(item)`` (the keys of the runs a test item reads; none: it is not one of them).

    Every run directory is prepared before the first test (``prepare_run_dir`` seeds torch's global generator, so
    never beside a running test), and jobs get the environment of that moment (a test's ``monkeypatch.setenv`` must
    not reach them)."""

    def __init__(self, folder: Path, runs: dict[str, list[str] | BackgroundCommand], width: int = 2):
        self.width = width
        self._env = dict(os.environ)
        self._ready = {key: self._prepare(folder.joinpath(*key.split(":")), run) for key, run in runs.items()}
        self._pending = sorted(runs, key=lambda key: (0, False, 0) if isinstance(runs[key], BackgroundCommand) else
                               self._pair_order(self._ready[key].load_config()))
        self.started: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep_width_going, name="background-runs", daemon=True)
        self._thread.start()

    @staticmethod
    def _pair_order(cfg) -> tuple:
        """Pairs with a vLLM engine first (an engine start costs a starved run ~20-40 CPU-s: partial rollout's 30
        vLLM updates, started last, ran alone for the suite's last ~100 s), then those with the most updates."""
        return 1, cfg.rollout.engine != "vllm", -cfg.total_updates

    @staticmethod
    def _prepare(folder: Path, run: list[str] | BackgroundCommand):
        """A prepared run directory (a job pair), or (the command line, its log's path)."""
        if isinstance(run, BackgroundCommand):
            folder.mkdir(parents=True)
            return run.prepare(folder), folder / "command.out"
        return make_run(folder.parent, *run, *PATIENT, name=folder.name)

    def _start(self, key: str) -> None:
        ready = self._ready[key]
        background = dict(base_env=self._env, prefix=LOWEST_PRIORITY, killed_after_the_test=False,  # they outlive it
                          new_session=True)
        if isinstance(ready, tuple):
            args, log = ready
            jobs = (Job(args, log, program=(), **background),)
        else:
            jobs = (Job(["trainer", str(ready.root)], ready.root / "trainer.out", **background),
                    Job(["rollout", str(ready.root), "--writer-rank", "0"], ready.root / "rollout0.out", **background))
        self._pending.remove(key)
        self.started[key] = (ready, *jobs)

    def _keep_width_going(self) -> None:
        """Start the next pending run whenever fewer than ``width`` are running; ends when all have started."""
        while not self._closed.wait(0.5):
            with self._lock:
                if self._closed.is_set() or not self._pending:
                    return
                running = sum(1 for _, *jobs in self.started.values() if any(j.proc.poll() is None for j in jobs))
                for key in self._pending[:max(self.width - running, 0)]:
                    self._start(key)

    def finish(self, key: str, trainer_s: float = 300, rollout_s: float = 120):
        """Wait for both of ``key``'s jobs to end with 0 (starting them now if they have not started); its run
        directory. The deadlines count from now, when the run has the cores to itself."""
        rd, trainer, rollout = self._started(key)
        assert trainer.wait(trainer_s) == 0, trainer.tail()
        assert rollout.wait(rollout_s) == 0, rollout.tail()
        return rd

    def launched(self, key: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """Wait for the :class:`BackgroundCommand` ``key`` to end: its exit status and output
        (stdout and stderr together, in ``stdout``)."""
        _, launcher = self._started(key)
        code = launcher.wait(timeout_s)
        return subprocess.CompletedProcess(launcher.proc.args, code, launcher.log_path.read_text(errors="replace"), "")

    def _started(self, key: str) -> tuple:
        with self._lock:
            if key not in self.started:
                self._start(key)
            return self.started[key]

    def close(self) -> None:
        """SIGTERM to whatever still runs (a launcher stops its own jobs then), SIGKILL after 30 s."""
        with self._lock:
            self._closed.set()
        jobs = [job for _, *pair in self.started.values() for job in pair if job.proc.poll() is None]
        for job in jobs:
            job.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 30
        for job in jobs:
            try:
                job.proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                job.kill()


def pytest_terminal_summary(terminalreporter):
    """How many of the session's jobs were forked by the preloaded server, and why the others started cold."""
    if _PRELOADED_SUMMARY and _PRELOADED_SUMMARY[0]:
        terminalreporter.write_line(_PRELOADED_SUMMARY[0])


_PRELOADED_SUMMARY: list[str] = []


def _reads_background_runs(item) -> tuple[str, ...]:
    module = getattr(item, "module", None)
    return tuple(module.background_keys(item)) if hasattr(module, "background_keys") else ()


def pytest_collection_modifyitems(session, config, items):
    """The tests that read background runs go last (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: bool(_reads_background_runs(item)))


@pytest.fixture(scope="session", autouse=True)
def preloaded(tmp_path_factory):
    """The session's :class:`~preloaded.Preloaded` server, started first, with the session's environment: it
    imports while the first tests run, and forks the jobs tests start."""
    if os.environ.get("HPCRL_TEST_COLD_JOBS") == "1":
        yield None
        return
    server = Preloaded(tmp_path_factory.mktemp("preloaded"))
    _PRELOADED.append(server)
    with environment_restored():
        os.environ[JOB_PYTHON_ENV] = str(server.python)  # the jobs a launcher starts are forked too
        yield server
    _PRELOADED.clear()
    server.close()
    _PRELOADED_SUMMARY.append(server.summary())


@pytest.fixture(scope="session", autouse=True)
def background_runs(request, tmp_path_factory, preloaded):
    """The session's :class:`BackgroundRuns`, started before the first test (None when no test reads one)."""
    runs = {key: item.module.BACKGROUND_RUNS[key] for item in request.session.items
            for key in _reads_background_runs(item)}  # in the order their tests run
    if not runs:
        yield None
        return
    runs = BackgroundRuns(tmp_path_factory.mktemp("background"), runs)
    yield runs
    runs.close()


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
            "skipped_groups": a.skipped_groups, "not_trained": a.not_trained}


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
