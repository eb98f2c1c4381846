"""No silent hang at start-up: every start-up step shows in the heartbeat and `hpcrl status` and has a
deadline; DeepSpeed's op build can neither leave a lock that hangs later trainers nor orphaned compilers."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, check_exactly_once, start_rollout, start_trainer, wait_until
from hpcrl.control.records import Heartbeat, HeartbeatState
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.rundir.paths import RunDir


def beat(rd: RunDir, job: str) -> dict:
    return json.loads(rd.heartbeat(job).read_text())


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_a_start_up_step_past_its_deadline_ends_the_job_in_one_line_naming_it(tiny_run, role):
    """The fault hook makes a start-up step sleep (the trainer: joining its ranks; the rollout job: loading its
    tokenizer, prompts and reward); the job ends within the deadline plus a moment, failed, with the step in its
    heartbeat and in one log line."""
    rd = tiny_run("timeouts.job_start_s=4")
    env = {"HPCRL_FAULT_POINT": "startup:2:sleep=300" if role == "trainer" else "startup:1:sleep=300"}
    job = start_trainer(rd, env=env) if role == "trainer" else start_rollout(rd, env=env)
    t0 = time.monotonic()
    assert job.wait(90) != 0
    took = time.monotonic() - t0
    out = job.log_path.read_text()
    name = RunDir.trainer_job() if role == "trainer" else RunDir.rollout_job("w000")
    step = "joining the other trainer ranks (1 in all)" if role == "trainer" else "loading the tokenizer, prompts and reward"
    lines = [x for x in out.splitlines() if "did not finish in" in x]
    assert len(lines) == 1 and f"start-up step '{step}'" in lines[0], out[-3000:]
    hb = beat(rd, name)
    assert hb["state"] == "failed" and hb["step"] == step, hb
    assert took < 45, f"{took:.0f}s"


def test_status_shows_a_starting_job_with_its_step_and_how_long(tiny_run):
    from hpcrl.cli import main

    rd = tiny_run()
    rd.heartbeats.mkdir(parents=True, exist_ok=True)
    now = time.time()
    write_json_atomic(rd.heartbeat("trainer"), Heartbeat(
        job="trainer", role="trainer", host="elsewhere", pid=1, time_s=now, state=HeartbeatState.STARTING.value,
        step="building DeepSpeed's ops", step_started_s=now - 42).to_json())
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["status", str(rd.root), "--once"])
    line = next(x for x in out.getvalue().splitlines() if x.startswith("trainer ") and "starting" in x)
    took = re.search(r"step: building DeepSpeed's ops \((\d+)s\)", line)
    assert took and 42 <= int(took.group(1)) <= 44, line  # 42 s when written, plus the command's own start-up


@pytest.mark.parametrize("state", ["failed", "stopped"])
def test_status_shows_the_step_a_job_ended_in_and_how_long_it_took_not_the_time_since(tiny_run, state):
    """A job that failed while loading its model (or was cancelled then) ended 3 s into that step; an hour later
    ``hpcrl status`` still says 3 s, not an hour."""
    from hpcrl.cli import main

    rd = tiny_run()
    rd.heartbeats.mkdir(parents=True, exist_ok=True)
    ended = time.time() - 3600
    write_json_atomic(rd.heartbeat("rollout-w000"), Heartbeat(
        job="rollout-w000", role="rollout", host="elsewhere", pid=1, time_s=ended, state=state,
        step="starting the transformers engine", step_started_s=ended - 3).to_json())
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["status", str(rd.root), "--once"])
    line = next(x for x in out.getvalue().splitlines() if x.startswith("rollout-w000 "))
    assert state in line and line.endswith("ended in: starting the transformers engine (3s)"), line


def _ops_folder() -> Path:
    """The node's extensions folder the jobs of the suite use (what ``install.sh`` builds into)."""
    out = subprocess.run([sys.executable, "-c", "from hpcrl.trainer.ops import extensions_dir; "
                          "print(extensions_dir())"], capture_output=True, text=True, cwd=REPO, check=True)
    return Path(out.stdout.strip().splitlines()[-1])  # DeepSpeed prints its accelerator first


@pytest.mark.slow
def test_a_stale_op_build_lock_is_removed_and_the_run_finishes(tiny_run, tmp_path):
    """A lock file as a build killed mid-way leaves it, in the folder the trainer uses: torch would wait for it
    forever; the trainer removes it, says so, and the run finishes. The folder is a copy of the node's built ops
    (times kept: still up to date, nothing is built): in the node's own, a background run's trainer starting at
    the same moment removed the lock first (and said so in its own log)."""
    rd = tiny_run("rollout.total_rollout_steps=24")
    folder = tmp_path / "ops"
    shutil.copytree(_ops_folder(), folder, ignore=shutil.ignore_patterns("*.lock", "lock"))
    lock = folder / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    trainer = start_trainer(rd, env={"TORCH_EXTENSIONS_DIR": str(folder)})
    rollout = start_rollout(rd)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    assert f"removed {lock}" in trainer.log_path.read_text()
    assert not lock.exists()


def _compilers_in(folder: Path) -> list[str]:
    """Processes working in ``folder`` (ninja and the compilers it runs there)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "cwd").startswith(str(folder)):
                    out.append(f"{p.name} {(p / 'comm').read_text().strip()}")
            except OSError:
                continue
    return out


@pytest.mark.slow
def test_a_trainer_killed_during_its_first_op_build_leaves_no_compiler_and_its_restart_finishes(tiny_run, tmp_path):
    folder = tmp_path / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(folder)}
    rd = tiny_run("rollout.total_rollout_steps=24")
    trainer = start_trainer(rd, env=env)
    wait_until(lambda: any(" cc1plus" in c or " c++" in c for c in _compilers_in(folder)), 120,
               "the op's compiler to run", jobs=(trainer,))
    trainer.kill(signal.SIGKILL)
    wait_until(lambda: not _compilers_in(folder), 15, "the build's processes to end with the trainer")
    assert (folder / "deepspeed_shm_comm" / "lock").exists(), "torch's lock is left behind, as a SIGKILL leaves it"
    trainer, rollout = start_trainer(rd, env=env), start_rollout(rd)
    assert trainer.wait(600) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    assert "removed " in trainer.log_path.read_text() and not _compilers_in(folder)
    assert f"building DeepSpeed's op {OP} in {folder} because it is not built yet" in trainer.log_path.read_text()
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
    again = subprocess.run([sys.executable, "-c", LOAD_OPS], cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**os.environ, **env})  # the next start: the op is ready
    assert again.returncode == 0 and "building DeepSpeed's op" not in again.stdout + again.stderr, again
    assert float(re.search(r"op step ([\d.]+)s", again.stdout).group(1)) < 5, again.stdout


OP = "deepspeed_shm_comm"
LOAD_OPS = ("import time; from hpcrl.trainer.ops import ops_to_build, prepare_ops; b = ops_to_build()[0]; "
            "t0 = time.monotonic(); prepare_ops(600); took = time.monotonic() - t0; "
            "assert b.load() is not None; print(f'op step {took:.2f}s')")
"""The trainer's op step in a fresh process (``trainer/main.py``: ``prepare_ops``), then DeepSpeed's own load as its
``init_distributed`` calls it; prints how long the step took."""


def _installed_copy(tmp_path: Path) -> Path:
    """A copy of the node's built ops (the folder ``install.sh`` built), ready by ``hpcrl build-ops``' rule."""
    folder = tmp_path / "torch_extensions"
    shutil.copytree(_ops_folder(), folder, symlinks=True, ignore=shutil.ignore_patterns("*.lock", "lock"))
    ready = subprocess.run([sys.executable, "-m", "hpcrl", "build-ops"], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}, timeout=900)
    assert ready.returncode == 0 and "DeepSpeed ops ready" in ready.stdout, ready.stdout + ready.stderr
    return folder


def _as_a_cancelled_build_leaves_it(op: Path) -> None:
    """``shm.o`` written after ninja recorded it, as a compiler that outlived its cancelled build writes it: ninja
    would compile again (what a user's trainer did at every start of a session, for 2-3 minutes)."""
    later = time.time() + 5
    os.utime(op / "shm.o", (later, later))
    ninja = Path(sys.executable).parent / "ninja"
    explain = subprocess.run([str(ninja) if ninja.exists() else "ninja", "-n", "-d", "explain"], cwd=op,
                             capture_output=True, text=True)
    assert "stored deps info out of date for 'shm.o'" in explain.stdout + explain.stderr, explain


@pytest.mark.slow
def test_an_op_build_ops_calls_ready_is_loaded_at_start_without_a_compiler(tmp_path):
    folder = _installed_copy(tmp_path)
    op = folder / OP
    _as_a_cancelled_build_leaves_it(op)
    built = {p.name: p.stat().st_mtime_ns for p in op.iterdir()}
    res = subprocess.run([sys.executable, "-c", LOAD_OPS], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)})
    assert res.returncode == 0, res.stdout + res.stderr
    took = float(re.search(r"op step ([\d.]+)s", res.stdout).group(1))
    assert "building DeepSpeed's op" not in res.stdout + res.stderr and took < 5, res.stdout + res.stderr
    now = {p.name: p.stat().st_mtime_ns for p in op.iterdir()}
    assert now == built, "nothing in the op's folder was compiled or written again"


@pytest.mark.slow
def test_ctrl_c_during_an_op_rebuild_leaves_no_compiler_running_after_hpcrl_run(tmp_path):
    """A rebuild (here: the record of the last build is gone, as a cancelled build leaves the folder) runs in the
    killable build session with one line saying why; Ctrl-C to ``hpcrl run`` meanwhile ends every compiler before
    ``hpcrl run`` exits, and the cancelled build is not recorded as ready."""
    folder = _installed_copy(tmp_path)
    op = folder / OP
    (op / "hpcrl-built.json").unlink()
    _as_a_cancelled_build_leaves_it(op)
    rd = RunDir(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "tiny.yaml"), "--run-dir",
                             str(rd.root), "--executor", "local"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)})
    try:
        wait_until(lambda: any(" cc1plus" in c for c in _compilers_in(op)) or proc.poll() is not None, 300,
                   "the op's compiler to run")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=300)
        left = _compilers_in(op)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"still running after hpcrl run exited: {left}"
    assert proc.returncode == 130, out[-3000:]
    log = rd.job_log("trainer").read_text()
    assert (f"building DeepSpeed's op {OP} in {folder} because no record of a finished build" in log), log[-3000:]
    assert not (op / "hpcrl-built.json").exists(), "a cancelled build is built again at the next start"
