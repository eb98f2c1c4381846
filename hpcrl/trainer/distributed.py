"""The trainer job's own torch.distributed world, from whatever launched it, and loud about it.

Sources, in order: variables a launcher already set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, e.g. torchrun); Slurm task variables (``srun`` in sbatch/trainer.sbatch, or
submitit's Slurm executor); submitit's local executor; otherwise a single rank. Every rank derives the
same master (the first host of ``scontrol show hostnames $SLURM_JOB_NODELIST``) and port (from the job
id), so no file is needed.

What used to fail quietly on several nodes, and is now one line naming the cause (:class:`LaunchError`):

- ``scontrol`` missing or failing: the node list cannot be expanded (never a guess, never localhost);
- the master's name does not resolve, or resolves to a loopback address on a node other than the
  master's (a ``127.0.1.1`` line in that node's ``/etc/hosts``): each node would form a world of its own;
- the route to the other nodes leaves through ``lo``.

On a world spanning several nodes the interface gloo and NCCL use is the one that routes to the master
(on the master's node: to the next node), set as ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` and
logged; a value already in the environment is kept (the user's override) and logged as such.
Then the ranks check in with a deadline (``trainer/arrival.py``). This world is the job's own; it is
never joined by a rollout job.
"""
from __future__ import annotations

import datetime
import logging
import os
import shutil
import socket
import subprocess
import zlib

import torch

from hpcrl.process.network import NetworkError, free_port, interface_to, is_loopback, resolve
from hpcrl.trainer.arrival import LaunchError, check_in

log = logging.getLogger(__name__)

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables that pin gloo's and NCCL's interface."""


def _port_for(job_id: str) -> int:
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def slurm_hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list (``node[01-03]`` -> three names), by ``scontrol show hostnames``;
    LaunchError naming what was missing if it cannot be expanded."""
    if shutil.which("scontrol") is None:
        raise LaunchError(f"cannot find the trainer's master: scontrol is not on PATH, so SLURM_JOB_NODELIST="
                          f"{nodelist!r} cannot be expanded (add Slurm's module to resources.trainer.setup)")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot find the trainer's master: scontrol show hostnames {nodelist!r}: {e}") from None
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        why = out.stderr.strip().splitlines()[0] if out.stderr.strip() else "no host names"
        raise LaunchError(f"cannot find the trainer's master: scontrol show hostnames {nodelist!r} failed ({why})")
    return hosts


def _short(host: str) -> str:
    return host.split(".")[0]


def master_address(hosts: list[str], here: str) -> str:
    """The address of ``hosts[0]`` (the master's node) as this node (``here``) reaches it. LaunchError if it
    does not resolve, or is a loopback address while this node is another one."""
    master = hosts[0]
    try:
        addr = resolve(master)
    except NetworkError as e:
        raise LaunchError(f"the trainer's master node {master} (first of the job's nodes) does not resolve on "
                          f"{here}: {e}; fix the node's DNS or /etc/hosts") from None
    if is_loopback(addr) and _short(here) != _short(master):
        raise LaunchError(f"the trainer's master node {master} resolves to {addr} (loopback) on {here}: this rank "
                          f"would form a world of its own; remove the loopback line for {master} from /etc/hosts "
                          "on this node")
    return addr


def choose_interfaces(hosts: list[str], here: str, master_addr: str) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for a world across ``hosts`` (logged; a value already set is
    kept); {} for one node (the loopback serves). LaunchError if the route to the other nodes is the loopback."""
    nodes = list(dict.fromkeys(_short(h) for h in hosts))
    if len(nodes) < 2:
        return {}
    peer_host = hosts[0] if _short(here) != nodes[0] else next(h for h in hosts if _short(h) != nodes[0])
    try:
        peer = master_addr if peer_host == hosts[0] else resolve(peer_host)
        name, local = interface_to(peer)
    except NetworkError as e:
        raise LaunchError(f"no interface of {here} reaches trainer node {peer_host}: {e}") from None
    if name == "lo":
        raise LaunchError(f"the route from {here} to trainer node {peer_host} ({peer}) is the loopback: "
                          f"{peer_host} resolves to this node; fix /etc/hosts or set GLOO_SOCKET_IFNAME")
    out = {}
    for var in IFNAME_VARS:
        if os.environ.get(var):
            log.info("%s=%s (set by you; the route to %s would use %s)", var, os.environ[var], peer_host, name)
        else:
            out[var] = name
            log.info("%s=%s: the route from %s (%s) to trainer node %s (%s)", var, name, here, local, peer_host, peer)
    return out


def _own_reachable_address(hosts: list[str], here: str, addr: str) -> str:
    """On the master's node of a world across nodes whose name resolves to the loopback here (Debian's
    ``127.0.1.1``): the local address of the route to the next node, the one the others reach; else ``addr``."""
    others = [h for h in hosts if _short(h) != _short(hosts[0])]
    if not is_loopback(addr) or not others:
        return addr
    try:
        local = interface_to(resolve(others[0]))[1]
    except NetworkError as e:
        raise LaunchError(f"no interface of {here} reaches trainer node {others[0]}: {e}") from None
    log.info("the master's name %s resolves to %s (loopback) on its own node; using %s, the address of the route "
             "to %s", hosts[0], addr, local, others[0])
    return local


def _slurm_environment(env) -> dict[str, str]:
    here = socket.gethostname()
    hosts = slurm_hostnames(env.get("SLURM_JOB_NODELIST") or here)
    addr = _own_reachable_address(hosts, here, master_address(hosts, here))
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
           "MASTER_ADDR": addr, "MASTER_PORT": str(_port_for(env.get("SLURM_JOB_ID", "0")))}
    out.update(choose_interfaces(hosts, here, addr))
    log.info("trainer master %s (%s) port %s, from SLURM_JOB_NODELIST=%s", hosts[0], addr, out["MASTER_PORT"],
             env.get("SLURM_JOB_NODELIST"))
    return out


def rank_environment() -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and the interface variables across nodes) for
    this process; {} if a launcher set them. LaunchError (one line) where the world cannot be found."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return {}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm_environment(env)
    if "SUBMITIT_LOCAL_GLOBALID" in env:
        return {"RANK": env["SUBMITIT_LOCAL_GLOBALID"], "WORLD_SIZE": env.get("SUBMITIT_LOCAL_NTASKS", "1"),
                "LOCAL_RANK": env.get("SUBMITIT_LOCAL_LOCALID", "0"), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_port_for(env.get("SUBMITIT_LOCAL_JOB_ID", "0")))}
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def rank_from_environment() -> int:
    """This process's rank as its launcher gives it (for the log's name, before the world is found)."""
    env = os.environ
    return int(env.get("RANK") or env.get("SLURM_PROCID") or env.get("SUBMITIT_LOCAL_GLOBALID") or 0)


def init_distributed(timeout_s: float, arrival_s: float, log_interval_s: float) -> None:
    """Check in every rank (``arrival_s``, naming the missing ranks) and initialise the process group that
    DeepSpeed then uses (gloo on CPU; on GPUs NCCL for CUDA tensors and gloo for host tensors). ``timeout_s`` bounds every collective: ranks other than 0
    wait in a broadcast while rank 0 waits for samples, so it must exceed the sample wait."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.environ.update(rank_environment())
    import deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    log.info("rank %d of %d, master %s:%d", rank, world, addr, port)
    store = check_in(rank, world, addr, port, arrival_s, log_interval_s)
    backend = "gloo"
    if torch.cuda.is_available():
        # each rank its own GPU before NCCL makes a communicator (all would take cuda:0); NCCL carries the model's
        # tensors, gloo the host tensors rank 0 shares with the others (share.py: the groups, JSON)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    torch.distributed.init_process_group(backend, store=torch.distributed.PrefixStore("world", store), rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=datetime.timedelta(seconds=timeout_s))
