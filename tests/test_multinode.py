"""Against a private three-node Slurm cluster on this machine (sbatch/private-multinode.sh): each node a
slurmd in its own network namespace, with its own host name, address and /etc/hosts; one slurmctld.

- the nodes are three hosts (a job's processes run in their node's namespace);
- a trainer rank SIGKILLed mid-collective ends the whole step at once (srun --kill-on-bad-exit=1), with
  Slurm's line naming the task, instead of leaving the other rank in the collective;
- (slow) a run with ``resources.trainer.nodes=2`` (one rank per node, gloo, ZeRO-3) and the rollout job on
  the third node, weights by broadcast across hosts, checked exactly once.

Needs root and network namespaces (CI runs as root); skipped with the reason where they are not allowed.
By hand: ``sbatch/private-multinode.sh start /tmp/mn 3``, ``export SLURM_CONF=/tmp/mn/slurm.conf``, then
``srun -N3 hostname`` or ``sbatch/submit.sh``; ``sbatch/private-multinode.sh stop /tmp/mn`` removes it all.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, check_exactly_once, wait_until
from hpcrl.rundir.fsio import read_json, read_jsonl
from hpcrl.rundir.paths import RunDir

CLUSTER = REPO / "sbatch" / "private-multinode.sh"
NODES = ("hpcrl-n1", "hpcrl-n2", "hpcrl-n3")


def _skip_reason() -> str | None:
    """Why the cluster cannot start here (None: it can). Missing packages are no reason: the script installs them
    as sbatch/private-cluster.sh does (on a fresh CI machine this module runs before the Slurm tests that used to
    install them, and was skipped)."""
    if os.geteuid() != 0:
        return "the multi-node cluster needs root (namespaces, slurmd, munged); CI runs as root"
    if not shutil.which("ip"):
        return None  # iproute2 comes with the packages; a machine that refuses namespaces fails the start, loudly
    probe = subprocess.run(["ip", "netns", "add", "hpcrl-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces are not allowed here: ip netns add: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "hpcrl-probe"], capture_output=True)
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("multinode")
    t0 = time.monotonic()
    subprocess.run(["bash", str(CLUSTER), "start", str(folder), "3"], check=True, timeout=300)
    print(f"three-node cluster up in {time.monotonic() - t0:.1f}s")
    # the nodes are this machine: they share its build of DeepSpeed's ops (built by install.sh) as a cluster's
    # identical nodes would with TORCH_EXTENSIONS_DIR set (each fake node would otherwise build it, ~45 s of
    # compiling; tests/test_startup.py covers a node that builds its own)
    from hpcrl.trainer.ops import node_extensions_dir

    ops = os.environ.get("TORCH_EXTENSIONS_DIR") or str(node_extensions_dir())
    env = dict(os.environ, SLURM_CONF=str(folder / "slurm.conf"), HPCRL_PYTHON=sys.executable,
               PYTHONPATH=str(REPO), TORCH_EXTENSIONS_DIR=ops)
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        time.sleep(1)
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], timeout=120)


def test_the_nodes_are_three_hosts(cluster):
    """Each node has its own name, address and /etc/hosts; a job's processes run in their node's namespace."""
    out = subprocess.run(["srun", "-N3", "-n3", "-l", "bash", "-c",
                          "echo $(hostname) $(ip -o -4 addr show eth0 | awk '{print $4}') $(getent hosts hpcrl-n1)"],
                         capture_output=True, text=True, env=cluster, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = sorted(l.split(": ", 1)[1].split() for l in out.stdout.strip().splitlines())
    # Debian's /etc/hosts: a node's own name on 127.0.1.1 (hpcrl-n1 on hpcrl-n1), the others' real addresses
    assert lines == [[f"hpcrl-n{i}", f"10.232.0.{10 + i}/24", "127.0.1.1" if i == 1 else "10.232.0.11", "hpcrl-n1"]
                     for i in (1, 2, 3)]


@pytest.mark.slow
def test_a_rank_sigkilled_mid_collective_ends_the_whole_trainer_step(cluster):
    """Two ranks on two nodes find each other the trainer's way (master from the node list, resolved; gloo on the
    route's interface), all-reduce in a loop; rank 1 SIGKILLs itself: srun ends rank 0 within seconds."""
    t0 = time.monotonic()
    proc = subprocess.Popen(["srun", "-N2", "-n2", "--nodelist=hpcrl-n[1-2]", "--kill-on-bad-exit=1", sys.executable,
                             str(REPO / "tests" / "collective_peer.py"), "--die-rank", "1", "--die-after-s", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster)
    lines, joined_s = [], None
    for line in proc.stdout:
        lines.append(line)
        if joined_s is None and sum("all_reduce 2" in l for l in lines) == 2:
            joined_s = time.monotonic()
    proc.wait(timeout=60)
    text = "".join(lines)
    assert joined_s is not None, text[-3000:]
    assert "rank 0 of 2 on hpcrl-n1: master 10.232.0.11, GLOO_SOCKET_IFNAME=eth0" in text, text[-3000:]
    assert "rank 1 of 2 on hpcrl-n2: master 10.232.0.11, GLOO_SOCKET_IFNAME=eth0" in text
    ended_s = time.monotonic() - joined_s
    assert proc.returncode != 0 and "hpcrl-n2: task 1: Killed" in text, text[-3000:]
    assert "loop done" not in text and ended_s < 30, f"the step ended {ended_s:.1f}s after the ranks joined"
    print(f"ranks joined after {joined_s - t0:.1f}s; the step ended {ended_s:.1f}s later (rank 1 died at 3s)")


@pytest.mark.slow
def test_trainer_on_two_nodes_and_rollout_on_a_third(cluster, tmp_path):
    """``resources.trainer.nodes=2`` (one rank per node, gloo, ZeRO-3) on hpcrl-n1/n2, the rollout job on hpcrl-n3,
    weights by broadcast across hosts: the run completes, versions arrive by broadcast, exactly once."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(REPO / "sbatch" / "submit.sh"), str(TINY), str(run),
                          "resources.trainer.nodes=2", "resources.trainer.tasks_per_node=1", "actor.zero_stage=3",
                          "actor.ppo_micro_batch_size=2", "weights.transport=broadcast", "eval.every_versions=0",
                          "rollout.total_rollout_steps=32", "timeouts.rendezvous_s=240",
                          "resources.trainer.sbatch_extra={nodelist: 'hpcrl-n[1-2]'}",
                          "resources.rollout.sbatch_extra={nodelist: hpcrl-n3}"],
                         capture_output=True, text=True, env=cluster, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    rd = RunDir(run)
    try:
        wait_until(lambda: read_json(rd.trainer_done), 900, "trainer_done.json")
    finally:
        print(f"multi-node run: {time.monotonic() - t0:.0f}s")
    rank0, rank1 = (rd.job_logs / "trainer.log").read_text(), (rd.job_logs / "trainer-rank1.log").read_text()
    assert re.search(r"GLOO_SOCKET_IFNAME=eth0: the route from hpcrl-n1 \(10\.232\.0\.11\) to trainer node hpcrl-n2", rank0)
    assert re.search(r"GLOO_SOCKET_IFNAME=eth0: the route from hpcrl-n2 \(10\.232\.0\.12\) to trainer node hpcrl-n1", rank1)
    assert "all 2 trainer ranks arrived at 10.232.0.11:" in rank0
    rollout_log = (rd.job_logs / "rollout-w000.log").read_text()
    assert "hpcrl-n1" in rollout_log and "by broadcast" in rollout_log
    paths = [r["weights/path"] for r in read_jsonl(rd.rollout_metrics("w000"))]
    assert paths.count("broadcast") >= len(paths) - 2, paths
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)


@pytest.mark.slow
def test_a_one_node_trainer_broadcasts_to_a_rollout_job_on_another_node(cluster, tmp_path):
    """The common layout: the trainer on one node (no GLOO_SOCKET_IFNAME set: one node needs none), the rollout
    job on another, each node's own name on 127.0.1.1. The broadcast group's gloo device is the route to the
    peer on both ends, so neither offers the loopback: every version after the join arrives by broadcast."""
    run = tmp_path / "run"
    out = subprocess.run(["bash", str(REPO / "sbatch" / "submit.sh"), str(TINY), str(run),
                          "weights.transport=broadcast", "eval.every_versions=0", "rollout.total_rollout_steps=48",
                          "resources.trainer.sbatch_extra={nodelist: hpcrl-n1}",
                          "resources.rollout.sbatch_extra={nodelist: hpcrl-n3}"],
                         capture_output=True, text=True, env=cluster, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    rd = RunDir(run)
    wait_until(lambda: read_json(rd.trainer_done), 600, "trainer_done.json")
    trainer_log = (rd.job_logs / "trainer.log").read_text()
    assert re.search(r"gloo on eth0, the route to hpcrl-n3", trainer_log), trainer_log[-2000:]
    assert "gloo on eth0, the route to hpcrl-n1" in (rd.job_logs / "rollout-w000.log").read_text()
    paths = [r["weights/path"] for r in read_jsonl(rd.rollout_metrics("w000"))]
    assert paths.count("broadcast") >= len(paths) - 2, paths
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
