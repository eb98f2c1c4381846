"""The trainer job's own torch.distributed world, from whatever launched it.

Sources, in order: variables a launcher already set (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, e.g. torchrun); Slurm task variables (``srun``
in sbatch/trainer.sbatch, or submitit's Slurm executor); submitit's local
executor; otherwise a single rank. Every rank derives the same master address
(first host of the allocation) and port (from the job id), so no file or
extra rendezvous is needed. This world is the job's own; it is never joined
by a rollout job.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import zlib

import torch

log = logging.getLogger(__name__)


def _port_for(job_id: str) -> int:
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def _first_host(nodelist: str) -> str:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return nodelist.split(",")[0]


def rank_environment() -> dict[str, str]:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return {}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = env.get("SLURM_JOB_ID", "0")
        return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
                "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
                "MASTER_ADDR": _first_host(env.get("SLURM_JOB_NODELIST", socket.gethostname())),
                "MASTER_PORT": str(_port_for(job))}
    if "SUBMITIT_LOCAL_GLOBALID" in env:
        return {"RANK": env["SUBMITIT_LOCAL_GLOBALID"], "WORLD_SIZE": env.get("SUBMITIT_LOCAL_NTASKS", "1"),
                "LOCAL_RANK": env.get("SUBMITIT_LOCAL_LOCALID", "0"), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_port_for(env.get("SUBMITIT_LOCAL_JOB_ID", "0")))}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def init_distributed(timeout_s: float) -> None:
    """Initialise DeepSpeed's process group (gloo on CPU, NCCL on GPU).

    ``timeout_s`` bounds every collective: ranks other than 0 wait in a broadcast
    while rank 0 waits for samples, so it must exceed the sample wait.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.environ.update(rank_environment())
    import deepspeed

    log.info("rank %s of %s, master %s:%s", os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"],
             os.environ["MASTER_PORT"])
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=datetime.timedelta(seconds=timeout_s))
