"""Launch failures are loud: each ends with one line naming the cause, within its deadline.

The master's address (from Slurm's node list, resolved: never a silent localhost), the interface gloo and
NCCL use (the route to the master, seen through a veth pair into a network namespace), the ranks'
check-in (a rank that never arrives is named), and the sweep of an earlier attempt's leftovers. A rank
SIGKILLed mid-collective on Slurm is in ``test_multinode.py`` (it needs the private cluster).
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import start_trainer
from hpcrl.process.leftovers import MARK_ENV, job_mark, sweep_leftovers
from hpcrl.process.network import free_port, interface_to
from hpcrl.rundir.paths import RunDir
from hpcrl.trainer.arrival import LaunchError, check_in
from hpcrl.trainer.distributed import choose_interfaces, master_address
from hpcrl.weights.group import gloo_interface

HERE = socket.gethostname()


def fake_scontrol(folder: Path, hosts: str) -> Path:
    """A folder with an ``scontrol`` whose ``show hostnames`` prints ``hosts`` (no cluster needed)."""
    folder.mkdir(exist_ok=True)
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo "{hosts}"\n')
    script.chmod(0o755)
    return folder


def slurm_env(path: str, nodelist: str, **more) -> dict:
    """What a Slurm task of rank 1 of 2 sees (added to the test's environment, which has no RANK)."""
    return dict(PATH=path, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_ID="4242",
                SLURM_JOB_NODELIST=nodelist, **more)


def error_lines(rd: RunDir, job: str = "trainer-rank1") -> list[str]:
    return [l for l in rd.job_log(job).read_text().splitlines() if " ERROR " in l]


@pytest.mark.parametrize("case", ["unresolvable", "no scontrol"])
def test_a_master_that_cannot_be_found_ends_the_rank_in_one_line(tiny_run, tmp_path, case):
    rd = tiny_run()
    if case == "unresolvable":
        bin_dir = fake_scontrol(tmp_path / "bin", "nosuch-node-hpcrl other-node-hpcrl")
        env, cause = slurm_env(f"{bin_dir}:{os.environ['PATH']}", "nosuch-node-hpcrl,other-node-hpcrl"), \
            "the trainer's master node nosuch-node-hpcrl (first of the job's nodes) does not resolve"
    else:
        env, cause = slurm_env(str(tmp_path), "node[01-02]"), "scontrol is not on PATH"
    t0 = time.monotonic()
    job = start_trainer(rd, env=env)
    assert job.wait(120) == 1, job.tail()
    errors = error_lines(rd)
    assert len(errors) == 1 and cause in errors[0], job.tail()
    assert "Traceback" not in job.tail(200)
    print(f"{case}: ended in {time.monotonic() - t0:.1f}s: {errors[0]}")


def test_a_master_name_on_the_loopback_is_refused_on_another_node():
    with pytest.raises(LaunchError, match=r"resolves to 127\.0\.0\.1 \(loopback\) on node-b"):
        master_address(["localhost", "node-b"], here="node-b")
    assert master_address([HERE], here=HERE)  # one node: its own loopback serves


def test_a_rank_that_never_arrives_is_named_within_the_deadline():
    """World of 3: rank 1 arrives, rank 2 never does; rank 0 names rank 2 (and where 1 came from), rank 1
    names the master it waited for, both within the deadline."""
    port, deadline_s, out = free_port(), 3.0, {}

    def rank(r):
        t0 = time.monotonic()
        try:
            check_in(r, 3, "127.0.0.1", port, deadline_s, 1.0)
        except LaunchError as e:
            out[r] = (str(e), time.monotonic() - t0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(out) == {0, 1}, out
    assert out[0][0].startswith("trainer ranks 2 (of 3) did not arrive at the master 127.0.0.1:") and \
        f"arrived: 0 on {HERE}, 1 on {HERE}" in out[0][0]
    assert "rank 0 at 127.0.0.1" in out[1][0] and "did not confirm the world in 3s" in out[1][0]
    assert all(s < deadline_s + 2.0 for _, s in out.values()), out


def test_the_trainer_names_a_missing_rank_and_sweeps_an_earlier_attempt(tiny_run, tmp_path):
    """The real trainer as rank 0 of 2 with no rank 1: one line naming rank 1 within timeouts.rendezvous_s.
    At its start it ends a leftover of an earlier attempt of the trainer (a process running ``hpcrl trainer
    RUN`` under another job id) and leaves the rollout job's alone."""
    rd = tiny_run("timeouts.rendezvous_s=5")
    fake = tmp_path / "hpcrl"
    # a loop of short sleeps: once the shell is killed nothing of it outlives the test (a long sleep would, holding
    # the test's output open)
    fake.write_text("#!/bin/sh\nwhile :; do sleep 0.2; done\n")
    fake.chmod(0o755)
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, SLURM_JOB_ID="1"))
    old = subprocess.Popen([str(fake), "trainer", str(rd.root)], **quiet)
    other = subprocess.Popen([str(fake), "rollout", str(rd.root), "--writer-rank", "0"], **quiet)
    try:
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "SLURM_JOB_ID": "2"}
        job = start_trainer(rd, env=env)
        assert job.wait(300) == 1, job.tail()
        assert old.wait(5) == -signal.SIGKILL and other.poll() is None
    finally:
        other.kill()
        old.kill()
    errors = error_lines(rd, "trainer")
    assert len(errors) == 1 and "trainer ranks 1 (of 2) did not arrive at the master 127.0.0.1:" in errors[0] \
        and "in 5s (timeouts.rendezvous_s)" in errors[0], job.tail()
    log = rd.job_log("trainer").read_text()
    assert f"ended 1 leftover process(es) of an earlier attempt of trainer on this node: pids {old.pid}" in log


def test_the_sweep_ends_other_attempts_only(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    run.mkdir()
    mark = job_mark(run, "rollout-w000")
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    procs = {name: subprocess.Popen(sleep, env=dict(base, **env)) for name, env in {
        "earlier attempt": {MARK_ENV: mark, "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"},
        "this attempt": {MARK_ENV: mark, "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "SLURM_STEP_ID": "0"},
        "this attempt's srun": {MARK_ENV: mark, "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"},  # batch step
        "another writer": {MARK_ENV: job_mark(run, "rollout-w001"), "SLURM_JOB_ID": "6"}}.items()}
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "7")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        monkeypatch.setenv("SLURM_STEP_ID", "0")
        monkeypatch.delenv("SUBMITIT_LOCAL_JOB_ID", raising=False)
        caplog.set_level("INFO")
        ended = sweep_leftovers(run, "rollout-w000", ("rollout", "--writer-rank", "0"))
        assert ended == [procs["earlier attempt"].pid]
        assert procs["earlier attempt"].wait(5) == -signal.SIGKILL
        assert all(procs[p].poll() is None for p in ("this attempt", "this attempt's srun", "another writer"))
        assert "ended 1 leftover process(es) of an earlier attempt of rollout-w000" in caplog.text
        assert sweep_leftovers(run, "rollout-w000", ("rollout", "--writer-rank", "0")) == []
        assert "no leftover processes of rollout-w000" in caplog.text
    finally:
        for p in procs.values():
            p.kill()


def test_vllm_sockets_go_to_a_folder_of_the_process_that_is_removed_once_it_is_gone(monkeypatch, caplog):
    """rollout/vllm_sockets.py: vLLM's socket files go to <tmp>/hpcrl-vllm-<pid>/; the folders of processes that
    no longer run are removed by the next engine start, those of running ones are kept; a VLLM_RPC_BASE_PATH the
    user set is kept (the engine itself: test_vllm.py's SIGKILL test)."""
    import shutil
    import tempfile

    from hpcrl.rollout import vllm_sockets

    tmp_path = Path(tempfile.mkdtemp(prefix="hv", dir="/tmp"))  # short: a socket's path must fit in 107 bytes
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(vllm_sockets.atexit, "register", lambda *a, **k: None)  # not this test process's exit
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        for pid in (gone.pid, running.pid):
            (tmp_path / f"hpcrl-vllm-{pid}").mkdir()
            (tmp_path / f"hpcrl-vllm-{pid}" / "0b1c-socket").touch()
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/scratch/mine")
        assert vllm_sockets.use_own_socket_folder() is None and os.environ["VLLM_RPC_BASE_PATH"] == "/scratch/mine"
        assert (tmp_path / f"hpcrl-vllm-{gone.pid}").exists(), "nothing is swept where the user chose the folder"
        monkeypatch.delenv("VLLM_RPC_BASE_PATH")
        caplog.set_level("INFO")
        own = vllm_sockets.use_own_socket_folder()
        assert own == tmp_path / f"hpcrl-vllm-{os.getpid()}" and own.is_dir()
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(own)
        assert not (tmp_path / f"hpcrl-vllm-{gone.pid}").exists(), "a gone process's folder is removed"
        assert (tmp_path / f"hpcrl-vllm-{running.pid}" / "0b1c-socket").exists(), "a running one's is kept"
        assert "removed 1 vLLM socket folder(s)" in caplog.text
        assert vllm_sockets.use_own_socket_folder() == own, "a second engine of the process shares its folder"
        monkeypatch.delenv("VLLM_RPC_BASE_PATH")
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ("x" * 60)))
        assert vllm_sockets.use_own_socket_folder() is None, "no folder that makes a socket's path too long"
        assert "longer than a socket's 107 bytes" in caplog.text and "VLLM_RPC_BASE_PATH" not in os.environ
    finally:
        running.kill()
        shutil.rmtree(tmp_path)


def test_the_interface_is_the_route_to_the_master(veth, monkeypatch, caplog):
    assert interface_to(veth) == ("hpcrlt0", "10.231.7.1")
    assert interface_to("127.0.0.1") == ("lo", "127.0.0.1")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    caplog.set_level("INFO")
    got = choose_interfaces(["master-node", "this-node"], "this-node", veth)
    assert got == {"GLOO_SOCKET_IFNAME": "hpcrlt0", "NCCL_SOCKET_IFNAME": "hpcrlt0"}
    assert "GLOO_SOCKET_IFNAME=hpcrlt0: the route from this-node (10.231.7.1) to trainer node master-node" in caplog.text
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # the user's choice is kept, and said
    assert choose_interfaces(["master-node", "this-node"], "this-node", veth) == {"NCCL_SOCKET_IFNAME": "hpcrlt0"}
    assert "GLOO_SOCKET_IFNAME=eth9 (set by you" in caplog.text
    assert choose_interfaces(["one-node"], "one-node", "127.0.0.1") == {}
    assert gloo_interface([veth])[0] is None, "the broadcast group keeps the user's GLOO_SOCKET_IFNAME"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert gloo_interface([veth]) == ("hpcrlt0", f"hpcrlt0, the route to {veth}")
    assert gloo_interface([veth, "127.0.0.1"])[0] is None  # peers behind two interfaces: gloo's own choice
    with pytest.raises(LaunchError, match="is the loopback"):
        choose_interfaces(["master-node", "this-node"], "this-node", "127.0.0.1")


def test_a_dying_rank_ends_the_whole_trainer_job_whichever_way_it_is_submitted(tiny_run):
    """Both ways onto Slurm start the ranks with ``srun --kill-on-bad-exit=1`` (the effect, on a real
    cluster, is in test_multinode.py), and submitit's jobs carry their mark for the next attempt's sweep."""
    from conftest import REPO
    from hpcrl.launcher.submit import plan_jobs, slurm_parameters

    rd = tiny_run()
    for job in plan_jobs(rd.load_config(), rd):
        params = slurm_parameters(job)
        assert params["slurm_srun_args"] == ["--kill-on-bad-exit=1"]
        assert params["slurm_setup"][-1] == f"export {MARK_ENV}='{job_mark(rd.root, job.name)}'"
    for script in ("trainer.sbatch", "rollout.sbatch"):
        assert "srun --kill-on-bad-exit=1 " in (REPO / "sbatch" / script).read_text()
