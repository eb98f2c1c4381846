"""What a node offers a run, one check per function: each returns a :class:`Check` (never raises).

A check is *required* when a run cannot work without it (the caller says which: ``hpcrl doctor
--require cuda,vllm``; gloo, ``/dev/shm`` and the shared directory are always required). Every check is
bounded in time: vLLM is imported in a child process with a deadline (an import that hangs on a broken
driver is a failed check, not a hung doctor), the gloo pair has the collective's timeout.
"""
from __future__ import annotations

import functools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from hpcrl.process.threads import spawn

OK, WARN, FAIL, SKIP = "ok", "WARN", "FAIL", "skip"


@dataclass
class Check:
    """The outcome of one check: a row of the table, and figures for the JSON."""

    name: str
    status: str
    """``ok``, ``WARN`` (works, but a multi-node run would trip on it), ``FAIL`` or ``skip``."""
    detail: str
    """One line: what was found, and for a failure what to do."""
    figures: dict = field(default_factory=dict)
    """Measured values (units in the keys) for ``--json``."""
    required: bool = False


def check_cuda() -> Check:
    """CUDA in torch, and the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` as Slurm set it)."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
    if not torch.cuda.is_available():
        return Check("cuda", FAIL, f"torch {torch.__version__}: no CUDA device (CUDA_VISIBLE_DEVICES={visible})",
                     {"gpus": 0, "torch": torch.__version__})
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("cuda", OK, f"torch {torch.__version__}, CUDA {torch.version.cuda}: {len(names)} GPU(s) visible "
                 f"({', '.join(names)}; CUDA_VISIBLE_DEVICES={visible})", {"gpus": len(names), "gpu_names": names,
                                                                            "torch": torch.__version__})


def check_package(package: str, timeout_s: float = 180.0) -> Check:
    """An engine's package (an ``EngineSpec.package``: vLLM) imports, in a child process, bounded; and its
    version."""
    code = f"import {package}, sys; sys.stdout.write(getattr({package}, '__version__', '?'))"
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Check(package, FAIL, f"import {package} did not finish in {timeout_s:.0f}s")
    import_s = time.monotonic() - t0
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(package, FAIL, f"import {package} failed: {last[:160]}")
    version = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"
    return Check(package, OK, f"{package} {version} imports ({import_s:.1f}s)", {package: version, "import_s": import_s})


def check_shm(min_gib: float, folder: Path = Path("/dev/shm")) -> Check:
    """Free space in ``/dev/shm`` (broadcast receive buffers live there: one weight version each)."""
    try:
        free = shutil.disk_usage(folder).free / 2**30
    except OSError as e:
        return Check("shm", FAIL, f"{folder}: {e}", required=True)
    status = OK if free >= min_gib else FAIL
    hint = "" if status == OK else f" < {min_gib:g} GiB wanted (--shm-min-gib): received versions fall back to private memory"
    return Check("shm", status, f"{folder}: {free:.1f} GiB free{hint}", {"shm_free_gib": round(free, 2)}, True)


def check_filesystem(folder: Path, rounds: int = 5, size_mib: float = 1.0) -> Check:
    """Write + fsync + rename + fsync of the folder in ``folder`` (what every committed file of a run costs),
    ``rounds`` times; the median and the worst in ms."""
    if not folder.is_dir():
        return Check("filesystem", FAIL, f"{folder} is not a directory (--dir: the run directory's parent)", {}, True)
    payload, times = os.urandom(int(size_mib * 2**20)), []
    try:
        for i in range(rounds):
            tmp, final = folder / f".hpcrl-doctor-{os.getpid()}-{i}.tmp", folder / f".hpcrl-doctor-{os.getpid()}-{i}"
            t0 = time.perf_counter()
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            times.append((time.perf_counter() - t0) * 1000)
            final.unlink()
    except OSError as e:
        return Check("filesystem", FAIL, f"{folder}: write+fsync+rename failed: {e}", {}, True)
    med = statistics.median(times)
    return Check("filesystem", OK, f"{folder}: {size_mib:g} MiB write+fsync+rename+dir fsync median {med:.1f} ms, "
                 f"worst {max(times):.1f} ms ({rounds} rounds)", {"fs_commit_median_ms": round(med, 2),
                                                                  "fs_commit_max_ms": round(max(times), 2)}, True)


def check_hostname() -> Check:
    """Whether this node's own name resolves to an address other nodes can reach (a trainer master here
    would otherwise be told apart only by ``/etc/hosts`` on the others)."""
    from hpcrl.process.network import NetworkError, is_loopback, resolve

    host = socket.gethostname()
    try:
        addr = resolve(host)
    except NetworkError as e:
        return Check("hostname", WARN, str(e))
    if is_loopback(addr):
        return Check("hostname", WARN, f"{host} resolves to {addr} (loopback) here; fine on one node, and other nodes "
                     "must resolve it to a reachable address (the trainer checks at start)", {"address": addr})
    return Check("hostname", OK, f"{host} resolves to {addr}", {"address": addr})


def _gloo_rank(store_host: str, port: int, rank: int, timeout_s: float, box: dict) -> None:
    import torch
    import torch.distributed as dist

    try:
        store = dist.TCPStore(store_host, port, 2, rank == 0, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore("doctor", store), rank, 2, timedelta(seconds=timeout_s))
        t = torch.ones(2**18)  # 1 MiB
        t0 = time.perf_counter()
        for _ in range(5):
            group.allreduce([t]).wait()
        box[rank] = ((time.perf_counter() - t0) / 5 * 1000, float(t[0]))
    except Exception as e:  # noqa: BLE001 - reported as the check's line
        box[f"error{rank}"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def check_gloo(peer: str | None, rank: int, port: int, timeout_s: float) -> Check:
    """A gloo pair and five 1 MiB all-reduces: with ``peer`` None, two threads over the loopback; else this
    process is ``rank`` of two and ``peer`` is the other node (rank 0 listens on ``port`` on every interface).
    Across nodes, gloo's interface is the route to the peer (``GLOO_SOCKET_IFNAME``, unless set), as the
    trainer chooses it."""
    from hpcrl.process.network import NetworkError, interface_to

    box: dict = {}
    where = f"loopback port {port}" if peer is None else f"rank {rank} of 2, peer {peer}, port {port}"
    iface = ""
    if peer is not None:
        try:
            name, local = interface_to(peer)
        except NetworkError as e:
            return Check("gloo", FAIL, str(e), {}, True)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        iface = f" via {os.environ['GLOO_SOCKET_IFNAME']} ({local})"
    ranks = [0, 1] if peer is None else [rank]
    store_host = "127.0.0.1" if peer is None or rank == 0 else peer
    # tracked threads (process/threads.py): one still inside torch when the doctor exits is waited for, not left
    # to abort the process ("terminate called without an active exception": seen under load, TCPStore's connect
    # outlasting the join below)
    threads = [spawn(functools.partial(_gloo_rank, store_host, port, r, timeout_s, box), f"doctor-gloo-rank{r}",
                     bound_s=3 * timeout_s + 10).thread for r in ranks]
    for t in threads:
        t.join(timeout_s + 5)
    errors = [v for k, v in box.items() if str(k).startswith("error")]
    if errors or any(r not in box for r in ranks):
        return Check("gloo", FAIL, f"{where}{iface}: {errors[0] if errors else f'no answer in {timeout_s:.0f}s'}", {},
                     True)
    ms, value = box[ranks[0]]
    if value != 2 ** 5:
        return Check("gloo", FAIL, f"{where}: all-reduce gave {value}, expected {2 ** 5}", {}, True)
    return Check("gloo", OK, f"{where}{iface}: 1 MiB all-reduce {ms:.2f} ms", {"gloo_allreduce_1mib_ms": round(ms, 3)},
                 True)
