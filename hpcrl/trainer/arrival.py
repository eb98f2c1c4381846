"""The trainer's ranks check in before they form their process group, with a deadline that names who is missing.

torch's own rendezvous waits for ``WORLD_SIZE`` connections and, at its timeout, says only that it timed
out. Here rank 0 starts the ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (the same store then carries the
process group, under the prefix ``world``) and every rank writes ``arrived/<rank>`` = its host. Order of
events::

    rank r > 0   connect to the master (retried until the deadline, a log line every interval naming it)
                 set arrived/<r>; wait for "go" (the deadline; rank 0's log names who is missing)
    rank 0       start the store; every interval log the ranks still missing; once all arrived set "go"

At the deadline rank 0 raises :class:`LaunchError` naming the ranks that did
not arrive and the hosts of those that did; the others raise naming the master they waited for. Either
way the job ends (``srun --kill-on-bad-exit=1`` ends the rest), within the deadline, instead of sitting
in a collective until the time limit.
"""
from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from hpcrl.control.job import CannotStart

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a waiting rank looks again."""
GO_KEY = "go"


class LaunchError(CannotStart):
    """The trainer's ranks cannot form their world; the message is one line naming the cause and the fix."""


def _arrived_key(rank: int) -> str:
    return f"arrived/{rank}"


def _wait_for_master(addr: str, port: int, deadline: float, log_interval_s: float, rank: int) -> None:
    """Until a plain TCP connection to the master succeeds (the store's own client prints a C++ trace per try)."""
    next_log = time.monotonic() + log_interval_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=2.0).close()
            return
        except OSError as e:
            now = time.monotonic()
            if now >= deadline:
                raise LaunchError(f"trainer rank {rank} on {socket.gethostname()}: the master (rank 0) at "
                                  f"{addr}:{port} did not answer before the deadline ({e}); see rank 0's log") from None
            if now >= next_log:
                log.info("waiting for the trainer's master (rank 0) at %s:%d: %s", addr, port, e)
                next_log = now + log_interval_s
            time.sleep(POLL_S)


def _gather_arrivals(store: dist.TCPStore, world: int, deadline: float, log_interval_s: float, where: str,
                     arrival_s: float) -> None:
    """Rank 0: until every rank wrote its key; LaunchError naming the missing ranks at the deadline."""
    next_log = time.monotonic() + log_interval_s
    while True:
        missing = [r for r in range(1, world) if not store.check([_arrived_key(r)])]
        if not missing:
            return
        now = time.monotonic()
        if now >= deadline:
            came = ", ".join(f"{r} on {store.get(_arrived_key(r)).decode()}" for r in range(1, world) if r not in missing)
            raise LaunchError(f"trainer ranks {', '.join(map(str, missing))} (of {world}) did not arrive at the master "
                              f"{where} in {arrival_s:.0f}s (timeouts.rendezvous_s); arrived: 0 on "
                              f"{socket.gethostname()}{', ' + came if came else ''}")
        if now >= next_log:
            log.info("waiting for trainer ranks %s at %s (%d of %d arrived)", ", ".join(map(str, missing)), where,
                     world - len(missing), world)
            next_log = now + log_interval_s
        time.sleep(POLL_S)


def check_in(rank: int, world: int, addr: str, port: int, arrival_s: float, log_interval_s: float) -> dist.TCPStore:
    """Every rank: meet the others at ``addr:port`` within ``arrival_s`` (module docstring); the store."""
    deadline = time.monotonic() + arrival_s
    where = f"{addr}:{port}"
    timeout = timedelta(seconds=max(arrival_s, 1.0))
    if rank == 0:
        store = dist.TCPStore(addr, port, world, True, timeout=timeout, wait_for_workers=False)
        _gather_arrivals(store, world, deadline, log_interval_s, where, arrival_s)
        store.set(GO_KEY, "1")
        log.info("all %d trainer ranks arrived at %s", world, where)
        return store
    _wait_for_master(addr, port, deadline, log_interval_s, rank)
    store = dist.TCPStore(addr, port, world, False, timeout=timeout)
    store.set(_arrived_key(rank), socket.gethostname())
    try:
        store.wait([GO_KEY], timedelta(seconds=max(deadline - time.monotonic(), 0.5)))
    except Exception as e:  # noqa: BLE001 - a timeout or rank 0 gone: one line
        raise LaunchError(f"trainer rank {rank} on {socket.gethostname()}: rank 0 at {where} did not confirm the "
                          f"world in {arrival_s:.0f}s (another rank did not arrive? see rank 0's log): "
                          f"{type(e).__name__}") from None
    return store
