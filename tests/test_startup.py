"""No silent hang at start-up: every start-up step shows in the heartbeat and `hpcrl status` and has a
deadline; DeepSpeed's op build can neither leave a lock that hangs later trainers nor orphaned compilers."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, check_exactly_once, start_rollout, start_trainer, wait_until
from hpcrl.control.records import Heartbeat, HeartbeatState
from hpcrl.fsio import write_json_atomic
from hpcrl.run_dir import RunDir


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
    assert "starting" in line and "step: building DeepSpeed's ops (42s)" in line, line


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
def test_a_stale_op_build_lock_is_removed_and_the_run_finishes(tiny_run):
    """A lock file as a build killed mid-way leaves it, in the folder the trainer uses: torch would wait for it
    forever; the trainer removes it, says so, and the run finishes."""
    rd = tiny_run("rollout.total_rollout_steps=24")
    lock = _ops_folder() / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
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
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
