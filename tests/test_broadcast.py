"""Weight broadcast (gloo on CPU) between real processes: the receiver generates like the trainer,
an unreachable or stale rendezvous falls back to files within its timeout, a wrong secret is
refused on both sides, a receiver SIGKILLed mid-broadcast is dropped and the trainer goes on, and
a whole run with weights.transport=broadcast takes its versions by broadcast, exactly once."""
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, BackgroundCommand, check_exactly_once
from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.control.records import HeartbeatThread
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.rundir.paths import RunDir
from hpcrl.weights import make_publisher, make_subscriber
from hpcrl.weights.group import BroadcastFailed, backend_choice, choose_backend
from hpcrl.weights.rendezvous import BroadcastRendezvous

PEER = REPO / "tests" / "broadcast_peer.py"
FAST = TimeoutsConfig(broadcast_connect_s=2.0, broadcast_s=5.0, wait_weights_s=4.0)


_BEATS: list = []


@pytest.fixture(autouse=True)
def _stop_heartbeats():
    yield
    while _BEATS:
        _BEATS.pop().stop("done")


def trainer_side(rd: RunDir, transport: str = "broadcast", bucket_mib: float = 0.05, timeouts=FAST):
    """The trainer's publisher, in a process that beats as the trainer (a reader joins a live trainer only)."""
    _BEATS.append(HeartbeatThread(rd, RunDir.trainer_job(), "trainer", 0.5).start())
    return make_publisher(WeightsConfig(transport=transport, bucket_mib=bucket_mib), rd, timeouts)


def rollout_side(rd: RunDir, reader: str = "w000", transport: str = "broadcast", timeouts=FAST):
    """A rollout job's subscriber."""
    return make_subscriber(WeightsConfig(transport=transport), rd, reader, timeouts)


def tiny_model(rd: RunDir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(rd.base_model, dtype=torch.float32).eval()


def start_peer(rd: RunDir, out, *args, env=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **(env or {}))
    log = open(rd.root / f"{out.stem}.log", "wb")
    return subprocess.Popen([sys.executable, str(PEER), str(rd.root), str(out), "--broadcast-s",
                             str(FAST.broadcast_s), *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def wait_joined(wt, peer, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while wt.waiting_members() < 1:
        assert peer.poll() is None, f"peer exited ({peer.returncode}) before joining"
        assert time.monotonic() < end, "peer did not join the broadcast"
        time.sleep(0.05)


def perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def publish(wt, version: int, model):
    """What the publish did, and the seconds it took."""
    t0 = time.monotonic()
    out = wt.publish(version, model.state_dict(), model.config.to_json_string(), version, 4 * version)
    return out, time.monotonic() - t0


def test_buckets_roundtrip_odd_sizes_dtypes_and_tied_tensors(tmp_path):
    """In one process (two threads): buckets smaller than a tensor, bf16/int64, a tied alias."""
    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s3cret")
    tt, rt = trainer_side(rd, bucket_mib=0.001), rollout_side(rd)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 7, generator=g)
    sd = {"emb": emb, "lm_head": emb, "b": torch.randn(5, generator=g).to(torch.bfloat16),
          "steps": torch.arange(3), "big": torch.randn(3001, generator=g), "scalar": torch.tensor(2.5)}
    tt.publish(0, sd, "{}", 0, 0)
    first = rt.load(0)
    assert first.manifest.param_version == 0 and first.path == "filesystem" and first.mapped is None
    assert tt.waiting_members() == 1
    sd = {k: v + 1 if v.dtype != torch.int64 else v * 2 for k, v in sd.items()}
    sd["lm_head"] = sd["emb"]
    out = tt.publish(1, sd, "{}", 1, 4)
    assert out.path == "broadcast" and out.members == 1 and out.backend == "gloo", "auto picks gloo on CPU"
    assert out.metrics()["weights/path"] == "broadcast" and out.metrics()["weights/broadcast_members"] == 1
    with rt.take(1) as wv:
        assert wv.path == "broadcast" and wv.folder == rd.weight_version_dir(1)
        for k, v in sd.items():
            assert wv.tensors[k].dtype == v.dtype and torch.equal(wv.tensors[k], v), k
        assert wv.tensors["emb"].data_ptr() == wv.tensors["lm_head"].data_ptr(), "a tied alias is the same tensor"
        # the buffer is a shared-memory file the engine's workers map: every name has its row, the alias too
        rows = {e.name: e for e in wv.mapped.layout}
        assert Path(wv.mapped.path).parent == Path("/dev/shm") and set(rows) == set(sd)
        assert rows["lm_head"].offset_bytes == rows["emb"].offset_bytes
        assert wv.mapped.nbytes == Path(wv.mapped.path).stat().st_size
    tt.close(), rt.close()


@pytest.mark.parametrize("configured, sender, members, backend", [
    ("auto", "cpu", ["cpu"], "gloo"), ("auto", "cuda", ["cuda", "cuda"], "nccl"), ("auto", "cuda", ["cuda", "cpu"], "gloo"),
    ("auto", "cuda", [], "gloo"), ("auto", "cpu", ["cuda"], "gloo"), ("gloo", "cuda", ["cuda"], "gloo"),
    ("nccl", "cpu", ["cuda"], "nccl")])
def test_the_broadcast_backend_is_nccl_only_where_both_ends_hold_cuda_tensors(configured, sender, members, backend):
    assert choose_backend(configured, sender, members) == backend


@pytest.mark.parametrize("configured, sender, members, backend, why", [
    ("auto", "cpu", {"w000@a:1": "cpu"}, "gloo", "auto: the trainer's tensors are in cpu memory"),
    ("auto", "cuda", {"w000@a:1": "cuda", "w001@b:2": "cpu"}, "gloo", "auto: w001@b:2 receive(s) into host memory, not CUDA"),
    ("auto", "cuda", {}, "gloo", "auto: no member yet"),
    ("auto", "cuda", {"w000@a:1": "cuda", "w001@b:2": "cuda"}, "nccl",
     "auto: the trainer's tensors and every member (w000@a:1, w001@b:2) are on CUDA"),
    ("gloo", "cuda", {"w000@a:1": "cuda"}, "gloo", "weights.broadcast_backend=gloo")])
def test_the_backend_choice_says_why(configured, sender, members, backend, why):
    assert backend_choice(configured, sender, members) == (backend, why)


def test_each_broadcast_version_logs_its_backend_and_why_on_both_ends(tmp_path, caplog):
    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s")
    tt, r1 = trainer_side(rd, bucket_mib=0.001), rollout_side(rd, "w000")
    caplog.set_level("INFO")
    sd = lambda v: {"w": torch.full((3000,), float(v))}  # noqa: E731
    tt.publish(0, sd(0), "{}", 0, 0)
    r1.load(0)
    for v in (1, 2):
        tt.publish(v, sd(v), "{}", v, 4 * v)
        assert r1.load(v).path == "broadcast"
        assert re.search(rf"weight version {v}: broadcast over gloo to w000@\S+ \(auto: the trainer's tensors are in "
                         r"cpu memory\)", caplog.text), caplog.text
        assert re.search(rf"received weight version {v} by broadcast over gloo in [0-9.]+s \(auto: the trainer's "
                         r"tensors are in cpu memory\)", caplog.text), caplog.text
    tt.close(), r1.close()


def test_a_reader_on_cpu_is_refused_by_an_nccl_trainer_in_one_line(tmp_path, caplog):
    """nccl cannot be formed on CPU; the runtime check that stands behind the config's refusal."""
    from hpcrl.weights.broadcast import BroadcastSender
    from hpcrl.weights.publisher import WeightPublisher

    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s")
    _BEATS.append(HeartbeatThread(rd, RunDir.trainer_job(), "trainer", 0.5).start())
    tt = WeightPublisher(rd, 3, sender=BroadcastSender(rd, required=True, bucket_mib=1, connect_s=2.0, broadcast_s=5.0,
                                                       backend="nccl"))
    tt.publish(0, {"w": torch.ones(3)}, "{}", 0, 0)
    caplog.set_level(logging.INFO)
    with pytest.raises(BroadcastFailed, match="weights.broadcast_backend=nccl, but it receives into cpu memory"):
        rollout_side(rd).take(0)
    auto = rollout_side(rd, transport="auto")
    with auto.take(0) as wv:
        assert wv.path == "filesystem" and wv.tensors["w"].sum() == 3
    assert tt.waiting_members() == 0
    tt.close(), auto.close()


@pytest.mark.parametrize("override, allowed", [
    ("weights.transport=nccl", "'auto', 'broadcast', 'filesystem'"), ("weights.bucket_mib=0", "a number > 0.0"),
    ("weights.bucket_mb=8", "weights.bucket_mib (renamed)"), ("weights.broadcast_backend=mpi", "'auto', 'gloo', 'nccl'"),
    ("weights.broadcast_backend=nccl", "auto or gloo on a run without GPUs"),
    ("timeouts.broadcast_s=0", "a number > 0.0"), ("timeouts.broadcast_connect_s=-1", "a number > 0.0")])
def test_bad_broadcast_config_fails_before_anything_is_submitted(tmp_path, capsys, override, allowed):
    from hpcrl.cli import main as cli_main

    assert cli_main(["run", str(TINY), override, "--run-dir", str(tmp_path / "r"), "--executor", "local"]) == 2
    err = capsys.readouterr().err
    assert override.split("=")[0] in err and allowed in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("bucket_bytes", [64, 1000, 5000, 1 << 20])
def test_messages_cover_every_tensor_byte_once_within_the_bucket_size(bucket_bytes):
    from hpcrl.weights.wire import messages, plan

    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(0, 3000, (40,), generator=g).tolist() + [0, 1, 7000]
    entries, total = plan({f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)})
    msgs = messages(entries, total, bucket_bytes)
    covered = torch.zeros(total, dtype=torch.int32)
    for lo, hi, idx in msgs:
        assert 0 < hi - lo <= bucket_bytes
        if idx >= 0:  # sent from the tensor's own storage: inside it
            assert entries[idx].offset_bytes <= lo and hi <= entries[idx].offset_bytes + entries[idx].nbytes
        covered[lo:hi] += 1
    assert covered.max() == 1, "no byte is sent twice"
    for e in entries:
        assert (covered[e.offset_bytes:e.offset_bytes + e.nbytes] == 1).all(), e.name
    if bucket_bytes <= 5000:  # the 7000-byte tensor is at least half a bucket: sent without a copy
        assert any(i >= 0 for *_, i in msgs) and any(i < 0 for *_, i in msgs), "both kinds of message occur"
    else:
        assert all(i < 0 for *_, i in msgs) and len(msgs) == 1, "all small: one packed bucket"


def test_two_receivers_form_a_group_of_three_and_a_late_joiner_enters_at_the_next_version(tmp_path):
    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s")
    tt, r1, r2 = trainer_side(rd, bucket_mib=0.001), rollout_side(rd, "w000"), rollout_side(rd, "w001")
    sd = lambda v: {"w": torch.full((5000,), float(v)), "b": torch.arange(7) + v}  # noqa: E731
    tt.publish(0, sd(0), "{}", 0, 0)
    r1.load(0)
    assert tt.publish(1, sd(1), "{}", 1, 4).members == 1
    assert r2.load(1).path == "filesystem"  # joins late: v1 from files, a member from v2 on
    got = r1.load(1)
    assert torch.equal(got.tensors["w"], sd(1)["w"]) and got.path == "broadcast"
    assert tt.publish(2, sd(2), "{}", 2, 8).members == 2, "the group was re-formed with both"
    for r in (r1, r2):
        got = r.load(2)
        assert got.path == "broadcast" and torch.equal(got.tensors["b"], sd(2)["b"]), r.reader
    tt.close(), r1.close(), r2.close()


def test_two_processes_broadcast_the_tiny_model_and_generate_like_the_trainer(tiny_run):
    rd = tiny_run("weights.transport=broadcast")
    wt = trainer_side(rd)
    model = tiny_model(rd)
    publish(wt, 0, model)
    out = rd.root / "peer.json"
    peer = start_peer(rd, out, "--versions", "0,1")
    wait_joined(wt, peer)
    from broadcast_peer import greedy

    before = greedy(model)
    perturb(model, 1)
    sync = publish(wt, 1, model)[0].metrics()
    assert sync["weights/path"] == "broadcast", sync
    assert sync["weights/bytes"] > 1e6 and sync["weights/gb_per_s"] > 0
    assert peer.wait(60) == 0, (rd.root / "peer.log").read_text()[-3000:]
    got = json.loads(out.read_text())
    assert got["paths"]["0"]["weights/path"] == "filesystem", "v0 was published before the peer joined"
    assert got["paths"]["1"]["weights/path"] == "broadcast"
    want = greedy(model)
    assert want != before, "the perturbation must change the greedy outputs, or this test proves nothing"
    assert got["tokens"] == want
    wt.close()


EXIT_WHILE_IN_THE_STORE = """
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from hpcrl.process.threads import spawn
store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
stop, inside = threading.Event(), threading.Event()
def follow():  # like the receiver: short native calls on the store until stopped
    while not stop.is_set():
        inside.set()
        try:
            store.wait(["never"], timedelta(seconds=0.3))
        except Exception:
            pass
if sys.argv[1] == "spawn":
    spawn(follow, "follower", bound_s=2.0, stop=stop)
else:
    threading.Thread(target=follow, daemon=True).start()
class SlowTeardown:  # the interpreter's shutdown takes 0.6 s (sleeping, without the GIL) once it is finalizing,
    def __del__(self, sleep=time.sleep):  # so the follower comes back from the store then, whatever the
        sleep(0.6)                         # machine's speed (the module `time` is gone by then)
slow_teardown = SlowTeardown()
inside.wait(10)
time.sleep(0.1)
"""


def exit_while_in_the_store(started_by: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", EXIT_WHILE_IN_THE_STORE, started_by], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)


def test_a_process_exits_cleanly_while_a_broadcast_thread_waits_in_the_store():
    """Python 3.11 unwinds a daemon thread that comes back from torch after shutdown began, and
    the process aborts (exit 134) after its work is done: the broadcast's threads are waited for."""
    p = exit_while_in_the_store("spawn")
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 no longer unwinds daemon threads at exit: "
                    "the hazard the test above guards against cannot be shown there")
def test_a_plain_daemon_thread_in_the_store_aborts_the_process_at_exit():
    """The hazard itself, so that the test above can fail: without the exit wait the process aborts. The thread
    must come back from the store while the interpreter shuts down: the script's slow teardown makes sure it
    does (without it a quiet machine finished shutting down first and the test read exit 0 five times); up to 5
    tries, one abort needed."""
    tries = []
    for _ in range(5):
        p = exit_while_in_the_store("plain")
        tries.append(p.returncode)
        if p.returncode == -6:
            assert "terminate called" in p.stderr, p.stderr[-2000:]
            return
    raise AssertionError(f"a plain daemon thread never aborted the process in 5 tries: exit codes {tries}")


def test_wrong_secret_is_refused_on_both_sides(tmp_path, caplog):
    rd = RunDir(tmp_path).create()
    rd.secret.write_text("the-run-secret")
    tt = trainer_side(rd)
    tt.publish(0, {"w": torch.ones(3)}, "{}", 0, 0)
    rd.secret.write_text("a-stranger-secret")  # the joiner reads this one; the trainer read its own at start
    caplog.set_level(logging.INFO)
    with pytest.raises(BroadcastFailed, match="refused w000: wrong secret"):
        rollout_side(rd).take(0)
    auto = rollout_side(rd, transport="auto")
    got = auto.load(0)
    assert got.tensors["w"].sum() == 3 and got.path == "filesystem"
    refusals = [r.getMessage() for r in caplog.records if "refused broadcast peer w000@" in r.getMessage()]
    assert len(refusals) == 2 and "does not know this run's secret" in refusals[0]
    assert tt.waiting_members() == 0
    tt.close(), auto.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("rendezvous", ["stale", "missing"])
def test_without_a_live_trainer_auto_uses_the_files_and_broadcast_waits_for_one_bounded(tmp_path, rendezvous):
    """A rendezvous of a trainer that died (both jobs killed), or none yet (the trainer is down): ``auto`` takes
    the files at once; ``broadcast`` waits for a live trainer to announce itself, at most wait_weights_s, and then
    fails naming what it waited for and what is there."""
    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s")
    make_publisher(WeightsConfig(transport="filesystem"), rd).publish(0, {"w": torch.ones(2)}, "{}", 0, 0)
    port = closed_port()
    if rendezvous == "stale":  # a trainer that died: nobody listens there any more
        write_json_atomic(rd.broadcast_rendezvous, BroadcastRendezvous("127.0.0.1", port, "dead", 1, 0.0).to_json())
    t0 = time.monotonic()
    auto = rollout_side(rd, transport="auto")
    got = auto.load(0)
    assert torch.equal(got.tensors["w"], torch.ones(2)) and got.path == "filesystem"
    assert time.monotonic() - t0 < FAST.broadcast_connect_s + 3
    t0 = time.monotonic()
    there = f"names the trainer at 127.0.0.1:{port}" if rendezvous == "stale" else "no "
    with pytest.raises(BroadcastFailed, match=f"gave up after .* a live trainer's broadcast rendezvous .*{there}"):
        rollout_side(rd).take(0)
    assert FAST.wait_weights_s <= time.monotonic() - t0 < FAST.wait_weights_s + 3
    auto.close()


def test_a_live_trainer_that_cannot_be_reached_fails_a_broadcast_reader_in_one_line(tmp_path):
    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s")
    make_publisher(WeightsConfig(transport="filesystem"), rd).publish(0, {"w": torch.ones(2)}, "{}", 0, 0)
    port = closed_port()  # the trainer beats (this process), but its store cannot be reached
    write_json_atomic(rd.broadcast_rendezvous,
                      BroadcastRendezvous(socket.gethostname(), port, "e", os.getpid(), time.time()).to_json())
    _BEATS.append(HeartbeatThread(rd, RunDir.trainer_job(), "trainer", 0.5).start())
    t0 = time.monotonic()
    with pytest.raises(BroadcastFailed, match=f"connecting to the broadcast store at .*:{port}"):
        rollout_side(rd).take(0)
    assert time.monotonic() - t0 < FAST.broadcast_connect_s + 3


def test_receiver_sigkilled_mid_broadcast_is_dropped_and_the_trainer_goes_on(tiny_run, caplog):
    rd = tiny_run("weights.transport=broadcast")
    wt = trainer_side(rd)
    model = tiny_model(rd)
    publish(wt, 0, model)
    peer = start_peer(rd, rd.root / "killed.json", "--versions", "0,1",
                      env={"HPCRL_FAULT_POINT": "broadcast_bucket:3:kill"})
    wait_joined(wt, peer)
    caplog.set_level(logging.INFO)
    perturb(model, 1)
    out, took = publish(wt, 1, model)
    assert peer.wait(30) == -9, "the peer SIGKILLed itself at its third bucket"
    assert took < FAST.broadcast_s + 3, f"publish took {took:.1f}s with a dead peer"
    assert out.path == "filesystem" and out.members == 0
    assert any("dropping broadcast peers w000@" in r.getMessage() for r in caplog.records)
    assert wt.waiting_members() == 0
    assert rd.weight_manifest(1).exists(), "the version is in files all the same"
    out, took = publish(wt, 2, model)
    assert took < 2 and out.path == "filesystem", "no member left: nothing to wait for"
    wt.close()


def test_receiver_sigkilled_between_publishes_costs_the_trainer_nothing(tiny_run, caplog):
    """A member that stopped beating (killed while idle) is dropped before the group is formed, so
    the next publish does not wait ``timeouts.broadcast_s`` for it."""
    rd = tiny_run("weights.transport=broadcast")
    wt = trainer_side(rd)
    model = tiny_model(rd)
    publish(wt, 0, model)
    peer = start_peer(rd, rd.root / "idle.json", "--versions", "0,1,2")
    wait_joined(wt, peer)
    assert publish(wt, 1, model)[0].members == 1, "a live member receives"
    peer.kill()
    peer.wait(10)
    time.sleep(wt.sender._sender.stale_s + 1)
    caplog.set_level(logging.INFO)
    out, took = publish(wt, 2, model)
    assert took < FAST.broadcast_s / 2, f"publish took {took:.1f}s with a member killed while idle"
    assert out.path == "filesystem" and wt.waiting_members() == 0
    assert any("no sign of life" in r.getMessage() and "w000@" in r.getMessage() for r in caplog.records)
    wt.close()


def test_trainer_sigkilled_mid_broadcast_leaves_the_rollout_on_files(tiny_run, caplog):
    """The trainer writes files first, so the version it died broadcasting is read from them."""
    rd = tiny_run("weights.transport=broadcast")
    trainer = start_peer(rd, rd.root / "trainer.json", "--role", "trainer",
                         env={"HPCRL_FAULT_POINT": "broadcast_bucket:3:kill"})
    wt = rollout_side(rd)
    end = time.monotonic() + 60
    while not rd.weight_manifest(0).exists():
        assert trainer.poll() is None and time.monotonic() < end, (rd.root / "trainer.log").read_text()[-2000:]
        time.sleep(0.05)
    caplog.set_level(logging.INFO)
    assert wt.load(0).path == "filesystem"
    assert trainer.wait(60) == -9, "the trainer SIGKILLed itself at its third bucket"
    t0 = time.monotonic()
    got = wt.load(1)
    state = got.tensors
    assert time.monotonic() - t0 < FAST.broadcast_s + 3
    assert got.path == "filesystem"
    files = make_subscriber(WeightsConfig(transport="filesystem"), rd, "w001").load(1).tensors
    assert all(torch.equal(state[k], files[k]) for k in files) and len(state) == len(files)
    assert any("broadcast of weight version 1 failed" in r.getMessage() or "lost the broadcast store" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    wt.close()


@pytest.mark.slow
def broadcast_launch(folder: Path) -> list[str]:
    """`hpcrl run configs/tiny.yaml weights.transport=broadcast` for 12 updates, with the broadcast's limits of a
    starved background run (bench/gpu_check.sh's are the same) and no evaluation job (not asserted here)."""
    return ["run", str(TINY), "weights.transport=broadcast", "rollout.total_rollout_steps=48", "eval.every_versions=0",
            "timeouts.broadcast_connect_s=120", "timeouts.broadcast_s=1200", "--run-dir", str(folder / "run"),
            "--executor", "local", "--timeout-min", "30"]


BACKGROUND_RUNS = {"broadcast:run": BackgroundCommand.hpcrl_args(broadcast_launch)}
"""In the background when the session starts (conftest.BackgroundRuns): its test asserts nothing about speed."""


def background_keys(item) -> tuple[str, ...]:
    """The background run a test item reads (none: it runs its own processes)."""
    reads = item.originalname == "test_run_with_broadcast_takes_versions_by_broadcast_exactly_once"
    return ("broadcast:run",) if reads else ()


def test_run_with_broadcast_takes_versions_by_broadcast_exactly_once(background_runs):
    out = background_runs.launched("broadcast:run", timeout_s=900)
    assert out.returncode == 0, out.stdout[-3000:]
    rd = RunDir(Path(out.args[out.args.index("--run-dir") + 1]))
    rows = [json.loads(x) for x in rd.rollout_metrics("w000").read_text().splitlines()]
    paths = [r["weights/path"] for r in rows]
    assert paths[0] == "filesystem", "v0 is loaded before the rollout job joins"
    assert paths.count("broadcast") >= len(paths) - 2, paths
    metrics = [json.loads(x) for x in rd.metrics.read_text().splitlines()]
    sent = [m for m in metrics if m.get("weights/path") == "broadcast"]
    assert len(sent) >= len(metrics) - 2 and all(m["weights/broadcast_members"] == 1 for m in sent)
    assert all(m["timing_s/param_sync/transfer"] > 0 and "timing_s/param_sync/gather" in m for m in sent)
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)


def test_shared_memory_buffers_go_with_their_tensor_and_a_killed_jobs_files_are_swept(tmp_path):
    """A receive buffer is a file while its tensor lives (vLLM's worker maps it by name); the files of a
    SIGKILLed job (its pid gone) are removed by the next allocation on the node, a live job's are kept."""
    import gc

    from hpcrl.weights import shared_memory as shm

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{shm.PREFIX}{dead.pid}-0"
    alive = tmp_path / f"{shm.PREFIX}{os.getppid()}-0"
    left.write_bytes(b"x"), alive.write_bytes(b"x")
    shm._swept = False
    flat = shm.shared_buffer(1 << 16, tmp_path)
    assert not left.exists() and alive.exists(), "only the dead job's buffer is swept"
    path = flat.untyped_storage().filename
    assert Path(path).parent == tmp_path and Path(path).stat().st_size == 1 << 16
    flat2, path2 = shm.receive_buffer(1024, tmp_path / "no-such-folder")
    assert path2 is None and flat2.numel() == 1024, "no shared memory there: private memory, no file"
    del flat
    gc.collect()
    assert not Path(path).exists(), "the file goes with its buffer"
    with pytest.raises(OSError, match="no room"):
        shm.shared_buffer(1 << 62, tmp_path)
    assert not list(tmp_path.glob(f"{shm.PREFIX}{os.getpid()}-*")), "a refused buffer leaves no file"


def test_zero3_policy_is_gathered_per_layer_on_two_ranks_bit_for_bit(tmp_path):
    """Two ZeRO-3 ranks (DeepSpeed, gloo): rank 0's gathered policy equals the model's weights and
    DeepSpeed's own consolidation, tied weights stay one tensor, the value head is left out, and it took
    one gather per decoder layer plus one for the rest."""
    out = tmp_path / "zero3.json"
    for attempt in range(3):  # the port is free when picked; another process may take it before the store binds it
        port = closed_port()
        procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "zero3_peer.py"), str(out), "--layers", "3"],
                                  env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port), LOCAL_RANK=str(r), PYTHONPATH=str(REPO)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO) for r in range(2)]
        logs = []
        for p in procs:
            try:
                p.wait(timeout=300 if attempt == 2 else 120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logs.append(p.stdout.read().decode())
        if all(p.returncode == 0 for p in procs):
            break
        if not any("EADDRINUSE" in log or "address already in use" in log.lower() for log in logs):
            raise AssertionError(logs[0][-3000:] + logs[1][-3000:])
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:]
    got = json.loads(out.read_text())
    assert got["world"] == 2 and got["sharded_empty"], "the parameters were partitioned (ZeRO-3)"
    assert got["equal_to_model"] and got["equal_to_deepspeed"] and got["tied_shared"], got
    assert got["value_head_left_out"] and got["gathers"] == 3 + 1, got


@pytest.mark.slow
def test_both_jobs_sigkilled_with_broadcast_resume_with_the_same_commands_rollout_first(tiny_run):
    """weights.transport=broadcast: SIGKILL both jobs mid-run, start the rollout job again while the trainer is
    still down (the rendezvous names the dead trainer): it waits, saying so, instead of failing; the trainer
    restarted with the same command announces itself at start, the rollout job joins it, the run finishes
    exactly once and the versions after the restart come by broadcast."""
    from conftest import start_rollout, start_trainer, wait_until
    from hpcrl.rundir.fsio import read_jsonl

    rd = tiny_run("weights.transport=broadcast", "rollout.total_rollout_steps=120", "timeouts.wait_weights_s=120",
                  "trainer.checkpoint_every_updates=5")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: sum(1 for _ in read_jsonl(rd.metrics)) >= 8, 180, "8 updates", jobs=(trainer, rollout))
    trainer.kill(), rollout.kill()
    rollout = start_rollout(rd)
    wait_until(lambda: "no live trainer to join yet" in rollout.log_path.read_text(), 60,
               "the rollout job to wait for a live trainer", jobs=(rollout,))
    time.sleep(3)
    assert rollout.proc.poll() is None, "the rollout job must wait for the trainer, not fail:\n" + rollout.tail()
    rows_before = len(rd.rollout_metrics("w000").read_text().splitlines())
    trainer = start_trainer(rd)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
    after = [json.loads(x)["weights/path"] for x in rd.rollout_metrics("w000").read_text().splitlines()[rows_before:]]
    assert after.count("broadcast") >= len(after) - 2, after
