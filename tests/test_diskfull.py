"""A filesystem that misbehaves: full (ENOSPC, EDQUOT), failing (EIO, ESTALE) or slow, at every writer.

The fast tests drive ``disk.guarded`` and its users with injected errors (``HPCRL_FAULT_POINT``'s ``write``
point) and a real small filesystem: a tmpfs mounted by the test (root only, CI runs as root; skipped with the
reason otherwise) that ``faults.fill`` fills until the kernel says ENOSPC. The slow ones run the tiny task on such
a filesystem: it fills up at each writer in turn (checkpoint, publish, metrics log, shard commit, in-flight save,
evaluation rows), the test frees the space once the job has said what it waits for, and the run ends exactly once;
and a run whose space never comes back ends with the fatal record ``hpcrl status`` shows.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, Job, check_exactly_once, make_run, python, start_rollout, start_trainer, wait_until
from test_job_life import WaitingJob
from hpcrl.rundir import disk, fsio
from hpcrl.control.job import DiskRoom, Stop, run
from hpcrl.control.records import HeartbeatState, HeartbeatThread, read_heartbeats
from hpcrl.process import faults
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.reader import SampleReader, delete_consumed
from hpcrl.samples.writer import ShardWriter
from hpcrl.weights.publisher import WeightPublisher


@pytest.fixture
def fault(monkeypatch):
    """``fault("write:2:errno=EIO", ...)``: this process's fault specs, as HPCRL_FAULT_POINT would set them."""
    def set_specs(*specs: str) -> None:
        monkeypatch.setattr(faults, "_specs", [s.split(":", 2) for s in specs])
        monkeypatch.setattr(faults, "_counts", {})
    return set_specs


@pytest.fixture
def policy(monkeypatch):
    """A short wait for space, so a test that never frees it ends in seconds."""
    monkeypatch.setattr(disk, "POLICY", disk.DiskPolicy(full_wait_s=2.0, backoff_max_s=0.5))
    return disk.POLICY


def mount_tmpfs(folder: Path, size: str) -> Path:
    if os.geteuid() != 0:
        pytest.skip("a filesystem that fills up is a tmpfs mounted by the test: needs root (CI runs as root)")
    folder.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    return folder


@pytest.fixture
def small_fs(tmp_path):
    fs = mount_tmpfs(tmp_path / "fs", "8m")
    yield fs
    subprocess.run(["umount", "-l", str(fs)], check=False)


def free_later(path: Path, after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, lambda: path.unlink(missing_ok=True))
    timer.start()
    return timer


# ---- the write primitive


def test_a_failing_write_is_retried_and_a_full_disk_waited_out_then_given_up_in_one_line(tmp_path, fault, policy,
                                                                                        caplog):
    fault("write:1:errno=EIO", "write:2:errno=ESTALE", "write:4:errno=ENOSPC")
    with caplog.at_level(logging.INFO, logger="hpcrl.rundir.disk"):
        fsio.write_json_atomic(tmp_path / "a.json", {"a": 1})  # EIO, ESTALE, then written
        assert json.loads((tmp_path / "a.json").read_text()) == {"a": 1}
        fsio.write_json_atomic(tmp_path / "b.json", {"b": 2})  # ENOSPC once, then written
    said = [r.getMessage() for r in caplog.records if r.name == "hpcrl.rundir.disk"]
    assert [m.split(" (")[0] for m in said[:2]] == ["Input/output error", "Stale file handle"], said
    assert re.search(r"No space left on device .* writing .*b\.json \(a file\): needs \d+ B, .* free of .*; waiting "
                     r"for space \(0s so far, at most 2s: timeouts.disk_full_s\)", "\n".join(said)), said
    assert any("b.json after" in m and "waiting for space" in m for m in said), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"], "no temporary file is left"
    fault(*[f"write:{i}:errno=EIO" for i in range(1, 8)])
    with pytest.raises(disk.WriteFailed, match=r"I/O error at .*c\.json: a file failed 6 times"):
        fsio.write_json_atomic(tmp_path / "c.json", {})
    assert not list(tmp_path.glob("c.json*"))


def test_on_a_full_filesystem_a_log_waits_for_space_and_is_never_left_torn(small_fs, policy):
    log = fsio.JsonlAppender(small_fs / "log.jsonl")
    log.append({"i": 0})
    faults.fill(str(small_fs / "filler"))
    free_later(small_fs / "filler", 1.5)
    t0 = time.monotonic()
    log.append({"i": 1, "pad": "x" * 100_000})  # a partial write, cut back, then the whole line once freed
    assert time.monotonic() - t0 >= 1.4
    faults.fill(str(small_fs / "filler"))
    with pytest.raises(disk.WriteFailed, match=r"disk full at .*log\.jsonl: log lines needs 97\.7 KiB, .* free of "
                                               r"8\.0 MiB; waited \d+s \(timeouts.disk_full_s\)"):
        log.append({"i": 2, "pad": "y" * 100_000})
    log.close()
    assert [json.loads(line)["i"] for line in (small_fs / "log.jsonl").read_text().splitlines()] == [0, 1]
    with pytest.raises(disk.WriteFailed):
        fsio.write_bytes_atomic(small_fs / "r.json", b"z" * 50_000, wait=False)  # a heartbeat does not wait
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler", "log.jsonl"], "no temporary file is left"


@pytest.mark.parametrize("handler", ["job log", "plain FileHandler"])
def test_a_job_log_still_takes_the_lines_said_while_the_disk_is_full(small_fs, handler):
    """What a job says while it waits for space must reach its log: the line a user (and the suite) looks for.
    The log's last page is full, so a plain FileHandler has no slack to put the line in and loses it."""
    from hpcrl.logs.run_logs import JobLogFile

    path = small_fs / "trainer.log"
    path.write_bytes(b"x" * 4095 + b"\n")  # the next line needs a new page
    out = JobLogFile(path) if handler == "job log" else logging.FileHandler(path)
    out.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.Logger("t")
    logger.addHandler(out)
    faults.fill(str(small_fs / "filler"))
    lines = [f"No space left on device writing weights/v{v:06d}; waiting for space" for v in range(200)]
    for line in lines:
        logger.error(line)
    try:
        out.close()
    except OSError:  # the plain handler's last flush meets the full disk too
        pass
    said = path.read_text().splitlines()[1:]
    if handler == "plain FileHandler":
        assert said != lines, "the plain handler had room after all: this test no longer shows the difference"
    else:
        assert said == lines, "lines said on a full disk were lost"


def test_a_shard_commit_waits_for_space_and_commits_once(small_fs, policy, fault):
    rd = RunDir(small_fs / "run").create()
    from test_samples import make_group  # the sample tests' groups

    writer = ShardWriter(rd, "w000", seal_groups=2, seal_interval_s=60)
    writer.add(make_group(0))
    writer.add(make_group(1))
    faults.fill(str(small_fs / "filler"))
    free_later(small_fs / "filler", 1.5)
    line = writer.seal()
    assert line is not None and line.prompt_indices == [0, 1]
    fault("write:3:errno=ENOSPC")  # the shard file, its rename, then the manifest line (the commit) meets ENOSPC
    writer.add(make_group(2))
    assert writer.seal().prompt_indices == [2]
    writer.close()
    reader = SampleReader(rd)
    reader.poll()
    assert [g.prompt_index for g in reader.take(10)] == [0, 1, 2]
    assert len((rd.writer_dir("w000") / "manifest.jsonl").read_text().splitlines()) == 2, "each line once, none torn"
    assert sorted(p.name for p in rd.writer_dir("w000").glob("shard-*")) == [line.shard, RunDir.shard_name(1)]


def test_an_evaluation_commit_waits_for_space_and_its_two_logs_stay_consistent(small_fs, policy):
    """The evaluation's writer (compressed samples, then the row: the commit point) on a full filesystem: the
    version's samples wait for space, then the row; a restarted writer finds both whole. The responses are random
    hex, so their compressed member (~5 KB) cannot hide in the slack of the file's last page."""
    from hpcrl.eval.writer import EvalLogWriter
    from hpcrl.logs.eval_log import EvalRow, EvalSample, read_eval_rows, read_eval_samples

    rows, samples = small_fs / "eval.jsonl", small_fs / "eval_samples.jsonl.gz"

    def version(v: int) -> list[EvalSample]:
        return [EvalSample(version=v, prompt_id=f"0:{i}", data_source="d", index=i, prompt="p",
                           response=os.urandom(120).hex(), ground_truth="g", reward=1.0) for i in range(40)]
    writer = EvalLogWriter(rows, samples)
    writer.commit(EvalRow(version=0, status="evaluated", score=0.5), version(0))
    faults.fill(str(small_fs / "filler"))
    free_later(small_fs / "filler", 1.5)
    t0 = time.monotonic()
    writer.commit(EvalRow(version=20, status="evaluated", score=0.7), version(20))
    assert time.monotonic() - t0 >= 1.4, "the commit met the full disk and waited"
    writer.close()
    again = EvalLogWriter(rows, samples)  # what a restarted evaluation job finds
    assert [r.version for r in again.rows] == [0, 20] and again.rows[-1].samples_bytes == samples.stat().st_size
    again.close()
    assert [s.version for s in read_eval_samples(samples)] == [0] * 40 + [20] * 40
    assert [r.samples for r in read_eval_rows(rows)] == [40, 40]


def test_the_evaluation_keeps_the_responses_of_its_newest_versions_and_gives_back_the_rest(small_fs):
    """``eval.keep_samples_versions``: the samples file's head before the newest K versions with samples is released
    (a hole: the file's size and the offsets the rows hold stay); rows and metrics stay; a restarted writer goes on."""
    from hpcrl.eval.writer import EvalLogWriter
    from hpcrl.logs.eval_log import EvalRow, EvalSample, read_eval_rows, read_eval_samples

    rows, samples = small_fs / "eval.jsonl", small_fs / "eval_samples.jsonl.gz"

    def commit(writer: EvalLogWriter, v: int, status: str = "evaluated") -> None:
        got = [EvalSample(version=v, prompt_id=f"0:{i}", data_source="d", index=i, prompt="p",
                          response=os.urandom(120).hex(), ground_truth="g", reward=1.0) for i in range(40)]
        writer.commit(EvalRow(version=v, status=status, score=0.5 if status == "evaluated" else None),
                      got if status == "evaluated" else [])

    writer = EvalLogWriter(rows, samples, keep_samples_versions=2)
    for v in (0, 20, 40, 60):
        commit(writer, v)
    commit(writer, 70, "skipped")
    commit(writer, 80)
    writer.close()
    assert [r.version for r in read_eval_rows(rows)] == [0, 20, 40, 60, 70, 80], "every row stays"
    assert sorted({s.version for s in read_eval_samples(samples)}) == [60, 80]
    size, used = samples.stat().st_size, samples.stat().st_blocks * 512
    assert size == read_eval_rows(rows)[-1].samples_bytes, "offsets stay true"
    head = read_eval_rows(rows)[2].samples_bytes  # where v60's samples start
    assert size - used >= head - 4096, f"the head ({head} bytes) was given back: {used} of {size} bytes allocated"
    again = EvalLogWriter(rows, samples, keep_samples_versions=2)  # a restarted evaluation job
    commit(again, 100)
    again.close()
    assert sorted({s.version for s in read_eval_samples(samples)}) == [80, 100]
    assert len(read_eval_samples(samples, 100)) == 40 and read_eval_samples(samples, 20) == []


def test_consumed_shards_behind_the_checkpointed_cursor_are_removed_but_the_newest(tmp_path):
    from test_samples import make_group

    rd = RunDir(tmp_path / "run").create()
    writer = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60)
    for i in range(6):
        writer.add(make_group(i))
        writer.seal()
    writer.close()
    done: dict = {}
    assert delete_consumed(rd, {"w000": {"line": 5, "row": 0}}, keep=2, done=done) == 3
    assert delete_consumed(rd, {"w000": {"line": 5, "row": 0}}, keep=2, done=done) == 0
    left = sorted(p.name for p in rd.writer_dir("w000").glob("shard-*"))
    assert left == [RunDir.shard_name(i) for i in (3, 4, 5)]
    assert delete_consumed(rd, {"w000": {"line": 6, "row": 0}}, keep=-1) == 0, "-1 keeps every shard"
    reader = SampleReader(rd, cursor={"w000": {"line": 5, "row": 0}})
    reader.poll()
    assert [g.prompt_index for g in reader.take(10)] == [5], "a resumed reader never needs what was removed"


# ---- the job's life on a full disk


class FillingJob:
    """A job whose loop meets a disk that stays full."""

    def __init__(self, rd: RunDir, stop_state: list):
        self.name, self.requeues = "rollout w000", True
        self.heartbeat = HeartbeatThread(rd, "rollout-w000", "rollout", 0.2)
        self.rd, self.stop_state = rd, stop_state

    def start(self) -> None:
        pass

    def loop(self) -> Stop:
        fsio.JsonlAppender(self.rd.root / "big.jsonl").append({"pad": "x" * 200_000})
        return Stop.DONE

    def shutdown(self, final_state: HeartbeatState) -> None:
        self.stop_state.append(final_state)
        fsio.write_json_atomic(self.rd.root / "small.json", {"pad": "y" * 20_000})  # fits in the room given back
        fsio.write_json_atomic(self.rd.root / "big.json", {"pad": "y" * 2_000_000})  # does not: fails, no wait


def test_a_job_whose_disk_stays_full_gives_back_its_room_and_leaves_the_fatal_record(small_fs, policy):
    rd = RunDir(small_fs / "run").create()
    room = DiskRoom(rd, "rollout-w000")
    room.hold()
    assert room.path.stat().st_size == 1 << 20
    faults.fill(str(small_fs / "filler"))
    seen: list = []
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        run(FillingJob(rd, seen), room)
    assert exit_info.value.code == 1 and time.monotonic() - t0 < policy.full_wait_s + 10
    record = json.loads(rd.fatal.read_text())
    assert record["job"] == "rollout-w000" and record["input"] == "disk"
    assert record["message"].startswith(f"disk full at {rd.root / 'big.jsonl'}: log lines needs 195.3 KiB")
    assert read_heartbeats(rd)["rollout-w000"].state == "failed" and seen == [HeartbeatState.FAILED]
    assert not room.path.exists() and (rd.root / "small.json").exists() and not (rd.root / "big.json").exists()
    from hpcrl.analysis.status import StatusView

    text, code = StatusView(rd, None, 60.0).render(time.time())
    assert "run stopped by an error a restart would repeat: rollout-w000: disk full at" in text and code == 1
    assert re.search(r"disk: run directory .* free of 8\.0 MiB on its filesystem", text)


class SavingJob(WaitingJob):
    """A job that waits for a reason to end, then saves more than the disk holds (as the trainer's stop checkpoints)."""

    def loop(self) -> Stop:
        reason = super().loop()
        fsio.write_json_atomic(self.rd.root / "checkpoint.json", {"pad": "z" * 2_000_000})
        return reason


def test_a_job_stopped_by_another_jobs_full_disk_saves_without_waiting_for_space_again(small_fs, monkeypatch):
    """The rollout job's write waited ``timeouts.disk_full_s`` for space and recorded the full disk; the trainer,
    stopped by that record, must not wait that long again for its own save: it fails at once, as failed."""
    from hpcrl.control.fatal import write_fatal
    from hpcrl.control.job import StopWatch

    monkeypatch.setattr(disk, "POLICY", disk.DiskPolicy(full_wait_s=60.0, backoff_max_s=0.5))
    rd = RunDir(small_fs / "run").create()
    write_fatal(rd, "rollout-w000", f"disk full at {rd.root}: waited 60s", "disk")
    room = DiskRoom(rd, "trainer")
    room.hold()  # as job_main does: room for the last heartbeat
    faults.fill(str(small_fs / "filler"))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        run(SavingJob(rd, StopWatch(rd, None, {Stop.STOPPED: "checkpointing"})), room)
    assert exit_info.value.code == 1 and time.monotonic() - t0 < 20, f"waited {time.monotonic() - t0:.0f}s for space"
    assert read_heartbeats(rd)["trainer"].state == "failed"
    assert json.loads(rd.fatal.read_text())["job"] == "rollout-w000", "the first record is kept"


# ---- retention that is killed in the middle


PUBLISHER = r"""
import sys, torch
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.publisher import WeightPublisher
rd = RunDir(sys.argv[1])
pub = WeightPublisher(rd, keep_versions=2)
v = max(pub.published_versions(), default=-1)
pub.withdraw_after(v)  # what the trainer does at start: the sweep, then nothing newer than its checkpoint
state = {f"w{i}": torch.full((64, 1024), float(i)) for i in range(24)}
print("ready", flush=True)
while True:
    v += 1
    pub.publish(v, state, "{}", v, v)
    pub.retain(60.0)
"""


@pytest.mark.slow
def test_a_trainer_killed_during_retention_leaves_no_version_folder_without_its_manifest(tmp_path):
    """SIGKILL at random instants of a publish-and-retain loop; after each restart's sweep no version folder lacks
    its manifest (the old delete unlinked the manifest, then removed the folder: 2 of 8 kills left one)."""
    rd = RunDir(tmp_path / "run").create()
    found = {"half_removed": 0, "half_written": 0}
    for trial in range(8):
        proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(rd.root)], cwd=REPO, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3 + 0.37 * trial % 1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        names = [p.name for p in rd.weights.iterdir()]
        found["half_removed"] += sum(n.endswith(".deleting") for n in names)
        lacking = [n for n in names if RunDir.parse_weight_version(n) is not None
                   and not rd.weight_manifest(RunDir.parse_weight_version(n)).exists()]
        found["half_written"] += len(lacking)
        WeightPublisher(rd, keep_versions=2).withdraw_after(10**9)  # a restarted trainer's sweep
        names = [p.name for p in rd.weights.iterdir()]
        assert all(rd.weight_manifest(RunDir.parse_weight_version(n)).exists() for n in names), names
        assert not [n for n in names if RunDir.parse_weight_version(n) is None], names
    print(f"kills that left something half-done before the sweep: {found}")


# ---- the tiny run on a filesystem that fills up


FILLS = {  # job -> (fault specs, what the job must then say it waits for)
    "trainer": [("checkpoint:2", "checkpoints (checkpoint step-"), ("publish:9", "weights/v"),
                ("metrics_log:14", None)],
    "rollout": [("seal_manifest:12", None), ("states_save:4", "in_flight/w000.json")],
    "eval": [("eval_commit:2", None)],
}
"""Each writer in turn: where the job fills the filesystem, and the path its next write must name. A short line
appended to a log may still fit in the slack of the file's last page on a full filesystem (a metrics row, a
manifest line, the evaluation's compressed samples and its row): then another write meets the full disk first (the
unit tests above fail those appends exactly; test_an_evaluation_commit_waits_... the evaluation's commit)."""


def waiting_lines(rd: RunDir) -> list[str]:
    out = []
    for log in sorted(rd.job_logs.glob("*.log")):
        out += [line for line in log.read_text(errors="replace").splitlines() if "waiting for space" in line]
    return out


@pytest.mark.slow
def test_the_tiny_run_survives_its_filesystem_filling_up_at_each_writer_in_turn(tmp_path):
    fs = mount_tmpfs(tmp_path / "fs", "96m")
    try:
        rd = make_run(fs, "rollout.total_rollout_steps=64", "trainer.checkpoint_every_updates=4",
                      "async_training.staleness_threshold=0.5", "async_training.partial_rollout=true",
                      "eval.every_versions=4", "timeouts.disk_full_s=120", "timeouts.slow_write_s=1")
        env = {job: {"HPCRL_FAULT_POINT": ",".join(f"{spec}:fill={fs / f'filler-{i}'}" for i, (spec, _)
                                                   in enumerate(fills, start=10 * n))}
               for n, (job, fills) in enumerate(FILLS.items())}
        env["trainer"]["HPCRL_FAULT_POINT"] += ",write:30:sleep=3"  # one write stalls: named, no deadline fires
        jobs = [start_trainer(rd, env=env["trainer"]), start_rollout(rd, env=env["rollout"]),
                Job(["eval-job", str(rd.root)], rd.root / "eval.out", env=env["eval"])]
        freed = []
        while any(j.proc.poll() is None for j in jobs[:2]):
            for filler in sorted(fs.glob("filler-*")):
                # at least one more "waiting" line than fills freed (two jobs may fill at the same instant: then
                # both lines are there before the first filler is looked at)
                wait_until(lambda: len(waiting_lines(rd)) > len(freed), 60,
                           f"a job to say it waits for space ({filler})", jobs=jobs[:2])
                time.sleep(1.0)
                filler.unlink()
                freed.append(filler.name)
            time.sleep(0.2)
        for job in jobs:
            assert job.wait(300) == 0, job.tail()
        said = "\n".join(waiting_lines(rd))
        for job, fills in FILLS.items():
            for spec, path in fills:
                assert path is None or path in said, f"{job} filled the disk at {spec}; no job said it waited to " \
                                                     f"write {path}:\n{said}"
        assert len(freed) == sum(len(f) for f in FILLS.values())
        trainer_log = rd.job_log("trainer").read_text()
        assert re.search(r"slow write: .* took [3-9]\.\ds", trainer_log)
        assert "written to" in trainer_log and "after" in trainer_log
        check_exactly_once(rd, 2)
        assert not rd.fatal.exists()
    finally:
        shutil.copytree(fs / "run" / "logs", tmp_path / "logs", dirs_exist_ok=True)  # what the jobs said
        subprocess.run(["umount", "-l", str(fs)], check=False)


@pytest.mark.slow
def test_a_run_whose_space_never_comes_back_ends_with_the_fatal_record_status_shows(tmp_path):
    """The trainer's first checkpoint (a fresh start checkpoints at once) meets a full disk that stays full."""
    fs = mount_tmpfs(tmp_path / "fs", "96m")
    try:
        rd = make_run(fs, "timeouts.disk_full_s=3", "eval.every_versions=0")
        trainer = start_trainer(rd, env={"HPCRL_FAULT_POINT": f"checkpoint:1:fill={fs / 'filler'}"})
        assert trainer.wait(300) == 1, trainer.tail()
        assert rd.fatal.exists(), trainer.tail(60)
        record = json.loads(rd.fatal.read_text())
        assert record["input"] == "disk" and record["message"].startswith(f"disk full at {rd.checkpoints}"), record
        assert read_heartbeats(rd)["trainer"].state == "failed"
        out = subprocess.run([python(), "-m", "hpcrl", "status", str(rd.root), "--once"], capture_output=True,
                             text=True, cwd=REPO, timeout=120)
        assert "run stopped by an error a restart would repeat: trainer: disk full at" in out.stdout, out.stdout
        assert "cannot go on: disk full at" in rd.job_log("trainer").read_text()
        assert "Traceback" not in trainer.tail(200)
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)
