"""The change file pollers stat instead of the run directory (``control/changes.py``), and the trainer's sample
poll that stats instead of opening: what a poll costs the filesystem's metadata server, and that no change is
missed."""
import os
import time

import pytest

from hpcrl.config import ConfigError, TimeoutsConfig
from hpcrl.control import changes
from hpcrl.control.changes import ChangeWatch, bump
from hpcrl.control.fleet import request_drain
from hpcrl.control.records import request_stop
from hpcrl.rundir.paths import RunDir
from hpcrl.samples import reader as reader_module
from hpcrl.samples.reader import SampleReader
from hpcrl.config import WeightsConfig
from hpcrl.weights import make_publisher, make_subscriber


class Stats:
    """Counts os.stat calls on one path (what the watch costs)."""

    def __init__(self, monkeypatch, path):
        self.n, real = 0, os.stat

        def counted(p, *a, **k):
            if os.fspath(p) == os.fspath(path):
                self.n += 1
            return real(p, *a, **k)
        monkeypatch.setattr(changes.os, "stat", counted)


def test_a_watch_reports_each_bump_once_and_backs_off_while_nothing_changes(tmp_path, monkeypatch):
    rd = RunDir(tmp_path).create()
    stats = Stats(monkeypatch, rd.changes)
    w = ChangeWatch(rd, min_s=0.01, max_s=0.08, rescan_s=60)
    assert w.changed("loop"), "the first look always looks"
    assert not w.changed("loop"), "not due yet: no stat"
    assert stats.n == 1
    seen = []
    for _ in range(40):  # 0.4 s with nothing changing
        time.sleep(0.01)
        seen.append(w.changed("loop"))
    assert not any(seen) and w.interval_s == 0.08
    assert stats.n <= 16, f"{stats.n} stats in 0.4 s: the interval did not back off (40 without)"
    bump(rd, "weight version 1 published", "trainer")
    time.sleep(0.09)
    assert w.changed("loop") and w.interval_s == 0.01, "a change is seen within max_s, then the polls are fast again"
    time.sleep(0.02)
    assert not w.changed("loop")
    assert rd.changes.read_text().count("\n") == 1 and "weight version 1" in rd.changes.read_text()


def test_a_poll_sleeps_a_quarter_of_its_wait_so_it_sees_a_change_at_most_a_quarter_late(tmp_path):
    assert [changes.backoff_s(w, 0.05, 0.5) for w in (0.0, 0.1, 1.0, 2.0, 60.0)] == [0.05, 0.05, 0.25, 0.5, 0.5]
    rd = RunDir(tmp_path).create()
    w = ChangeWatch(rd, min_s=0.01, max_s=10.0, rescan_s=60)
    assert w.changed("loop")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:  # nothing changes
        assert not w.changed("loop")
        time.sleep(0.005)
    waited = time.monotonic() - t0
    assert w.interval_s <= waited / 4 + 1e-9, "the next look is a quarter of the wait away at most (doubling: all of it)"
    assert w.interval_s >= 0.1, "but it did back off"


def test_every_writer_of_what_pollers_wait_for_bumps(tmp_path):
    rd = RunDir(tmp_path).create()
    w = ChangeWatch(rd, min_s=0.0, max_s=0.0, rescan_s=60)
    assert w.changed("loop")
    pub = make_publisher(WeightsConfig(), rd)
    import torch
    for what, act in [("publish", lambda: pub.publish(0, {"w": torch.ones(3)}, "{}", 0, 0)),
                      ("bad marker", lambda: pub.folders.mark_bad(0, "w000", "test")),
                      ("withdraw", lambda: pub.withdraw_after(-1)),
                      ("stop", lambda: request_stop(rd, "test")),
                      ("drain", lambda: request_drain(rd, "w001", "test"))]:
        act()
        assert w.changed("loop"), f"{what} did not bump control/changes.jsonl"
        assert not w.changed("loop")


def test_one_stat_tells_every_part_of_a_loop_once(tmp_path, monkeypatch):
    rd = RunDir(tmp_path).create()
    stats = Stats(monkeypatch, rd.changes)
    w = ChangeWatch(rd, min_s=0.0, max_s=0.0, rescan_s=60)
    assert w.changed("stop") and w.changed("weights"), "each part looks the first time it asks"
    assert not w.changed("stop") and not w.changed("weights")
    bump(rd, "weight version 3 published", "trainer")
    n = stats.n
    assert w.changed("stop"), "the stop check sees the change first ..."
    assert w.changed("weights"), "... and the weights check still sees it (one change, told to every part once)"
    assert not w.changed("stop") and not w.changed("weights")
    assert stats.n - n >= 1


def test_a_watch_reports_at_least_every_rescan_even_without_a_bump(tmp_path):
    rd = RunDir(tmp_path).create()
    w = ChangeWatch(rd, min_s=0.0, max_s=0.0, rescan_s=0.05)
    assert w.changed("loop") and not w.changed("loop")
    time.sleep(0.06)
    assert w.changed("loop"), "a writer killed between its change and its bump delays a reaction, never forever"


def test_a_bump_without_a_control_folder_is_a_no_op(tmp_path):
    bump(RunDir(tmp_path / "nothing"), "x")


def test_poll_max_s_below_poll_interval_s_is_refused():
    with pytest.raises(ConfigError, match="poll_max_s"):
        TimeoutsConfig(poll_interval_s=0.5, poll_max_s=0.1).validate()


def test_a_reader_lists_versions_once_and_stats_only_new_folders(tmp_path, monkeypatch):
    import torch
    rd = RunDir(tmp_path).create()
    pub = make_publisher(WeightsConfig(), rd)
    for v in range(3):
        pub.publish(v, {"w": torch.full((3,), float(v))}, "{}", v, 0)
    sub = make_subscriber(WeightsConfig(), rd, "w000")
    assert sub.published_versions() == [0, 1, 2]
    manifests = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (manifests.append(os.fspath(p)) if "manifest" in
                                                         os.fspath(p) else None) or real(p, *a, **k))
    pub.publish(3, {"w": torch.full((3,), 3.0)}, "{}", 3, 0)
    manifests.clear()
    assert sub.published_versions() == [0, 1, 2, 3]
    assert manifests == [os.fspath(rd.weight_manifest(3))], "only the new folder's manifest is looked at"


def test_a_sample_poll_with_nothing_new_opens_nothing(tmp_path, monkeypatch):
    rd = RunDir(tmp_path).create()
    for w in ("w000", "w001"):
        rd.writer_dir(w).mkdir(parents=True)
        rd.shard_manifest(w).write_bytes(b"")
    r = SampleReader(rd)
    r.poll()
    opened = []
    monkeypatch.setattr(reader_module, "open", lambda *a, **k: opened.append(a[0]) or open(*a, **k), raising=False)
    listed = []
    real_writers = RunDir.writers
    monkeypatch.setattr(RunDir, "writers", lambda self: listed.append(1) or real_writers(self))
    for _ in range(5):
        r.poll()
    assert opened == [] and listed == [], "an idle poll stats; it neither opens manifests nor lists writers"
    rd.writer_dir("w002").mkdir()
    os.utime(rd.samples, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new folder moves samples/'s mtime
    r.poll()
    assert listed == [1], "a new writer folder is found by the stat of samples/"
    rd.shard_manifest("w000").write_bytes(b'{"not": "a line"}\n')
    r.poll()
    assert opened == [rd.shard_manifest("w000")] and r.lines_seen == 1


def test_a_bump_that_cannot_be_written_does_not_fail_its_caller(tmp_path, monkeypatch, caplog):
    import errno
    rd = RunDir(tmp_path).create()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(changes.os, "write", full)
    bump(rd, "weight version 1 published", "trainer")
    assert "next rescan" in caplog.text and rd.changes.read_bytes() == b""
