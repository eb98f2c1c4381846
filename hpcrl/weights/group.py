"""The broadcast group of one membership, its backend, and the deadline around every step.

The group is built directly on a ``PrefixStore`` of the trainer's store (the prefix names the
rendezvous epoch and the membership generation), never through ``init_process_group``: each job's
own ``torch.distributed`` world (DeepSpeed's on the trainer) is untouched, and two independent
jobs can form it (seen working across two Slurm jobs on CPU with gloo).

Backend (``weights.broadcast_backend``): ``gloo`` through host memory; ``nccl`` GPU to GPU;
``auto`` picks nccl when the trainer's tensors are on a GPU and every member receives into a GPU
(a transformers engine on cuda), gloo otherwise (vLLM's workers map host shared memory; CPU runs).
NCCL is torch's ``ProcessGroupNCCL`` over the same store and timeout; it needs one GPU per rank, so
it cannot be exercised on one GPU or on CPU (the choice and its refusals are tested).

Every step has a deadline: a group construction or a transfer runs on a worker thread waited on with
:func:`call_with_deadline`, and the backend's own collective timeout is set to the same value.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import torch.distributed as dist

from hpcrl.config.names import BROADCAST_BACKENDS
from hpcrl.process.network import NetworkError, interface_to, resolve
from hpcrl.process.threads import spawn


class BroadcastFailed(RuntimeError):
    """A broadcast step failed or ran past its deadline; the version is taken from files."""


class BroadcastRefused(BroadcastFailed):
    """The peer was refused: it does not know the run's secret, or cannot receive with the run's backend."""


def first_line(e: BaseException) -> str:
    """The first line of an error's message (the type's name if it has none), for one-line logs."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def call_with_deadline(fn: Callable[[], Any], timeout_s: float, step: str) -> Any:
    """Run ``fn`` on a worker thread and wait at most ``timeout_s``: its result, its exception,
    or BroadcastFailed naming ``step`` (the thread is abandoned; the backend's own timeout ends it)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = e

    t = spawn(target, f"broadcast:{step[:40]}", bound_s=2 * timeout_s).thread  # abandoned: the backend's timeout ends it
    t.join(timeout_s)
    if t.is_alive():
        raise BroadcastFailed(f"{step}: no answer in {timeout_s:.1f}s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def choose_backend(configured: str, sender_device: str, member_devices: Iterable[str]) -> str:
    """The backend of a group: ``configured`` unless it is ``auto``, which is nccl when the sender's
    tensors and every member's receive buffer are on a GPU, else gloo."""
    return backend_choice(configured, sender_device, {str(i): d for i, d in enumerate(member_devices)})[0]


def backend_choice(configured: str, sender_device: str, members: dict[str, str]) -> tuple[str, str]:
    """(backend, why) for a group whose sender's tensors lie on ``sender_device`` and whose members
    (``{peer: device it receives into}``) are ``members``; ``why`` is one clause for the log of each version."""
    if configured not in BROADCAST_BACKENDS:
        raise ValueError(f"weights.broadcast_backend={configured!r}; allowed: {', '.join(BROADCAST_BACKENDS)}")
    if configured != "auto":
        return configured, f"weights.broadcast_backend={configured}"
    if sender_device != "cuda":
        return "gloo", f"auto: the trainer's tensors are in {sender_device} memory"
    if not members:
        return "gloo", "auto: no member yet"
    on_host = [peer for peer, d in members.items() if d != "cuda"]
    if on_host:
        return "gloo", f"auto: {', '.join(on_host)} receive(s) into host memory, not CUDA"
    return "nccl", f"auto: the trainer's tensors and every member ({', '.join(members)}) are on CUDA"


def group_device(backend: str) -> str:
    """Where a group's messages must lie: on the GPU for nccl, in host memory for gloo."""
    return "cuda" if backend == "nccl" else "cpu"


def gloo_interface(peer_hosts: Iterable[str]) -> tuple[Optional[str], str]:
    """(interface, why) for this end's gloo device in a group with ``peer_hosts``: the one the kernel routes to
    them through, so a host name that resolves to the loopback here (Debian's ``127.0.1.1`` line) is never
    advertised to a peer on another node. None (gloo's own choice: ``GLOO_SOCKET_IFNAME``, else the host name)
    when the variable is set, a peer does not resolve, or the peers lie behind different interfaces."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None, f"GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} (set by you)"
    names = {}
    for host in dict.fromkeys(peer_hosts):
        try:
            names[host] = interface_to(resolve(host))[0]
        except NetworkError as e:
            return None, f"gloo's default ({e})"
    if len(set(names.values())) != 1:
        return None, f"gloo's default (the peers are behind {', '.join(f'{h}: {n}' for h, n in names.items())})"
    name = next(iter(names.values()))
    return name, f"{name}, the route to {', '.join(names)}"


def make_group(store: dist.Store, prefix: str, rank: int, world: int, timeout_s: float, backend: str,
               interface: Optional[str] = None):
    """The broadcast group of one membership (``prefix`` = epoch and generation), built directly on a
    ``PrefixStore``; gloo's device on ``interface`` if given. Blocks until all ``world`` members connected or
    ``timeout_s``; call it through :func:`call_with_deadline`."""
    pstore = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo" and interface:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
        return dist.ProcessGroupGloo(pstore, rank, world, opts)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pstore, rank, world, timeout)
    if backend == "nccl":  # needs a GPU per rank: not exercised here (module docstring)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pstore, rank, world, opts)
    raise ValueError(f"broadcast backend {backend!r}: allowed 'gloo' (host memory) or 'nccl' (GPUs)")
