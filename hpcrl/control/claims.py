"""Which prompts each rollout job generates: a shared claim, so that the fleet may grow and shrink.

docs/weights-and-samples.md "Prompt claims". The prompt stream (``rollout/dataset.py``) is one sequence of indices
``0, 1, 2, ...`` for the whole fleet. A writer generates a prompt index only after it has *claimed* it in
``control/admission.json`` (:class:`~hpcrl.control.admission.AdmissionRecord`), under the same lock as the
admission budget, in the same step that reserves the group's start:

- **claim**: a writer takes the smallest released index (:attr:`ClaimBook.free`), else the next index never
  claimed (:attr:`ClaimBook.next_prompt`); the index joins the writer's open claims;
- **commit**: the writer's shard manifest line is appended under the lock, after checking that every prompt
  of the shard is still among its open claims under its own lease; the claims then close. A writer whose
  claims were released meanwhile (:class:`ClaimLost`) commits nothing;
- **join**: a writer's job, at start, takes a new lease (a zombie predecessor can then commit nothing) and
  keeps its open claims less what its manifest committed: a requeued job regenerates exactly those (and
  continues the groups its predecessor saved in flight, which are keyed by prompt index);
- **release**: a writer that leaves for good hands its open claims less its committed prompts to
  :attr:`ClaimBook.free`, where any writer takes them first: the writer itself when drained, the launcher for a job
  that ended and is not resubmitted, or the other writers for one that is gone (heartbeat stale and its job ended:
  ``control/reclaim.py``). The prompts of its shards the trainer skipped that it had not generated again go to the
  free list too (:attr:`ClaimBook.handed`). A writer released so may join again later: it holds nothing then, and
  never regenerates what it handed over.

So a prompt index is open in at most one writer's claims at any instant and committed by at most one
writer, whatever joins, leaves or is killed; every index below ``next_prompt`` is committed, open, or free
(``analysis/exactly_once.py`` checks exactly this). A record written by an hpcrl before claims (no
``next_prompt``) split the stream by stride (writer ``w`` of ``W`` took ``w, w + W, ...``):
:func:`from_stride` rebuilds the book from the writers' manifests the first time it is read.

Everything here is pure (no files, no lock): :mod:`hpcrl.control.admission` calls it under the lock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from hpcrl.rundir.json_record import JsonRecord


class ClaimLost(RuntimeError):
    """This writer's claims were released (it was drained, or reclaimed as gone by another writer) or taken over
    by a newer job of the same writer (another lease): it must not commit and must stop. Its job then ends as
    failed; a new job of the writer (resubmitted, requeued) joins again and holds what is still its own."""


@dataclass
class WriterClaims(JsonRecord):
    """One writer's open claims in ``control/admission.json``: written by that writer's job (claim, commit, join),
    removed by whoever releases them (the writer when drained, the launcher for a job that left for good, another
    writer that reclaims a gone one: ``control/reclaim.py``)."""

    lease: str
    """The id of the writer's current job (host, pid, time): set at its start; a commit under another is refused."""
    prompts: list[int] = field(default_factory=list)
    """Prompt indices claimed and not yet committed (sorted)."""


@dataclass
class WriterLeft(JsonRecord):
    """A writer that released its claims (for ``hpcrl status`` and the logs)."""

    why: str
    """``drained``, what the launcher saw (``drained: its job ended``), or who reclaimed it and what it saw
    (``reclaimed by w000: heartbeat stale 312 s and Slurm job 123 ended (COMPLETED)``)."""
    time_s: float
    released: int
    """Open claims handed to the free list."""


@dataclass
class ClaimBook(JsonRecord):
    """The claim fields of the admission record (module docstring); :func:`claim` etc. change it in place."""

    next_prompt: int = 0
    """Every index below it has been claimed by some writer once."""
    claims: dict[str, WriterClaims] = field(default_factory=dict)
    """Writers in the fleet -> their open claims."""
    free: list[int] = field(default_factory=list)
    """Indices released by writers that left, not yet claimed again (sorted)."""
    left: dict[str, WriterLeft] = field(default_factory=dict)
    """Writers that left (released their claims) and have not joined again."""
    handed: dict[str, list[int]] = field(default_factory=dict)
    """Prompts of a writer's shards the trainer skipped, handed to the free list when it left before generating
    them again: that writer never regenerates them if it joins again (another writer has them)."""

    def open_prompts(self) -> set[int]:
        """Indices claimed by some writer and not committed."""
        return {p for c in self.claims.values() for p in c.prompts}


def join(book: ClaimBook, writer: str, lease: str, committed: set[int], regenerate: Iterable[int] = ()) -> list[int]:
    """A job of ``writer`` starts under ``lease``: its open claims less ``committed`` stay its own, plus
    ``regenerate`` (prompts of its shards the trainer skipped); returns them, sorted (it generates them first)."""
    old = book.claims.get(writer)
    mine = set(regenerate) - set(book.handed.get(writer, ()))
    keep = sorted((set(old.prompts if old is not None else ()) - committed) | mine)
    book.claims[writer] = WriterClaims(lease, keep)
    book.left.pop(writer, None)
    return keep


def _own(book: ClaimBook, writer: str, lease: str) -> WriterClaims:
    mine = book.claims.get(writer)
    if mine is None:
        left = book.left.get(writer)
        raise ClaimLost(f"writer {writer}'s claims were released ({left.why if left else 'it is not in the fleet'}); "
                        "this job must not commit")
    if mine.lease != lease:
        raise ClaimLost(f"writer {writer} was taken over by a newer job (lease {mine.lease}, ours {lease}); "
                        "this job must not commit")
    return mine


def claim(book: ClaimBook, writer: str, lease: str, own: Optional[int] = None) -> int:
    """One more prompt for ``writer``: ``own`` if given (an index it holds already, or one of its skipped shards),
    else the smallest free index, else ``next_prompt``. ClaimLost if the writer is not the lease holder."""
    mine = _own(book, writer, lease)
    if own is not None:
        index = own
    elif book.free:
        index = book.free.pop(0)
    else:
        index = book.next_prompt
        book.next_prompt += 1
    if index not in mine.prompts:
        mine.prompts = sorted([*mine.prompts, index])
    return index


def commit(book: ClaimBook, writer: str, lease: str, prompts: Iterable[int]) -> None:
    """``writer`` commits ``prompts``: each must be open in its claims under ``lease`` (else ClaimLost: a
    writer whose claims were released, or a stale job of it, would commit another writer's prompt); they close."""
    mine = _own(book, writer, lease)
    prompts = set(prompts)
    missing = prompts - set(mine.prompts)
    if missing:
        raise ClaimLost(f"writer {writer} does not hold prompts {sorted(missing)[:10]} any more; this job must not "
                        "commit them")
    mine.prompts = [p for p in mine.prompts if p not in prompts]


def release(book: ClaimBook, writer: str, committed: set[int], why: str, now_s: float,
            skipped: Iterable[int] = ()) -> int:
    """``writer`` left for good: its open claims less ``committed`` go to the free list, and so do ``skipped``
    (prompts of its shards the trainer skipped) not committed again (:attr:`ClaimBook.handed`); returns how many
    (0 when it holds none, or released them already)."""
    mine = book.claims.pop(writer, None)
    if mine is None:
        return 0
    lost = set(skipped) - committed
    handed = sorted((set(mine.prompts) | lost) - committed)
    if lost:
        book.handed[writer] = sorted(set(book.handed.get(writer, ())) | lost)
    book.free = sorted(set(book.free) | set(handed))
    book.left[writer] = WriterLeft(why, now_s, len(handed))
    return len(handed)


def from_stride(committed: dict[str, set[int]], writer_ids: dict[str, int]) -> ClaimBook:
    """The book of a run that split the stream by stride (an hpcrl before claims): ``next_prompt`` after the
    highest committed index; each index below it that no writer committed is an open claim of the writer whose
    stride it is (``index % W``, ``W`` the number of writers: its saved groups in flight stay usable), or free
    when that writer has no folder. ``committed``: writer -> its live committed prompts; ``writer_ids``: writer ->
    its number."""
    if not committed:
        return ClaimBook()
    top = max((max(c) for c in committed.values() if c), default=-1)
    width = max(writer_ids.values()) + 1
    by_id = {i: w for w, i in writer_ids.items()}
    done = set().union(*committed.values())
    book = ClaimBook(next_prompt=top + 1)
    for w in committed:
        book.claims[w] = WriterClaims("", [])
    for p in range(top + 1):
        if p in done:
            continue
        owner = by_id.get(p % width)
        if owner is None:
            book.free.append(p)
        else:
            book.claims[owner].prompts.append(p)
    return book
