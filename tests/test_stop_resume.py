"""A user's life with a run, through the real launcher: Ctrl-C at any moment checkpoints the trainer's last
update (a resume redoes nothing and prints only new lines, with an ETA at once); a run stopped by a reward
file that fails where the jobs run is fixed with ``--resume reward.path=...`` and finishes; a reward that
raises on a third of the rows shows on the console, in ``hpcrl status`` and in the report."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, BackgroundCommand, check_exactly_once, python
from hpcrl.control.records import read_latest_checkpoint
from hpcrl.logs.run_logs import read_metrics
from hpcrl.rundir.paths import RunDir
from test_users import hpcrl, verl_parquet

pytestmark = pytest.mark.slow


def version_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^v\d+\s+step", line)]


def test_ctrl_c_at_a_random_moment_loses_no_update(tmp_path):
    seed = int(os.environ.get("HPCRL_TEST_SEED", time.time_ns() % 10_000))
    stop_after = random.Random(seed).randint(3, 40)
    print(f"seed {seed}: Ctrl-C after {stop_after} updates")
    run, rd = tmp_path / "run", RunDir(tmp_path / "run")
    proc = subprocess.Popen([python(), "-m", "hpcrl", "run", str(TINY), "rollout.total_rollout_steps=240",
                             "--run-dir", str(run), "--executor", "local"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and not (rd.metrics.exists() and
                                              rd.metrics.read_text().count("\n") >= stop_after):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    beats = {job: json.loads(rd.heartbeat(job).read_text())["state"] for job in ("trainer", "rollout-w000", "eval")}
    assert beats == {"trainer": "stopped", "rollout-w000": "stopped", "eval": "stopped"}, beats  # tiny.yaml validates
    stopped_at = int(read_metrics(rd)["step"].max())
    ckpt = read_latest_checkpoint(rd)
    assert ckpt is not None and ckpt.step == stopped_at, f"checkpoint at {ckpt}, last update {stopped_at}"
    assert f"jobs stopped; trainer checkpoint at step {stopped_at}/60" in out, out[-2000:]
    assert "rollout w000 stopped" in rd.job_log("rollout-w000").read_text()
    assert "rollout w000 failed" not in rd.job_log("rollout-w000").read_text()
    assert "stop requested" in rd.job_log("eval").read_text(), "the evaluation job honours the stop request too"

    again = hpcrl("run", "--resume", "--run-dir", run, "--executor", "local", timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    lines = version_lines(again.stdout)
    assert lines and f"step {stopped_at + 1:>5d}/60" in lines[0], lines[:2]
    assert re.search(r"eta \d", lines[0]), f"the ETA comes from the updates before the stop: {lines[0]}"
    m = read_metrics(rd)
    assert list(m["step"]) == list(range(1, 61)), "every update once"
    trainer_log = rd.job_log("trainer").read_text()
    assert "removing weight version" not in trainer_log, "nothing published after the checkpoint to withdraw"
    check_exactly_once(rd, max_in_flight=4)


FAILS_WHERE_THE_JOBS_RUN = '''
import os

if os.environ.get("SUBMITIT_EXECUTOR"):  # importable on the login node, not where the jobs run
    import helpers_that_only_the_login_node_has  # noqa: F401


def compute_score(solution_str, ground_truth):
    return float(solution_str.split() == ground_truth.split())
'''


def test_a_run_stopped_by_its_reward_is_fixed_with_resume_and_finishes(tmp_path):
    (tmp_path / "broken.py").write_text(FAILS_WHERE_THE_JOBS_RUN)
    (tmp_path / "fixed.py").write_text(FAILS_WHERE_THE_JOBS_RUN.split("\n\n\n")[1])
    run = tmp_path / "run"
    first = hpcrl("run", TINY, f"reward.path={tmp_path / 'broken.py'}", "rollout.total_rollout_steps=40", "--run-dir",
                  run, "--executor", "local", timeout=300)
    assert first.returncode == 1, first.stdout[-3000:]
    assert "run stopped: rollout-w000: loading the reward failed:" in first.stdout and "ModuleNotFoundError" in first.stdout
    assert f"hpcrl run --resume --run-dir {run} reward.path=FILE" in first.stdout
    again = hpcrl("run", "--resume", "--run-dir", run, f"reward.path={tmp_path / 'fixed.py'}", "--executor", "local",
                  timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "--resume changes reward.path" in again.stdout and "run finished: 10 updates" in again.stdout
    assert any("reward.path" in h and "(after: reward failed)" in h for h in RunDir(run).config_history())


RAISES_ON_A_THIRD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 3 == 1:  # not row 0: the launch check calls it on the first row
        raise ValueError(f"row {extra_info['index']}: cannot read the answer")
    want, got = ground_truth.split(), solution_str.split()
    return sum(1 for i, w in enumerate(want) if i < len(got) and got[i] == w) / len(want)
'''


def reward_errors_launch(folder: Path) -> list[str]:
    """A run on verl-format rows whose reward raises on a third of them, launched like a user's."""
    src = verl_parquet(folder / "train.parquet", n=60)
    (folder / "r.py").write_text(RAISES_ON_A_THIRD)
    return ["run", str(TINY), f"data.source={src}", f"reward.path={folder / 'r.py'}", "rollout.total_rollout_steps=48",
            "eval.every_versions=0", "--run-dir", str(folder / "run"), "--executor", "local"]


BACKGROUND_RUNS = {"stop_resume:reward_errors": BackgroundCommand.hpcrl_args(reward_errors_launch)}
"""In the background when the session starts (conftest.BackgroundRuns): its test reads the finished run."""


def background_keys(item) -> tuple[str, ...]:
    """The background run a test item reads (none: it runs its own)."""
    reads = item.originalname == "test_reward_errors_show_on_the_console_in_status_and_in_the_report"
    return ("stop_resume:reward_errors",) if reads else ()


def test_reward_errors_show_on_the_console_in_status_and_in_the_report(background_runs):
    out = background_runs.launched("stop_resume:reward_errors", timeout_s=600)
    assert out.returncode == 0, out.stdout[-3000:]
    run = Path(out.args[out.args.index("--run-dir") + 1])
    console = [line for line in version_lines(out.stdout) if "reward errors" in line]
    assert console and "(first: w000/" in console[0] and "ValueError: row" in console[0], out.stdout[-3000:]
    rows = [json.loads(x) for x in (run / "logs" / "rollout-w000.jsonl").read_text().splitlines()]
    errors, trajs = sum(r["reward/errors"] for r in rows), sum(r["trajectories"] for r in rows)
    print(f"reward errors on {errors} of {trajs} responses")
    assert 0.2 < errors / trajs < 0.5
    status = hpcrl("status", run, "--once")
    assert f"problems: w000: reward errors {errors} (first: v" in status.stdout, status.stdout
    rep = hpcrl("report", run, timeout=300)
    assert rep.returncode == 0, rep.stderr
    md = (run / "report" / "report.md").read_text()
    assert "Problems: reward errors, tool errors, prompts filtered" in md and f"reward errors {errors}" in md


HELD = '''
import os, signal, subprocess, sys, threading, time
from hpcrl.launcher.run_cmd import _hold_sigint, _release_sigint
from hpcrl.launcher.submit import _sigint_ignored
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a launcher has other threads
held = _hold_sigint()
with _sigint_ignored("local"):                       # what submitting a local job does
    os.kill(os.getpid(), signal.SIGINT)              # Ctrl-C pressed meanwhile
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    time.sleep(0.2)
print("submitted", flush=True)
try:
    _release_sigint(held)
    time.sleep(5)
    print("the Ctrl-C was lost")
except KeyboardInterrupt:
    os.kill(child.pid, signal.SIGINT)
    time.sleep(0.5)
    print("stopping; the job is", "alive" if child.poll() is None else "dead")
    child.kill()
'''


def test_a_ctrl_c_while_the_jobs_are_submitted_stops_the_run_once_they_are_known():
    """A Ctrl-C in the window where local jobs are started with SIGINT ignored was lost (the run went on to the
    end, seen under load): hpcrl run holds it until the jobs are submitted, then stops them; the jobs still
    leave Ctrl-C to the launcher."""
    out = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.split("\n")[:2] == ["submitted", "stopping; the job is alive"], out.stdout + out.stderr
