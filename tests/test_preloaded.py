"""The session's stand-in ``python`` (tests/preloaded.py ``as_python``, the suite's ``HPCRL_PYTHON``) behaves as the
real one towards whoever started it: the signals it gets reach the job, the job's exit status is its own, and the
job does not outlive it."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from preloaded import autogroup_nice

JOB = '''
import os, signal, sys, time
signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(7))  # handled, although ignored where it started
print(os.getpid(), flush=True)
time.sleep(60)
'''


@pytest.fixture
def stand_in(preloaded, tmp_path):
    if preloaded is None:
        pytest.skip("HPCRL_TEST_COLD_JOBS=1: no preloaded server")
    (tmp_path / "job.py").write_text(JOB)
    return lambda **kw: subprocess.Popen([str(preloaded.python), str(tmp_path / "job.py")], stdout=subprocess.PIPE,
                                         text=True, **kw)


def _job_pid(proc) -> int:
    pid = int(proc.stdout.readline())
    assert pid != proc.pid, "the job is forked by the server, not run by the stand-in"
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1].endswith(b"job.py"), "ps shows the job's own"
    return pid


def test_a_signal_ignored_where_the_stand_in_started_reaches_a_job_that_handles_it(stand_in):
    proc = stand_in(preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # a shell's `cmd &`
    _job_pid(proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 7


def test_the_job_s_death_by_a_signal_is_the_stand_in_s_and_a_killed_stand_in_takes_its_job_along(stand_in):
    proc = stand_in()
    _job_pid(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    proc = stand_in()
    pid = _job_pid(proc)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    wait_until(lambda: _ended(pid), 10, f"the job {pid} of a SIGKILLed stand-in to be SIGKILLed by the server")


def _ended(pid: int) -> bool:
    try:
        return b"(zombie)" in Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return True


def test_the_autogroup_file_is_read_as_the_kernel_writes_it_also_empty():
    """CI's container reads ``/proc/self/autogroup`` as empty (its processes are in no autogroup): the stand-in then
    asks its own nice value (CI's first stand-in failed here with an IndexError)."""
    assert autogroup_nice("/autogroup-2035 nice 19\n") == 19
    assert autogroup_nice("/autogroup-7 nice -5\n") == -5
    assert autogroup_nice("") is None


PATHS = '''
import sys
import extra_module  # from the job's own PYTHONPATH
print(repr(sys.path[1:]), flush=True)
'''


def test_a_job_with_its_own_pythonpath_and_shell_variables_is_forked_with_the_sys_path_a_cold_start_has(
        preloaded, tmp_path):
    """What ``bench/gpu_check.sh`` starts: its PYTHONPATH, a shell's SHLVL and ``_``, its GPU_CHECK_ settings; a
    PYTHONPATH without the session's sitecustomize, or with a folder holding a preloaded package (another torch),
    starts the job cold."""
    if preloaded is None:
        pytest.skip("HPCRL_TEST_COLD_JOBS=1: no preloaded server")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "extra_module.py").write_text("")
    (tmp_path / "job.py").write_text(PATHS)
    env = dict(os.environ, PYTHONPATH=f"{extra}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               SHLVL="3", _="/usr/bin/env", GPU_CHECK_E2E_UPDATES="6")
    decisions = Path(preloaded.path + ".started")  # the server's line per request: forked, or why cold

    def job(env: dict, python: str = str(preloaded.python)) -> tuple[str, str]:
        """The job's output, and the server's decision (timeout: the server kept the caller's pipes open once)."""
        out = subprocess.run([python, str(tmp_path / "job.py")], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout, decisions.read_text().splitlines()[-1]

    forked, decision = job(env)
    assert decision == "forked"
    assert forked == job(env, sys.executable)[0], "sys.path as a cold start's"
    assert job(dict(env, PYTHONPATH=str(extra)))[1] == "environment differs in PYTHONPATH", "not the session's " \
        "sitecustomize (CUDA's rules)"
    (extra / "torch").mkdir()
    assert job(env)[1] == "environment differs in PYTHONPATH", "another torch on the path"
