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


class Job:
    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "hpcrl", *args], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, cwd=REPO)
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


def start_trainer(rd) -> Job:
    return Job(["trainer", str(rd.root)], rd.root / "trainer.out")


def start_rollout(rd, rank: int = 0) -> Job:
    return Job(["rollout", str(rd.root), "--writer-rank", str(rank)], rd.root / f"rollout{rank}.out")


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1, jobs: tuple = ()):
    """Poll ``predicate``; fail at once if one of ``jobs`` exits meanwhile."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        for job in jobs:
            if job.proc.poll() is not None:
                raise AssertionError(f"job {job.proc.args[3:]} exited ({job.proc.returncode}) while waiting for "
                                     f"{what}:\n{job.tail()}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


_JOBS: list = []


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
    """Manifests vs staleness log: every committed group before the trainer's final
    cursor was consumed exactly once, none after it; no prompt index was skipped."""
    from hpcrl.fsio import read_json, read_jsonl
    from hpcrl.logs import read_staleness

    st = read_staleness(rd)
    assert len(st) > 0
    dups = st.sample_id[st.sample_id.duplicated()]
    assert dups.empty, f"trajectories consumed twice: {list(dups[:5])}"
    consumed = set(st.group_id)
    done = read_json(rd.trainer_done)
    assert done is not None, "trainer did not finish"
    before, after = set(), set()
    for writer in rd.writers():
        pos = done["cursor"].get(writer, {"line": 0, "row": 0})
        lines = list(read_jsonl(rd.shard_manifest(writer)))
        for li, line in enumerate(lines):
            for row, p in enumerate(line["prompt_indices"]):
                gid = f"{writer}/{p}"
                (before if (li, row) < (pos["line"], pos["row"]) else after).add(gid)
        committed = sorted(p for line in lines for p in line["prompt_indices"])
        assert len(committed) == len(set(committed)), f"{writer} committed a prompt twice"
        W = rd.load_config().resources.rollout_jobs
        top = committed[-1] - max_in_flight * W  # the last few in flight at the end may be abandoned
        missing = sorted(set(range(int(writer[1:]), top, W)) - set(committed))
        assert not missing, f"{writer} skipped prompts {missing[:10]}"
    assert consumed == before, (f"consumed but not before the cursor: {sorted(consumed - before)[:5]}; "
                                f"before the cursor but never consumed: {sorted(before - consumed)[:5]}")
    assert not (consumed & after)
    return {"consumed_groups": len(consumed), "unconsumed_after_cursor": len(after)}
