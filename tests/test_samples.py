"""Sample exchange: real HDF5 shards, real SIGKILL; nothing torn, nothing lost or read twice."""
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hpcrl.rollout.dataset import ClaimedPrompts
from hpcrl.rundir.paths import RunDir
from hpcrl.rundir.fsio import read_jsonl
from hpcrl.samples.reader import SampleReader, read_shard
from hpcrl.samples.schema import Group, ShardManifestLine, Trajectory
from hpcrl.samples.writer import ShardWriter


def make_group(i: int, n: int = 3, version: int = 0, writer: str = "w000") -> Group:
    rng = np.random.default_rng(i)
    trajs = []
    for j in range(n):
        L = int(rng.integers(1, 9))
        trajs.append(Trajectory(prompt_ids=[i % 50, 7, 8], response_ids=rng.integers(0, 64, L),
                                response_mask=np.ones(L), logprobs=-rng.random(L),
                                token_versions=np.full(L, version), reward=float(j)))
    return Group(writer=writer, prompt_index=i, trajectories=trajs, created_s=1.0 * i, finished_s=1.0 * i + 0.5)


def write_groups(rd, indices, seal_groups=2, writer="w000"):
    w = ShardWriter(rd, writer, seal_groups=seal_groups, seal_interval_s=60)
    for i in indices:
        w.add(make_group(i, writer=writer))
        if w.seal_due():
            w.seal()
    w.close()
    return w


def drain(reader: SampleReader) -> list[Group]:
    reader.poll()
    out = []
    while True:
        got = reader.take(3)
        if not got:
            return out
        out.extend(got)


def test_roundtrip_keeps_every_field(tmp_path):
    rd = RunDir(tmp_path).create()
    write_groups(rd, range(5))
    got = drain(SampleReader(rd))
    assert [g.prompt_index for g in got] == list(range(5))
    for g in got:
        want = make_group(g.prompt_index)
        assert g.created_s == want.created_s and g.finished_s == want.finished_s and g.committed_s > 0
        for a, b in zip(g.trajectories, want.trajectories):
            for field in ("prompt_ids", "response_ids", "response_mask", "logprobs", "token_versions"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
            assert a.reward == b.reward


def test_cursor_resumes_exactly(tmp_path):
    rd = RunDir(tmp_path).create()
    write_groups(rd, range(7), seal_groups=3)
    write_groups(rd, range(100, 104), seal_groups=3, writer="w001")
    r1 = SampleReader(rd)
    r1.poll()
    first = r1.take(5)
    cursor = r1.cursor()
    rest_expected = drain(r1)
    r2 = SampleReader(rd, cursor=cursor)  # as after a trainer restart from a checkpoint
    rest = drain(r2)
    ids = lambda gs: [g.sample_id for g in gs]  # noqa: E731
    assert ids(rest) == ids(rest_expected)
    assert set(ids(first)).isdisjoint(ids(rest))
    assert sorted(ids(first) + ids(rest)) == sorted([f"w000/{i}" for i in range(7)] + [f"w001/{i}" for i in range(100, 104)])


def test_reader_sees_only_committed_groups(tmp_path):
    rd = RunDir(tmp_path).create()
    w = ShardWriter(rd, "w000", seal_groups=10, seal_interval_s=60)
    r = SampleReader(rd)
    w.add(make_group(0))
    assert r.poll() == 0, "a buffered (unsealed) group must be invisible"
    w.seal()
    assert r.poll() == 1
    w.close()


def test_restarted_writer_removes_uncommitted_files_and_continues(tmp_path):
    rd = RunDir(tmp_path).create()
    write_groups(rd, range(4), seal_groups=2)  # shard 0, 1
    folder = rd.writer_dir("w000")
    (folder / "shard-000002.h5.tmp").write_bytes(b"partial")      # killed before rename
    (folder / "shard-000003.h5").write_bytes(b"renamed, unlisted")  # killed before the manifest line
    with open(rd.shard_manifest("w000"), "ab") as f:
        f.write(b'{"shard": "shard-0000')                          # killed mid-line
    w = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60)
    assert w.next_shard_index == 4 and w.committed_prompt_indices == {0, 1, 2, 3}
    assert not (folder / "shard-000002.h5.tmp").exists() and not (folder / "shard-000003.h5").exists()
    w.add(make_group(4))
    w.seal()
    w.close()
    assert [g.prompt_index for g in drain(SampleReader(rd))] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_shard_is_reported_and_skipped(tmp_path, caplog, damage):
    rd = RunDir(tmp_path).create()
    write_groups(rd, range(6), seal_groups=2)  # shards 0,1,2
    bad = rd.shard_path("w000", 1)
    if damage == "truncate":
        os.truncate(bad, bad.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF
        bad.write_bytes(bytes(data))
    else:
        bad.unlink()
    r = SampleReader(rd, verify_retries=0)
    with caplog.at_level(logging.ERROR):
        got = drain(r)
    assert [g.prompt_index for g in got] == [0, 1, 4, 5]
    assert r.skipped == [{"writer": "w000", "shard": bad.name, "reason": r.skipped[0]["reason"], "n_groups": 2,
                          "prompt_indices": [2, 3]}]
    assert bad.name in caplog.text and "SKIPPING" in caplog.text
    assert r.cursor() == {"w000": {"line": 3, "row": 0}}


KILL_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_samples import make_group
    from hpcrl.rundir.paths import RunDir
    from hpcrl.samples.writer import ShardWriter
    rd = RunDir({root!r})
    w = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60)
    i = max(w.committed_prompt_indices, default=-1) + 1
    print("ready", flush=True)
    while True:
        w.add(make_group(i, n=16))
        w.seal()
        i += 1
""")


def test_sigkill_mid_write_never_leaves_a_torn_listed_shard(tmp_path):
    rd = RunDir(tmp_path).create()
    script = KILL_WRITER.format(tests=os.path.dirname(__file__), root=str(rd.root))
    rng = np.random.default_rng(0)
    for trial in range(5):
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(0.2 + 0.3 * rng.random())
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        r = SampleReader(rd, verify_retries=0)
        got = drain(r)
        assert not r.skipped, f"trial {trial}: a listed shard was torn: {r.skipped}"
        indices = [g.prompt_index for g in got]
        assert indices == list(range(len(indices))), "committed groups must be contiguous, none lost or repeated"
    assert len(indices) > 5


def test_claimed_prompts_are_generated_first_in_order():
    held = ClaimedPrompts([7, 5])
    assert held.peek() == [5]
    held.taken(5)
    held.requeue([2])
    assert held.peek() == [2]
    held.taken(2)
    held.taken(9)  # a new claim: the held ones stay
    assert held.peek() == [7]
    held.taken(7)
    assert held.peek() == []


def test_a_recorded_skip_is_final_and_hands_the_prompts_back(tmp_path):
    """The trainer records a skipped shard before moving past it: a reader started later (a trainer
    restarted from an older checkpoint) skips it even after its bytes came back, the writer
    generates its prompts again, and admission returns the budget they held."""
    from hpcrl.control.admission import Admission
    from hpcrl.samples.skips import SkipLog

    rd = RunDir(tmp_path).create()
    write_groups(rd, range(6), seal_groups=2)
    bad = rd.shard_path("w000", 1)
    good_bytes = bad.read_bytes()
    bad.write_bytes(good_bytes[:100])
    r = SampleReader(rd, verify_retries=0, skip_log=SkipLog(rd))
    assert [g.prompt_index for g in drain(r)] == [0, 1, 4, 5]
    bad.write_bytes(good_bytes)  # a lagging client shows the bytes again: too late, the skip is final
    r2 = SampleReader(rd, verify_retries=0, skip_log=SkipLog(rd))
    assert [g.prompt_index for g in drain(r2)] == [0, 1, 4, 5]
    assert len(list(SkipLog(rd).poll())) == 1, "the same shard is recorded once"

    admission = Admission(rd, "w000", budget=2)
    w = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60, skips=SkipLog(rd))
    assert w.committed_prompt_indices == {0, 1, 4, 5} and w.committed_groups == 6
    held = admission.join(w.committed_groups, w.committed_prompt_indices, w.skipped_at_start)
    assert held == [2, 3], "the skipped shard's prompts are this writer's to generate again"
    # consumed 4 (0, 1, 4, 5), budget 2: 6 started - 2 skipped < 4 + 2 leaves room for two
    assert admission.try_start(4, own=2) == 2 and admission.try_start(4, own=3) == 3
    assert admission.try_start(4) is None
    w.commit_guard = admission.committing
    w.add(make_group(2))
    w.seal()
    with pytest.raises(RuntimeError, match="already committed"):
        w.add(make_group(4))
    w.close()


def test_a_partly_consumed_shard_hands_back_only_the_rows_after_the_cursor(tmp_path):
    """Found by the soak campaign: the trainer had trained on rows 0-1 of a 4-group shard (its
    checkpoint cursor was at row 2) when the shard was damaged; the skip handed back all 4
    prompts, and rows 0-1 were generated and trained on a second time. Only the rows from the
    cursor on are skipped and regenerated; a trainer resumed from an older cursor inside the
    same shard adds the rows in between, and no prompt counts twice."""
    from hpcrl.samples.skips import SkipLog

    rd = RunDir(tmp_path).create()
    write_groups(rd, range(4), seal_groups=4)
    first = SampleReader(rd, verify_retries=0, skip_log=SkipLog(rd))
    first.poll()
    assert [g.prompt_index for g in first.take(2)] == [0, 1]
    cursor = first.cursor()
    assert cursor == {"w000": {"line": 0, "row": 2}}
    os.truncate(rd.shard_path("w000", 0), 100)  # damaged while the trainer is down
    resumed = SampleReader(rd, cursor=cursor, verify_retries=0, skip_log=SkipLog(rd))
    assert drain(resumed) == []
    assert resumed.skipped[0]["prompt_indices"] == [2, 3] and resumed.skipped[0]["n_groups"] == 2
    assert SkipLog(rd).poll()[0].prompt_indices == [2, 3]
    w = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60, skips=SkipLog(rd))
    assert w.committed_prompt_indices == {0, 1}, "rows trained on before the cursor stay committed"
    older = SampleReader(rd, cursor={"w000": {"line": 0, "row": 1}}, verify_retries=0, skip_log=SkipLog(rd))
    assert drain(older) == []
    log_ = SkipLog(rd)
    log_.poll()
    assert log_.skipped_groups() == 3, "prompt 1 added, 2 and 3 not counted twice"
    assert w.take_skipped_prompts() == [1]
    w.close()


def test_a_running_writer_regenerates_prompts_skipped_while_it_runs(tmp_path):
    from hpcrl.samples.skips import SkipLog

    rd = RunDir(tmp_path).create()
    w = ShardWriter(rd, "w000", seal_groups=2, seal_interval_s=60, skips=SkipLog(rd))
    for i in range(4):
        w.add(make_group(i))
        if w.seal_due():
            w.seal()
    assert w.take_skipped_prompts() == []
    os.truncate(rd.shard_path("w000", 0), 10)
    assert [g.prompt_index for g in drain(SampleReader(rd, verify_retries=0, skip_log=SkipLog(rd)))] == [2, 3]
    assert w.take_skipped_prompts() == [0, 1] and w.take_skipped_prompts() == []
    held = ClaimedPrompts([])
    held.requeue([0, 1])
    assert held.peek() == [0]
    w.add(make_group(0))
    w.close()


def test_a_seal_that_fails_never_reuses_its_shard_index(tmp_path, monkeypatch):
    """A retry after a failed write goes to a fresh index: a shard file is never overwritten."""
    import hpcrl.samples.writer as writer_mod

    rd = RunDir(tmp_path).create()
    w = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60)
    w.add(make_group(0))
    real = writer_mod.write_file_durably
    monkeypatch.setattr(writer_mod, "write_file_durably", lambda p, d, what="": (_ for _ in ()).throw(OSError("no")))
    with pytest.raises(OSError):
        w.seal()
    monkeypatch.setattr(writer_mod, "write_file_durably", real)
    line = w.seal()
    assert line.shard_index == 1 and line.prompt_indices == [0]
    w.close()


def test_torn_manifest_tail_is_cut_not_completed(tmp_path):
    """A fragment that happens to be complete JSON must not become a commit when the writer
    restarts (ending it with a newline did that): it was never read, so it is cut off."""
    rd = RunDir(tmp_path).create()
    write_groups(rd, range(2), seal_groups=2)
    manifest = rd.shard_manifest("w000")
    lines = manifest.read_bytes().splitlines(keepends=True)
    forged = lines[0].replace(b"shard-000000", b"shard-000001").rstrip(b"\n")  # valid JSON, no newline
    rd.shard_path("w000", 1).write_bytes(rd.shard_path("w000", 0).read_bytes())
    with open(manifest, "ab") as f:
        f.write(forged)
    w = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60)
    assert manifest.read_bytes() == lines[0] and w.committed_groups == 2
    w.add(make_group(2))
    w.close()
    assert [g.prompt_index for g in drain(SampleReader(rd))] == [0, 1, 2]


def test_deferred_sigterm_raises_when_the_block_ends():
    from hpcrl.process import termination

    previous = signal.getsignal(signal.SIGTERM)
    termination.install()
    done = []
    try:
        with pytest.raises(SystemExit, match="SIGTERM"):
            with termination.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("rest of the block ran")
        assert done == ["rest of the block ran"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        termination._received = None


def test_a_groups_reward_baseline_travels_with_it_and_readers_without_it_ignore_it(tmp_path, monkeypatch):
    """remax's greedy reward is an optional dataset (group/reward_baseline): read back with its group from the
    manifest's layout and from the HDF5 file; a reader that knows only the required datasets (an older
    hpcrl) reads the same groups without it; a shard without it gives None."""
    import hpcrl.samples.reader as reader_mod
    import hpcrl.samples.schema as schema_mod

    rd = RunDir(tmp_path).create()
    w = ShardWriter(rd, "w000", seal_groups=3, seal_interval_s=60)
    for i in range(3):
        g = make_group(i)
        g.reward_baseline = 0.25 * i
        w.add(g)
    w.seal()
    w.close()
    line = ShardManifestLine.from_json(next(read_jsonl(rd.shard_manifest("w000"))))
    path = rd.writer_dir("w000") / line.shard
    assert "group/reward_baseline" in line.layout
    for layout in (line.layout, {}):  # from the layout, and from the file (a line of an older writer has none)
        got = read_shard(path, ShardManifestLine.from_json({**line.to_json(), "layout": layout}), "w000")
        assert [g.reward_baseline for g in got] == [0.0, 0.25, 0.5]
    monkeypatch.setattr(schema_mod, "OPTIONAL_DTYPES", {})
    monkeypatch.setattr(reader_mod, "OPTIONAL_DTYPES", {})
    for layout in (line.layout, {}):
        old = read_shard(path, ShardManifestLine.from_json({**line.to_json(), "layout": layout}), "w000")
        assert [g.reward_baseline for g in old] == [None] * 3
        assert [t.reward for g in old for t in g.trajectories] == [t.reward for g in got for t in g.trajectories]
    monkeypatch.undo()
    write_groups(rd, range(3, 5), writer="w001")
    assert [g.reward_baseline for g in drain(SampleReader(rd)) if g.writer == "w001"] == [None, None]


def _share_rank(rank: int, port: int, out_dir: str) -> None:
    """One trainer rank of test_trainer_ranks_receive_the_groups_with_their_reward_baselines: two batches,
    the first with baselines (remax), the second without."""
    import json
    import torch.distributed as dist
    from hpcrl.trainer.share import BATCH, share_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    summary = []
    for with_baselines in (True, False):
        groups = None
        if rank == 0:
            groups = [make_group(i) for i in range(3)]
            for i, g in enumerate(groups):
                g.reward_baseline = 0.5 * i if with_baselines else None
        status, got = share_groups(BATCH, groups)
        summary.append({"status": status, "baselines": [g.reward_baseline for g in got],
                        "rewards": [t.reward for g in got for t in g.trajectories]})
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(summary, f)
    dist.destroy_process_group()


def test_trainer_ranks_receive_the_groups_with_their_reward_baselines(tmp_path):
    """trainer/share.py sends the optional dataset to the other ranks when rank 0's groups have it (remax),
    and nothing for it when they do not (every other run)."""
    import json
    import socket
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_share_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r1 == r0 and all(b["rewards"] == [0.0, 1.0, 2.0] * 3 for b in r1)
    assert [b["baselines"] for b in r1] == [[0.0, 0.5, 1.0], [None] * 3]
