"""A rollout or evaluation job's way to the reward jobs: find them, spread requests by load, retry, wait boundedly.

Finding: the services are the records in ``control/reward/`` (``wire.RewardService``), listed again when the folder
changed and at least every :data:`LIST_EVERY_S`, so reward jobs that join (``hpcrl scale``, a restart with a new
port and epoch) are used within seconds and those that end are dropped.

Spreading: each request goes to the service with the fewest items outstanding from this client plus the queue it
reported in its last reply (ties at random); connections are kept open and reused, one request at a time each.

Retrying: a request whose connection fails, whose reply is damaged (not a reply, another id, the wrong number of
scores) or that takes longer than ``reward_model.request_timeout_s`` is named in the log and sent again to the best
service (the failed one is left alone for :data:`DOWN_S`); the first complete reply is the only one used, so a
response is never scored twice into a group, and a service's own error (its model failed) is retried
:data:`MAX_SERVER_ERRORS` times, then the items have no score (reward 0, counted).

Waiting: with no service that answers, the request waits (a line naming the reward jobs, their heartbeats and the
deadline every ``timeouts.wait_log_interval_s``) up to ``reward_model.wait_s``, then :class:`RewardWaitTimeout`. A reward job that
cannot load its model records ``control/fatal.json``; the waiting job's own loop then stops (``control/job.py``)
and ``stop()`` ends the wait at once (:class:`RewardWaitStopped`).
"""
from __future__ import annotations

import itertools
import logging
import random
import socket
import threading
import time
from typing import Any, Callable, Optional

from hpcrl.control.fatal import read_fatal
from hpcrl.control.records import read_heartbeats
from hpcrl.rundir.fsio import read_json
from hpcrl.reward.wire import (GENERATE, SCORE, Reply, Request, RewardService, RewardWaitStopped, RewardWaitTimeout,
                               ScoreItem, Scored, WireError, client_handshake, read_run_secret, recv_frame, send_frame)
from hpcrl.rundir.paths import RunDir

log = logging.getLogger("hpcrl.reward")

LIST_EVERY_S = 5.0
"""The services are listed again at least this often (and whenever the folder changed)."""
DOWN_S = 2.0
"""A service whose request failed is not tried again for this long (unless its record changes: a restart)."""
CONNECT_S = 10.0
MAX_SERVER_ERRORS = 3
POLL_S = 0.2


class RewardClient:
    """The client side of the reward service (module docstring); thread-safe: every group thread uses it."""

    def __init__(self, run_dir: RunDir, name: str, request_timeout_s: float, wait_s: float, wait_log_s: float):
        self.run_dir, self.name = run_dir, name
        self.request_timeout_s, self.wait_s, self.wait_log_s = request_timeout_s, wait_s, wait_log_s
        self.secret = read_run_secret(run_dir)
        self._lock = threading.Lock()
        self._services: dict[str, RewardService] = {}
        self._listed = (0.0, -1)  # (monotonic time, folder mtime_ns) of the last listing
        self._down: dict[tuple[str, str], float] = {}  # (job, epoch) -> monotonic time it may be tried again
        self._outstanding: dict[str, int] = {}
        self._reported: dict[str, int] = {}
        self._idle: dict[tuple[str, str], list[socket.socket]] = {}
        self._ids = itertools.count()
        self._waiting_since: Optional[float] = None
        self._said_s = 0.0
        self.retries = 0
        """Requests sent again (a failed connection, a damaged or late reply, a service's error)."""
        self.sent_to: dict[str, int] = {}
        """Requests answered, by reward job."""

    # ---- the services
    def _refresh(self) -> None:
        folder = self.run_dir.reward_service()
        try:
            stamp = folder.stat().st_mtime_ns
        except FileNotFoundError:
            stamp = 0
        now = time.monotonic()
        if stamp == self._listed[1] and now - self._listed[0] < LIST_EVERY_S:
            return
        found = {}
        for path in sorted(folder.glob("*.json")) if stamp else []:
            try:
                d = read_json(path)
                rec = RewardService.from_json(d, str(path)) if d is not None else None
            except (ValueError, OSError) as e:
                log.warning("ignoring %s: %s", path, e)
                continue
            if rec is not None:
                found[rec.job] = rec
        self._services, self._listed = found, (now, stamp)

    def _pick(self) -> Optional[RewardService]:
        """The least loaded service not left alone, None if there is none."""
        with self._lock:
            self._refresh()
            now = time.monotonic()
            up = [s for s in self._services.values() if self._down.get((s.job, s.epoch), 0.0) <= now]
            if not up:
                return None
            load = {s.job: self._outstanding.get(s.job, 0) + self._reported.get(s.job, 0) for s in up}
            best = min(load.values())
            return random.choice([s for s in up if load[s.job] == best])

    def describe(self) -> str:
        """The reward jobs as the records and heartbeats say (for wait lines and errors)."""
        beats = read_heartbeats(self.run_dir)
        jobs = sorted(set(self._services) | {j for j in beats if RunDir.reward_index(j) is not None})
        if not jobs:
            return f"no reward job has written {self.run_dir.reward_service()} or a heartbeat yet"
        now = time.time()
        parts = []
        for job in jobs:
            s, b = self._services.get(job), beats.get(job)
            where = f"at {s.address}" if s is not None else "no service record"
            beat = f"heartbeat {b.state} {b.age_s(now):.0f}s ago" if b is not None else "no heartbeat"
            parts.append(f"{job} ({where}, {beat})")
        return "; ".join(parts)

    # ---- one request
    def _connect(self, svc: RewardService) -> socket.socket:
        with self._lock:
            idle = self._idle.get((svc.job, svc.epoch))
            if idle:
                return idle.pop()
        sock = socket.create_connection((svc.host, svc.port), timeout=CONNECT_S)
        try:
            client_handshake(sock, self.secret, self.name, svc)
        except BaseException:
            sock.close()
            raise
        return sock

    def _exchange(self, svc: RewardService, req: Request, n: int) -> Reply:
        """Send ``req`` to ``svc`` and read its reply; OSError / WireError / TimeoutError on any failure."""
        sock = self._connect(svc)
        ok = False
        try:
            sock.settimeout(self.request_timeout_s)
            send_frame(sock, req.to_json())
            try:
                d = recv_frame(sock)
            except socket.timeout:
                raise TimeoutError(f"no reply in {self.request_timeout_s:.0f}s (reward_model.request_timeout_s)") \
                    from None
            try:
                reply = Reply.from_json(d, f"the reply of {svc.job}")
            except ValueError as e:
                raise WireError(f"a damaged reply: {e}") from None
            if reply.id != req.id:
                raise WireError(f"a reply to request {reply.id}, not {req.id}")
            if not reply.error and len(reply.scores if req.op == SCORE else reply.texts) != n:
                raise WireError(f"a damaged reply: {len(reply.scores)} scores and {len(reply.texts)} texts for {n} "
                                "items")
            ok = True
            return reply
        finally:
            if ok:
                with self._lock:
                    self._idle.setdefault((svc.job, svc.epoch), []).append(sock)
            else:
                sock.close()

    def request(self, op: str, what: str, stop: Callable[[], bool], items: list[ScoreItem] = (),
                prompts: list[Any] = (), max_new_tokens: Optional[int] = None, greedy: bool = True) -> Reply:
        """One request answered by some reward job (module docstring): retried on failure, waiting boundedly."""
        n = len(items) + len(prompts)
        req = Request(id=next(self._ids), op=op, items=list(items), prompts=list(prompts),
                      max_new_tokens=max_new_tokens, temperature=0.0 if greedy else None)
        server_errors = 0
        while True:
            if stop():
                raise RewardWaitStopped(f"stopped while {what} waited for a reward job")
            svc = self._pick()
            if svc is None:
                self._wait(what)
                continue
            with self._lock:
                self._outstanding[svc.job] = self._outstanding.get(svc.job, 0) + n
            try:
                reply = self._exchange(svc, req, n)
            except (OSError, WireError, TimeoutError) as e:
                log.warning("%s: reward job %s at %s failed (%s: %s); sending it again", what, svc.job, svc.address,
                            type(e).__name__, e)
                with self._lock:
                    self._down[(svc.job, svc.epoch)] = time.monotonic() + DOWN_S
                    self.retries += 1
                continue
            finally:
                with self._lock:
                    self._outstanding[svc.job] -= n
            with self._lock:
                self._reported[svc.job] = reply.queued
                self._waiting_since = None
            if reply.error:
                server_errors += 1
                log.warning("%s: reward job %s answered with an error (%d/%d): %s", what, svc.job, server_errors,
                            MAX_SERVER_ERRORS, reply.error)
                if server_errors < MAX_SERVER_ERRORS:
                    with self._lock:
                        self.retries += 1
                    continue
            with self._lock:
                self.sent_to[svc.job] = self.sent_to.get(svc.job, 0) + 1
            return reply

    def _wait(self, what: str) -> None:
        """No service answers: wait one poll; TimeoutError past ``reward_model.wait_s`` (module docstring)."""
        now = time.monotonic()
        with self._lock:
            if self._waiting_since is None:
                self._waiting_since = now
            since = self._waiting_since
        if now - since > self.wait_s:
            raise RewardWaitTimeout(f"{what}: no reward job answered for {now - since:.0f}s (reward_model.wait_s="
                               f"{self.wait_s:.0f}); {self.describe()}")
        if now - self._said_s >= self.wait_log_s:
            self._said_s = now
            fatal = read_fatal(self.run_dir)
            log.warning("waiting for a reward job to answer (%s; %.0fs so far, failing after %.0fs): %s%s", what,
                        now - since, self.wait_s, self.describe(),
                        f"; the run is stopping: {fatal}" if fatal else "")
        time.sleep(POLL_S)

    # ---- what the scorers call
    def score(self, items: list[ScoreItem], what: str, stop: Callable[[], bool]) -> list[Scored]:
        """One :class:`Scored` per item."""
        reply = self.request(SCORE, what, stop, items=items)
        if reply.error:
            return [Scored(None, problem=f"the reward job failed: {reply.error}")] * len(items)
        problems = reply.problems or [""] * len(items)
        texts = reply.texts or [""] * len(items)
        return [Scored(s, t, p) for s, t, p in zip(reply.scores, texts, problems)]

    def generate(self, prompts: list[Any], max_new_tokens: Optional[int], greedy: bool, what: str,
                 stop: Callable[[], bool]) -> list[str]:
        """A generative judge's answers to free prompts; RuntimeError if the reward job failed on them."""
        reply = self.request(GENERATE, what, stop, prompts=prompts, max_new_tokens=max_new_tokens, greedy=greedy)
        if reply.error:
            raise RuntimeError(f"the reward job could not answer: {reply.error}")
        return reply.texts

    def close(self) -> None:
        """Close the kept connections."""
        with self._lock:
            for socks in self._idle.values():
                for s in socks:
                    s.close()
            self._idle.clear()

