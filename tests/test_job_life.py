"""Every job's life (``control/job.py``): why a job ends, and what it says when it does."""
import logging
import threading
import time

import pytest

from conftest import make_run
from hpcrl.control.changes import RESCAN_S, ChangeWatch
from hpcrl.control.fatal import write_fatal
from hpcrl.control.job import Stop, StopWatch, run
from hpcrl.control.records import HeartbeatState, HeartbeatThread, read_heartbeats
from hpcrl.rundir.paths import RunDir


class WaitingJob:
    """A job whose loop waits for a reason to end, as the trainer waits for samples between two updates."""

    def __init__(self, rd: RunDir, watch: StopWatch):
        self.name, self.requeues = "trainer", False
        self.heartbeat = HeartbeatThread(rd, "trainer", "trainer", 0.2)
        self.rd, self.watch = rd, watch
        self.shut_down: list[HeartbeatState] = []

    def start(self) -> None:
        pass

    def loop(self) -> Stop:
        deadline = time.monotonic() + 60
        while (reason := self.watch.check()) is None:
            assert time.monotonic() < deadline, "no reason to end in 60 s"
            time.sleep(0.01)
        return reason

    def shutdown(self, final_state: HeartbeatState) -> None:
        self.shut_down.append(final_state)


@pytest.mark.parametrize("watched", [True, False], ids=["changes-watch", "polled"])
def test_another_jobs_fatal_record_stops_a_job_at_its_next_safe_point_saying_why(tmp_path, caplog, watched):
    """An input no restart can fix (here the rollout job's model) stops every job of the run, launcher or not: each
    saves as for a stop request and ends ``stopped``, so a ``--resume`` after the fix redoes nothing. The record's
    writer bumps ``control/changes.jsonl``, so a job watching it sees the record at once, not at its rescan."""
    rd = make_run(tmp_path)
    changes = ChangeWatch(rd, 0.05, 0.5) if watched else None
    job = WaitingJob(rd, StopWatch(rd, None, {Stop.STOPPED: "checkpointing the last completed update"},
                                   changes=changes))
    written: list[float] = []

    def rollout_fails() -> None:
        time.sleep(0.5)
        write_fatal(rd, "rollout-w000", "loading the model failed: ValueError: no model_type", "model")
        written.append(time.monotonic())

    other = threading.Thread(target=rollout_fails)
    other.start()
    with caplog.at_level(logging.WARNING, logger="hpcrl.control.job"):
        run(job)
    other.join()
    took = time.monotonic() - written[0]
    assert job.shut_down == [HeartbeatState.STOPPED] and read_heartbeats(rd)["trainer"].state == "stopped"
    assert ("the run stopped on an error no restart can fix (rollout-w000: loading the model failed: ValueError: "
            f"no model_type; to go on, fix it, then `hpcrl run --resume --run-dir {rd.root}`, or remove {rd.fatal} "
            "before submitting the sbatch scripts again): checkpointing the last completed update") in caplog.text
    assert took < RESCAN_S / 2, f"seen {took:.1f}s after the record: the bump was missed"


def test_a_stop_request_is_still_said_as_the_launchers(tmp_path, caplog):
    from hpcrl.control.records import request_stop

    rd = make_run(tmp_path)
    job = WaitingJob(rd, StopWatch(rd, None, {Stop.STOPPED: "checkpointing"}))
    request_stop(rd, "hpcrl run: Ctrl-C")
    with caplog.at_level(logging.WARNING, logger="hpcrl.control.job"):
        run(job)
    assert f"stop requested by the launcher ({rd.stop_request}): checkpointing" in caplog.text
    assert "no restart can fix" not in caplog.text
