"""Audit of the exactly-once promise of a finished run: manifests vs the staleness log.

Used by the fault tests (``tests/conftest.py`` ``check_exactly_once``) and the soak
campaign (``bench/soak.py``). What "exactly once" means (issue #14):

- no prompt index is committed twice in shards the trainer did not skip, and none
  is consumed (a staleness-log group) twice;
- every group committed before the trainer's final cursor was consumed, none after,
  and none from a shard recorded in ``control/skipped_shards.jsonl``; a consumed group is trained on or
  dropped (``max_staleness``, ``filter_groups``: consumed, not trained), never both;
- no prompt index is committed by two writers;
- no prompt index was lost: each one below the claim book's ``next_prompt`` (``control/claims.py``) is
  committed in a shard that was not skipped, still open in some writer's claims (in flight when the run
  ended), or free (released by a writer that left, not claimed again); a skipped shard's prompts were
  generated again. (A run of an hpcrl before claims is checked per writer stride, less the last few prompts
  that may have been in flight at the end.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpcrl.control.admission import read_claims
from hpcrl.control.records import read_trainer_done
from hpcrl.rundir.fsio import read_jsonl
from hpcrl.logs.run_logs import read_staleness
from hpcrl.rundir.paths import RunDir


@dataclass
class Audit:
    """Problems found (each list empty on a correct run) and a few counts."""

    committed_twice: list[str] = field(default_factory=list)
    consumed_twice: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """Prompts never committed in a shard that was not skipped (below the in-flight tail)."""
    consumed_not_before_cursor: list[str] = field(default_factory=list)
    before_cursor_not_consumed: list[str] = field(default_factory=list)
    consumed_from_skipped_shards: list[str] = field(default_factory=list)
    trained_and_dropped: list[str] = field(default_factory=list)
    """Groups with rows both trained on and dropped."""
    trainer_done: bool = False
    consumed_groups: int = 0
    not_trained: dict[str, int] = field(default_factory=dict)
    """Consumed groups not trained on, by the reason the staleness log gives (``max_staleness``, ``filter_groups``)."""
    unconsumed_after_cursor: int = 0
    skipped_groups: int = 0

    def problems(self) -> dict[str, list[str]]:
        """The non-empty problem lists by name (plus ``trainer_done`` when it is missing)."""
        out = {k: v for k, v in vars(self).items() if isinstance(v, list) and v}
        if not self.trainer_done:
            out["trainer_done"] = ["the trainer did not finish (no trainer_done record in control/)"]
        return out


def audit(rd: RunDir, max_in_flight: int) -> Audit:
    """Compare every writer's manifest with the staleness log and the trainer's final cursor."""
    a = Audit()
    st = read_staleness(rd)
    a.consumed_twice = sorted(set(st.sample_id[st.sample_id.duplicated()]))[:20]
    consumed = set(st.group_id.dropna())
    a.consumed_groups = len(consumed)
    dropped = st[st.dropped.fillna("") != ""] if "dropped" in st else st.iloc[:0]
    a.not_trained = {str(r): int(rows.group_id.nunique()) for r, rows in dropped.groupby("dropped")}
    trained = set(st.group_id[st.dropped.fillna("") == ""]) if "dropped" in st else consumed
    a.trained_and_dropped = sorted(trained & set(dropped.group_id))[:20]
    done = read_trainer_done(rd)
    a.trainer_done = done is not None
    cursor = done.cursor if done is not None else {}
    skipped: dict[tuple[str, str], set[int]] = {}  # rows of a shard before the skip were trained on: not listed
    for d in read_jsonl(rd.skipped_shards):
        skipped.setdefault((d["writer"], d["shard"]), set()).update(d["prompt_indices"])
    before, after, from_skipped = set(), set(), set()
    live_by_writer: dict[str, list[int]] = {}
    for writer in rd.writers():
        pos = cursor.get(writer, {"line": 0, "row": 0})
        live = live_by_writer.setdefault(writer, [])
        for li, line in enumerate(read_jsonl(rd.shard_manifest(writer))):
            for row, p in enumerate(line["prompt_indices"]):
                gid = f"{writer}/{p}"
                if p in skipped.get((writer, line["shard"]), ()):
                    from_skipped.add((gid, line["shard"]))
                    a.skipped_groups += 1
                    continue
                live.append(p)
                (before if (li, row) < (pos["line"], pos["row"]) else after).add(gid)
    owners: dict[int, str] = {}
    for writer, live in live_by_writer.items():  # a prompt committed twice, by one writer or by two
        for p in live:
            if p in owners:
                a.committed_twice.append(f"{writer}/{p} (also {owners[p]}/{p})")
            owners[p] = writer
    book = read_claims(rd)
    if book is not None:
        a.lost = _lost_by_claims(book, set(owners))
    else:
        a.lost = _lost_by_stride(rd, live_by_writer, max_in_flight)
    shards_consumed = set(zip(st.group_id, st.shard))
    a.consumed_from_skipped_shards = sorted(f"{g} ({s})" for g, s in from_skipped if (g, s) in shards_consumed)
    a.consumed_not_before_cursor = sorted(consumed - before)[:20]
    a.before_cursor_not_consumed = sorted(before - consumed)[:20]
    a.unconsumed_after_cursor = len(after)
    return a


def _lost_by_claims(book, committed: set[int]) -> list[str]:
    """Every prompt below the claim book's ``next_prompt`` is committed, open in a writer's claims (in flight when
    the run ended, or held by a job that left without releasing) or free (released, not claimed again)."""
    accounted = committed | book.open_prompts() | set(book.free)
    return [f"prompt {p}" for p in range(book.next_prompt) if p not in accounted][:50]


def _lost_by_stride(rd: RunDir, live_by_writer: dict[str, list[int]], max_in_flight: int) -> list[str]:
    """A run of an hpcrl before prompt claims (writer ``w`` of ``W`` took ``w, w + W, ...``): each prompt of a
    writer's stride below its highest committed one (less the last few that may have been in flight when the run
    ended) is committed."""
    W = rd.load_config().resources.rollout_jobs
    lost = []
    for writer, live in live_by_writer.items():
        if live:
            top = max(live) - max_in_flight * W
            seen = set(live)
            lost += [f"{writer}/{p}" for p in range(RunDir.writer_rank(writer), top, W) if p not in seen]
    return lost
