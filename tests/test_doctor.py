"""``hpcrl doctor`` as a user runs it: the table, the exit status, the JSON; a gloo pair across a network
namespace (a second "node" on a veth pair); a peer that is not there fails within the deadline."""
import json
import subprocess
import sys
import time

import torch

from conftest import REPO
from hpcrl.process.network import free_port


def doctor(*args, timeout_s=120, prefix=()):
    return subprocess.run([*prefix, sys.executable, "-m", "hpcrl", "doctor", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout_s)


def rows(out: str) -> dict[str, tuple[str, str, str]]:
    """{check: (status, required, detail)} from the table."""
    got = {}
    for line in out.splitlines()[1:]:
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2] in ("yes", "no"):
            got[parts[0]] = (parts[1], parts[2], parts[3])
    return got


def test_doctor_on_this_node_passes_and_writes_its_figures(tmp_path):
    out = doctor("--dir", str(tmp_path), "--skip", "vllm", "--json", str(tmp_path / "d.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    table = rows(out.stdout)
    assert [table[c][:2] for c in ("gloo", "shm", "filesystem")] == [("ok", "yes")] * 3, out.stdout
    assert table["vllm"][0] == "skip" and table["cuda"][1] == "no"
    assert "all required checks passed" in out.stdout
    figures = {c["name"]: c["figures"] for c in json.loads((tmp_path / "d.json").read_text())["checks"]}
    assert figures["filesystem"]["fs_commit_median_ms"] > 0 and figures["gloo"]["gloo_allreduce_1mib_ms"] > 0
    assert list(tmp_path.iterdir()) == [tmp_path / "d.json"], "the timing files are gone"


def test_a_failed_required_check_exits_1_and_names_it(tmp_path):
    out = doctor("--dir", str(tmp_path / "missing"), "--skip", "vllm,gloo", "--shm-min-gib", "1000000",
                 "--require", "cuda")
    assert out.returncode == 1, out.stdout + out.stderr
    table = rows(out.stdout)
    assert table["filesystem"][0] == "FAIL" and "is not a directory" in table["filesystem"][2]
    assert table["shm"][0] == "FAIL" and "wanted (--shm-min-gib)" in table["shm"][2]
    failed = {"filesystem", "shm"} | (set() if torch.cuda.is_available() else {"cuda"})
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("required checks failed: ") and set(last.split(": ")[1].split(", ")) == failed


def test_bad_arguments_are_one_line_each():
    out = doctor("--require", "gpu", "--gloo-rank", "1")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["hpcrl doctor: error: --require 'gpu': allowed cuda, vllm",
                                       "hpcrl doctor: error: --gloo-rank 1 needs --gloo-peer HOST (the other node, rank 0)"]


def test_gloo_pair_across_a_network_namespace(veth, tmp_path):
    """Rank 0 here, rank 1 in namespace hpcrl-t (another host on the veth pair): both pass, and rank 1 names
    the interface its route to rank 0 takes."""
    port = free_port()
    args = ("--dir", str(tmp_path), "--skip", "vllm,cuda", "--gloo-port", str(port))
    rank0 = subprocess.Popen([sys.executable, "-m", "hpcrl", "doctor", *args, "--gloo-rank", "0",
                              "--gloo-peer", "10.231.7.2"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    rank1 = doctor(*args, "--gloo-rank", "1", "--gloo-peer", "10.231.7.1", prefix=("ip", "netns", "exec", "hpcrl-t"))
    out0, _ = rank0.communicate(timeout=120)
    assert rank1.returncode == 0 and rank0.returncode == 0, rank1.stdout + rank1.stderr + out0
    assert f"rank 1 of 2, peer 10.231.7.1, port {port} via hpcrlt1 (10.231.7.2)" in rows(rank1.stdout)["gloo"][2]
    assert f"rank 0 of 2, peer 10.231.7.2, port {port} via hpcrlt0 (10.231.7.1)" in rows(out0)["gloo"][2]


def test_a_gloo_peer_that_is_not_there_fails_within_the_deadline(tmp_path):
    t0 = time.monotonic()
    out = doctor("--dir", str(tmp_path), "--skip", "vllm,cuda", "--gloo-rank", "1", "--gloo-peer", "127.0.0.1",
                 "--gloo-port", str(free_port()), "--timeout-s", "3")
    took = time.monotonic() - t0
    assert out.returncode == 1 and rows(out.stdout)["gloo"][0] == "FAIL", out.stdout + out.stderr
    assert "required checks failed: gloo" in out.stdout and took < 40, took
