"""The admission budget shared by every rollout job of a run.

docs/weights-and-samples.md "Admission budget with skips": per weight version the fleet may *start* at most
``B = floor((1 + s) * K * R)`` groups, counting carry-over (groups in flight or
committed but not yet consumed). Counting from the start of the run this is one
inequality, checked before each group starts::

    started_total - skipped_total - filtered_total  <  consumed_groups(v) + B

where ``v`` is the version the asking job generates with,
``consumed_groups(v)`` is written by the trainer into v's weight manifest
(groups trained on or dropped for staleness), and ``skipped_total`` counts the
groups of shards the trainer skipped as damaged (``control/skipped_shards.jsonl``,
see ``samples/skips.py``): they were started and will never be consumed, so the
budget they held is given back, and their writer generates their prompts again.
``filtered_total`` counts the groups dynamic sampling dropped (``algorithm.filter_groups``: no spread, consumed
and never trained; ``control/filtered_groups.json``, :func:`given_back`): their places are given back as soon as
the trainer drops them, and ``consumed_groups(v)`` leaves them out, so the rule is the one above applied to the
groups that vary, and every update still gets R of them (docs/algorithms.md, "DAPO").

``started_total`` is the sum of per-writer counters in ``control/admission.json``
(:class:`AdmissionRecord`),
read-modified-written under an exclusive ``flock`` on ``control/admission.lock``
(the file itself is replaced atomically, so readers without the lock never see
a torn file). A writer that restarts resets its own counter to the number of
groups it has committed: the groups its dead predecessor had in flight are
released, and their prompts are regenerated.

The same record holds the prompt claims (``control/claims.py``): the index a group generates is claimed in
the step that reserves its start, and a shard's manifest line is appended under the lock
(:meth:`Admission.committing`), so a writer whose claims were released can commit nothing. A writer that
leaves for good (:meth:`Admission.release`) hands back its budget and its open claims; the other writers
reclaim both from one whose job is gone (heartbeat stale and job ended: ``control/reclaim.py``).

**Sharing by load** (``rollout.budget_share: load``, :func:`hpcrl.config.knobs.may_start`). Under the same
lock, with the same counts, a job starts a group only while it has fewer in flight than an even share of what
the budget lets the live fleet have in flight, ``ceil((F + left) / jobs)`` (``F``: the groups the live writers have
in flight, ``started - committed`` each; ``left``: the starts the inequality above still allows; ``jobs``: the
writers in the claim book), and fewer than its bound (``rollout.max_concurrent_groups``, ``auto``: what its engine
decodes at once). The share is derived again at every start, so a job joining, leaving or reclaimed and a version
landing change it at once; a job that does not ask leaves its share to the others as they commit (the level falls
with ``F``, their own in flight falls faster). ``first_come``: the bound alone (hpcrl's rule before). A job that
asks takes every start the rule allows in one acquisition of the lock (:meth:`Admission.start`,
:func:`hpcrl.config.knobs.starts_allowed`): jobs that ask at the same moment are served one after another, each as
far as the rule lets it, which is what ``hpcrl plan`` simulates (one read and one write of the record per turn,
not per group).

**The lag bound at commit** (:meth:`Admission.committing`). The record also counts what each writer committed,
so under the lock a shard's groups know their places in the commit order the trainer consumes in; a group whose
newest token could then be trained more than the lag bound later
(:func:`hpcrl.config.knobs.late_for_bound`, from the version the job holds and its ``consumed_groups``) is refused
(:class:`~hpcrl.samples.writer.CommitRefused`: nothing is committed) and the job carries it into the newest
version or generates it again (``rollout/main.py``).

Shared filesystems: flock works on local disks, NFSv4 and Lustre mounted with
``-o flock``; on a Lustre mount without it ``flock`` fails with ENOSYS and the
job stops with an error saying so.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

from hpcrl.config.knobs import late_for_bound, starts_allowed
from hpcrl.config.names import SHARE_BY_LOAD
from hpcrl.control import claims
from hpcrl.control.changes import bump
from hpcrl.control.claims import ClaimBook
from hpcrl.control.fleet_log import ENDED, JOINED, FleetLog, slurm_job_id
from hpcrl.control.reclaim import GoneWriters, same_beat
from hpcrl.control.records import HeartbeatState, read_filtered_groups
from hpcrl.rundir.fsio import read_json, read_jsonl, write_json_atomic
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.skips import SkipLog
from hpcrl.samples.writer import CommitRefused


log = logging.getLogger(__name__)


class AdmissionLockUnsupported(RuntimeError):
    """The filesystem of the run directory refuses ``flock`` (the message says how to fix it)."""


@dataclass
class AdmissionRecord(JsonRecord):
    """``control/admission.json``: written and read by rollout jobs, under ``control/admission.lock``."""

    started: dict[str, int] = field(default_factory=dict)
    """Per writer: groups started. A writer resets its own entry at start to the groups in its
    committed manifest lines (skipped shards included), then adds one per group it starts."""

    prompts: Optional[ClaimBook] = None
    """Which writer generates which prompt (``control/claims.py``); None in a record of an hpcrl before claims
    (the stream was split by stride): rebuilt from the manifests when read."""

    committed: dict[str, int] = field(default_factory=dict)
    """Per writer: groups in its committed manifest lines (skipped shards included), set with ``started`` when it
    joins, raised in the same locked step as each manifest append. ``started - committed`` is what the writer has
    in flight (a writer without an entry, in a record of an hpcrl before it: none)."""

    @property
    def started_total(self) -> int:
        """Groups started by every writer."""
        return sum(self.started.values())

    def in_flight(self, writer: str) -> int:
        """Groups ``writer`` started and has not committed."""
        started = self.started.get(writer, 0)
        return max(0, started - self.committed.get(writer, started))


def _open_lock(run_dir: RunDir) -> int:
    try:
        return os.open(run_dir.admission_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:  # no control/ yet (not a mkdir per lock: a metadata operation each)
        run_dir.control.mkdir(parents=True, exist_ok=True)
        return os.open(run_dir.admission_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


@contextmanager
def _locked(run_dir: RunDir, held: Optional[int] = None):
    """The exclusive lock on ``control/admission.lock``: through ``held``, a descriptor of the lock file the caller
    keeps open (a rollout job's :class:`Admission`: no open per lock), else one opened and closed here."""
    fd = held if held is not None else _open_lock(run_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                raise AdmissionLockUnsupported(
                    f"flock on {run_dir.admission_lock} failed ({e}); the shared admission budget needs file "
                    "locks: mount Lustre with -o flock, or put the run directory on a filesystem with locking") from e
            raise
        yield
    finally:
        if held is None:
            os.close(fd)  # releases the lock
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _manifest_lines(run_dir: RunDir, writer: str) -> list[dict]:
    return [line for line in read_jsonl(run_dir.shard_manifest(writer)) if isinstance(line, dict)]


def _committed_groups(run_dir: RunDir, writer: str) -> int:
    """Groups in ``writer``'s committed lines, skipped shards included (what its admission count resets to)."""
    return sum(int(line.get("n_groups", 0)) for line in _manifest_lines(run_dir, writer))


def _live_committed(run_dir: RunDir, writer: str, skips: SkipLog) -> set[int]:
    """Prompts ``writer`` committed in rows the trainer did not skip (as ``ShardWriter`` counts them)."""
    live = Counter(p for line in _manifest_lines(run_dir, writer) for p in line.get("prompt_indices", ()))
    for rec in skips.poll():
        if rec.writer == writer:
            live.subtract(rec.prompt_indices)
    return {p for p, n in live.items() if n > 0}


def _book_from_manifests(run_dir: RunDir, skips: SkipLog) -> ClaimBook:
    """The claims of a record written before them, or of a damaged one: :func:`claims.from_stride` on the
    writers' manifests. Every writer's lease is empty, so a live job of any writer commits nothing more before
    it joins again (safe whatever the claims were)."""
    writers = run_dir.writers()
    return claims.from_stride({w: _live_committed(run_dir, w, skips) for w in writers},
                              {w: RunDir.writer_rank(w) for w in writers})


def _release(run_dir: RunDir, writer: str, why: str, still: Callable[[], bool] = lambda: True) -> Optional[int]:
    """:func:`release_writer`, only if ``still()`` holds under the lock; None when nothing was released."""
    skips = SkipLog(run_dir)
    with _locked(run_dir):
        state = Admission._read_at(run_dir, skips)
        if writer not in state.prompts.claims or not still():
            return None
        state.started[writer] = state.committed[writer] = _committed_groups(run_dir, writer)
        skipped = {p for rec in SkipLog(run_dir).poll() if rec.writer == writer for p in rec.prompt_indices}
        n = claims.release(state.prompts, writer, _live_committed(run_dir, writer, skips), why, time.time(), skipped)
        write_json_atomic(run_dir.admission, state.to_json())
    bump(run_dir, f"writer {writer} released its budget and claims", why)  # jobs blocked on the budget look again
    log.info("writer %s left (%s): %d open prompt claims handed back to the fleet", writer, why, n)
    return n


def release_writer(run_dir: RunDir, writer: str, why: str) -> int:
    """``writer`` left for good (drained, its job ended and is not resubmitted, or it is gone: ``control/reclaim.py``):
    its admission count drops to what it committed and its open claims go to the free list, under the lock; returns
    how many were handed back. Called by the writer itself when drained, by the launcher, and by the other writers
    (:meth:`Admission.reclaim_gone_writers`); a second call does nothing."""
    return _release(run_dir, writer, why) or 0


def given_back(run_dir: RunDir) -> int:
    """Groups whose admission places were given back beyond the skipped shards': those the trainer's dynamic sampling
    dropped (:class:`~hpcrl.control.records.FilteredGroups`; 0 without dynamic sampling)."""
    return read_filtered_groups(run_dir)


def read_claims(run_dir: RunDir) -> Optional[ClaimBook]:
    """The claim book as last written, without the lock (for status and the audit); None before any writer
    joined or for a record of an hpcrl before claims."""
    try:
        rec = AdmissionRecord.from_json(read_json(run_dir.admission), str(run_dir.admission))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return rec.prompts


class Admission:
    """One writer's view of the shared budget and of its prompt claims (see the module docstring)."""

    def __init__(self, run_dir: RunDir, writer: str, budget: int, reclaim_after_s: Optional[float] = None,
                 bound: Optional[int] = None, share: str = SHARE_BY_LOAD, lag: Optional[tuple[int, int]] = None):
        """``reclaim_after_s``: ``timeouts.heartbeat_stale_s``, after which the claims of a writer whose job has
        ended are reclaimed (``control/reclaim.py``); None: this job never reclaims. ``bound``: groups this job
        may have in flight at most (``RunConfig.knobs.group_bound``; None: no bound of its own); ``share``:
        ``rollout.budget_share``; ``lag``: (K * R, the lag bound), checked at each commit (None: not checked)."""
        self.run_dir = run_dir
        self.writer = writer
        self.budget = budget
        self.bound = bound if bound is not None else 2**62  # None: no bound of its own
        self.share = share
        self.lag = lag
        self.holding: Optional[tuple[int, int]] = None
        """The version this job generates with and its ``consumed_groups`` (set by the job at each load): the
        commit's lag check reasons from it."""
        self.unchecked: set[int] = set()
        """Prompts committed without the lag check (the job found no newer version to carry them into)."""
        self._lock_fd: Optional[int] = None  # the lock file, opened at the first lock and kept (closed by leave)
        self.refused = ""
        """Why the last :meth:`start` started fewer than asked (empty: it did not): ``budget`` (spent for this
        version: only a change in the run directory can give more) or ``share`` (this job is at its share or bound:
        a group of its own must finish)."""
        self.skips = SkipLog(run_dir)
        self.lease = f"{socket.gethostname()}:{os.getpid()}:{time.time():.3f}"
        """This job's lease on the writer's claims (``control/claims.py``)."""
        self.history = FleetLog(run_dir, writer)
        """This writer's ``joined`` and ``ended`` events (``control/fleet_log.py``)."""
        self.gone = None if reclaim_after_s is None else GoneWriters(run_dir, writer, reclaim_after_s)
        """Which other writers are gone (``control/reclaim.py``); None: this job never reclaims."""

    def _locked(self):
        """The admission lock through this job's own descriptor of the lock file (one open for the job's life)."""
        if self._lock_fd is None:
            self._lock_fd = _open_lock(self.run_dir)
        return _locked(self.run_dir, self._lock_fd)

    def _read(self) -> AdmissionRecord:
        return self._read_at(self.run_dir, self.skips)

    @staticmethod
    def _read_at(run_dir: RunDir, skips: SkipLog) -> AdmissionRecord:
        """The record (the lock held); a damaged one is set aside and rebuilt (:meth:`_rebuild`), one without
        claims gets them from the manifests."""
        path = run_dir.admission
        state = AdmissionRecord()
        try:
            raw = path.read_bytes()  # not a stat first: one metadata operation less per start
        except FileNotFoundError:
            raw = None  # no record yet
        if raw is not None:
            try:
                state = AdmissionRecord.from_json(json.loads(raw), str(path))  # JSON null is not a record either
            except (ValueError, UnicodeDecodeError) as e:  # not JSON, or JSON that is not the record
                state = Admission._rebuild(run_dir, f"{type(e).__name__}: {e}")
        if state.prompts is None:
            state.prompts = _book_from_manifests(run_dir, skips)
        return state

    @staticmethod
    def _rebuild(run_dir: RunDir, why: str) -> AdmissionRecord:
        """Set the damaged record aside and count each writer's committed groups from its manifest instead (what
        a restarted writer resets its own count to). Groups other writers have in flight are not counted until
        they restart: the budget may be exceeded by that many once, which beats every writer failing at each
        start; logged. The claims are rebuilt by the caller (every lease empty: each live writer commits nothing
        more and restarts)."""
        path = run_dir.admission
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        os.replace(path, aside)
        started = {w: _committed_groups(run_dir, w) for w in run_dir.writers()}
        log.error("%s was damaged (%s); moved to %s and rebuilt from the writers' manifests: %s (groups in flight "
                  "elsewhere are counted again when their writers restart)", path, why, aside.name, started)
        return AdmissionRecord(started=started, committed=dict(started))

    def join(self, committed_groups: int, committed: set[int], regenerate: Iterable[int] = ()) -> list[int]:
        """At writer start: groups in flight in a previous life of this writer are released from the budget, and
        this job takes over the writer's claims (new lease); returns the claimed prompts it must generate first
        (its open claims less ``committed``, plus ``regenerate``)."""
        with self._locked():
            state = self._read()
            state.started[self.writer] = state.committed[self.writer] = committed_groups
            gaps = claims.join(state.prompts, self.writer, self.lease, committed, regenerate)
            write_json_atomic(self.run_dir.admission, state.to_json())
        bump(self.run_dir, f"writer {self.writer} joined (its predecessor's groups in flight released)", self.writer)
        log.info("writer %s joined the fleet (lease %s): %d claimed prompts to generate first, next new prompt %d",
                 self.writer, self.lease, len(gaps), state.prompts.next_prompt)
        self.history.record(JOINED, writer=self.writer, job=RunDir.rollout_job(self.writer), job_id=slurm_job_id(),
                            host=socket.gethostname(), pid=os.getpid(),
                            numbers={"lease": self.lease, "claimed_first": len(gaps),
                                     "committed_groups": committed_groups})
        return gaps

    def start(self, consumed_groups_at_version: int, most: int, own: Sequence[int] = (),
              in_flight: Optional[int] = None, look_for_skips: bool = True) -> list[int]:
        """Reserve as many group starts, up to ``most``, as the budget and this job's share allow (module
        docstring; :func:`~hpcrl.config.knobs.starts_allowed`), all under one acquisition of the lock, and claim
        their prompts (``own``: prompts this writer holds already, taken first); the prompt indices, in order.
        Fewer than ``most``: :attr:`refused` says why. ``in_flight``: the groups the job is generating (the
        record's count also holds those finished and not yet sealed). ClaimLost if the claims were released. Every
        few seconds the claims of gone writers are reclaimed first (:meth:`reclaim_gone_writers`).
        ``look_for_skips``: read what the skip log gained (a job passes it when ``control/changes.jsonl`` grew, as
        the trainer bumps it after each skip: one stat less per start)."""
        self.reclaim_gone_writers()
        if look_for_skips:
            self.skips.poll()  # only grows: a record read late gives less budget, never more
        back = given_back(self.run_dir)  # before the lock: whenever read, each group it counts was dropped
        with self._locked():
            state = self._read()
            left = consumed_groups_at_version + self.budget - (state.started_total - self.skips.skipped_groups() - back)
            live = set(state.prompts.claims) | {self.writer}
            fleet = sum(state.in_flight(w) for w in live)
            mine = state.in_flight(self.writer) if in_flight is None else in_flight
            n = starts_allowed(self.share, mine, self.bound, left, fleet, len(live), most)
            self.refused = "" if n == most else "budget" if left - n <= 0 else "share"
            if n == 0:
                return []
            held = list(own[:n])
            indices = [claims.claim(state.prompts, self.writer, self.lease, held[i] if i < len(held) else None)
                       for i in range(n)]
            state.started[self.writer] = state.started.get(self.writer, 0) + n
            write_json_atomic(self.run_dir.admission, state.to_json())
            return indices

    def try_start(self, consumed_groups_at_version: int, own: Optional[int] = None,
                  in_flight: Optional[int] = None, look_for_skips: bool = True) -> Optional[int]:
        """One start (:meth:`start` with ``most=1``): its prompt index, or None (:attr:`refused` says why)."""
        got = self.start(consumed_groups_at_version, 1, () if own is None else (own,), in_flight, look_for_skips)
        return got[0] if got else None

    @contextmanager
    def committing(self, prompts: list[int], newest_tokens: Optional[list[int]] = None) -> Iterator[None]:
        """Around the append of a manifest line: the lock held, the prompts checked to be this job's open
        claims (ClaimLost otherwise: nothing is appended) and, given each group's newest token version, to be
        trainable within the lag bound from their places in the commit order (CommitRefused naming those that are
        not: nothing is appended); closed and counted as committed once the body returned."""
        with self._locked():
            state = self._read()
            if newest_tokens is not None:
                self._check_lag(state, prompts, newest_tokens)
            claims.commit(state.prompts, self.writer, self.lease, prompts)
            yield
            state.committed[self.writer] = state.committed.get(self.writer, state.started.get(self.writer, 0)) \
                + len(prompts)
            write_json_atomic(self.run_dir.admission, state.to_json())
        self.unchecked.difference_update(prompts)

    def _check_lag(self, state: AdmissionRecord, prompts: list[int], newest_tokens: list[int]) -> None:
        """CommitRefused with the prompts whose groups could be trained beyond the lag bound (module docstring)."""
        if self.lag is None or self.holding is None:
            return
        per_version, bound = self.lag
        version, consumed = self.holding
        before = sum(state.committed.values()) - self.skips.skipped_groups()
        late = [p for row, (p, newest) in enumerate(zip(prompts, newest_tokens))
                if p not in self.unchecked and newest >= 0  # -1: a group without a token has no lag
                and late_for_bound(newest, before + row + 1, version, consumed, per_version, bound)]
        if late:
            raise CommitRefused(late, f"{len(late)} group(s) could be trained more than {bound} version(s) after "
                                      f"their newest token (this job holds version {version})")

    def reclaim_gone_writers(self) -> list[str]:
        """Release the claims and budget of the other writers whose jobs are gone (``control/reclaim.py``), at most
        every few seconds; returns the writers released. A writer whose heartbeat moved since it was judged (a new
        job of it started) is left alone."""
        if self.gone is None or not self.gone.due():
            return []
        book = read_claims(self.run_dir)
        released = []
        for writer, beat, why in self.gone.find(book) if book is not None else ():
            if _release(self.run_dir, writer, f"reclaimed by {self.writer}: {why}",
                        still=lambda: same_beat(self.run_dir, writer, beat)) is not None:
                released.append(writer)
        return released

    def release(self, why: str) -> int:
        """This writer leaves for good (drained): :func:`release_writer`."""
        return release_writer(self.run_dir, self.writer, why)

    def leave(self, final_state: str) -> None:
        """The job ends in ``final_state``: a drained writer releases its budget and claims (:meth:`release`);
        every ending is recorded in the writer's fleet log (``ended``, with the claims handed back)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        released = self.release("drained") if final_state == HeartbeatState.DRAINED.value else 0
        self.history.record(ENDED, writer=self.writer, job=RunDir.rollout_job(self.writer), job_id=slurm_job_id(),
                            why=final_state, numbers={"lease": self.lease, "released_prompts": released})
        self.history.close()
