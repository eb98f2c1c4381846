"""Prompt claims (``control/claims.py`` through ``control/admission.py``): any number of writers take disjoint
prompts, a requeued job of a writer keeps its uncommitted claims, a writer that leaves hands them back, and a job
whose claims were released or taken over commits nothing. Real files, real flock, real shard writers."""
import json
import multiprocessing
import random

import pytest

from hpcrl.control import claims
from hpcrl.control.admission import Admission, read_claims, release_writer
from hpcrl.control.claims import ClaimBook, ClaimLost
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.skips import SkipLog
from hpcrl.samples.writer import ShardWriter
from test_samples import make_group

BIG = 10**9  # a budget that never binds: these tests are about the claims


def _join(rd: RunDir, writer: str, seal_groups: int = 2) -> tuple[Admission, ShardWriter, list[int]]:
    """What a rollout job's start does (rollout/parts.py)."""
    adm = Admission(rd, writer, BIG)
    w = ShardWriter(rd, writer, seal_groups, 60, skips=SkipLog(rd), commit_guard=adm.committing)
    return adm, w, adm.join(w.committed_groups, w.committed_prompt_indices, w.skipped_at_start)


def _committed(rd: RunDir) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for writer in rd.writers():
        for line in map(json.loads, rd.shard_manifest(writer).read_text().splitlines()):
            for p in line["prompt_indices"]:
                out.setdefault(p, []).append(writer)
    return out


def test_writers_that_join_at_different_times_take_disjoint_prompts_in_order(tmp_path):
    rd = RunDir(tmp_path).create()
    a, _, _ = _join(rd, "w000")
    got = {"w000": [a.try_start(0) for _ in range(3)]}
    b, _, _ = _join(rd, "w001")
    got["w001"] = [b.try_start(0) for _ in range(2)]
    c, _, _ = _join(rd, "w007")  # a writer id need not follow the others
    got["w007"] = [c.try_start(0), a.try_start(0)]
    assert got == {"w000": [0, 1, 2], "w001": [3, 4], "w007": [5, 6]}
    book = read_claims(rd)
    assert book.next_prompt == 7 and book.claims["w000"].prompts == [0, 1, 2, 6]


def test_a_requeued_job_keeps_its_uncommitted_claims_and_its_predecessor_can_commit_nothing(tmp_path):
    rd = RunDir(tmp_path).create()
    old, w, _ = _join(rd, "w000")
    for i in range(4):  # claims 0..3; 0, 1 committed (seal_groups=2), 2 buffered, 3 in flight
        index = old.try_start(0)
        if i < 3:
            w.add(make_group(index))
        if w.seal_due():
            w.seal()
    other, _, _ = _join(rd, "w001")
    assert other.try_start(0) == 4
    new, w2, held = _join(rd, "w000")  # the requeued job: a new lease
    assert held == [2, 3], "claimed, never committed: generated again by the same writer"
    w.add(make_group(9))
    with pytest.raises(ClaimLost, match="newer job"):
        w.seal()  # the zombie predecessor's shard is never committed...
    assert new.try_start(0, own=2) == 2 and new.try_start(0, own=3) == 3 and new.try_start(0) == 5
    w2.add(make_group(2))
    w2.add(make_group(3))
    w2.seal()
    assert sorted(_committed(rd)) == [0, 1, 2, 3]
    w3 = ShardWriter(rd, "w000", 2, 60)  # ...and its file is removed as uncommitted at the next start
    assert w3.committed_prompt_indices == {0, 1, 2, 3} and len(list(rd.writer_dir("w000").glob("*.h5"))) == 2


def test_a_drained_writer_hands_back_its_claims_and_budget_and_commits_nothing_after(tmp_path):
    rd = RunDir(tmp_path).create()
    a, wa, _ = _join(rd, "w000")
    b, _, _ = _join(rd, "w001")
    for _ in range(3):
        wa.add(make_group(a.try_start(0)))  # 0, 1, 2: seal_groups=2 commits 0, 1
        if wa.seal_due():
            wa.seal()
    assert [b.try_start(0) for _ in range(2)] == [3, 4]
    assert a.release("drained") == 1, "prompt 2 was open"
    assert release_writer(rd, "w000", "drained") == 0, "a second release does nothing"
    rec = json.loads(rd.admission.read_text())
    assert rec["started"]["w000"] == 2, "its budget drops to what it committed"
    assert rec["prompts"]["left"]["w000"]["why"] == "drained"
    assert [b.try_start(0) for _ in range(2)] == [2, 5], "a released prompt is taken first"
    with pytest.raises(ClaimLost, match="drained"):
        wa.seal()
    with pytest.raises(ClaimLost):
        a.try_start(0)
    _, _, held = _join(rd, "w000")  # a writer that left may join again: it holds nothing
    assert held == [] and "w000" not in read_claims(rd).left


def test_a_writer_that_leaves_hands_over_the_prompts_of_its_skipped_shards_and_never_regenerates_them(tmp_path):
    """The trainer skipped a damaged shard of w000 (its prompts are to be generated again) and w000 left before it
    did: its prompts go to the free list, another writer takes them, and w000 joining again does not take them."""
    from hpcrl.samples.skips import SkippedShard

    rd = RunDir(tmp_path).create()
    a, wa, _ = _join(rd, "w000")
    b, _, _ = _join(rd, "w001")
    for _ in range(2):
        wa.add(make_group(a.try_start(0)))
    line = wa.seal()
    SkipLog(rd).record(SkippedShard("w000", line.shard, [0, 1], 2, "damaged (test)", 0.0))
    assert release_writer(rd, "w000", "gone (test)") == 2, "its skipped prompts, never generated again"
    assert read_claims(rd).free == [0, 1] and read_claims(rd).handed == {"w000": [0, 1]}
    assert [b.try_start(0) for _ in range(3)] == [0, 1, 2]
    _, _, held = _join(rd, "w000")  # it comes back: its shard is still skipped, but the prompts are w001's now
    assert held == [], "handed over: never generated twice"
    assert read_claims(rd).claims["w001"].prompts == [0, 1, 2]


def _claim_many(root: str, writer: str, n: int, out) -> None:
    rd = RunDir(root)
    adm, w, _ = _join(rd, writer, seal_groups=3)
    got = []
    for _ in range(n):
        got.append(adm.try_start(0))
        w.add(make_group(got[-1], writer=writer))
        if w.seal_due():
            w.seal()
    w.close()
    out.put(got)


def test_concurrent_writers_in_separate_processes_claim_each_prompt_once(tmp_path):
    rd = RunDir(tmp_path).create()
    out = multiprocessing.get_context("fork").Queue()
    procs = [multiprocessing.get_context("fork").Process(target=_claim_many, args=(str(rd.root), f"w00{k}", 40, out))
             for k in range(4)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    flat = sorted(i for g in got for i in g)
    assert flat == list(range(160)), "disjoint and contiguous"
    assert all(len(ws) == 1 for ws in _committed(rd).values()) and len(_committed(rd)) == 160


def test_a_record_from_before_claims_is_rebuilt_from_the_stride_of_the_manifests(tmp_path):
    rd = RunDir(tmp_path).create()
    for writer, prompts in (("w000", [0, 2, 6]), ("w001", [1])):  # W=2: 4 was in flight in w000, 3 and 5 in w001
        w = ShardWriter(rd, writer, 8, 60)
        for p in prompts:
            w.add(make_group(p, writer=writer))
        w.close()
    rd.admission.write_text(json.dumps({"started": {"w000": 4, "w001": 3}}))
    _, _, held0 = _join(rd, "w000")
    _, _, held1 = _join(rd, "w001")
    assert (held0, held1) == ([4], [3, 5])
    assert read_claims(rd).next_prompt == 7


def test_the_claim_book_alone():
    book = ClaimBook()
    assert claims.join(book, "w000", "L0", set()) == []
    assert [claims.claim(book, "w000", "L0") for _ in range(3)] == [0, 1, 2]
    claims.commit(book, "w000", "L0", [1])
    with pytest.raises(ClaimLost, match="does not hold"):
        claims.commit(book, "w000", "L0", [1])
    assert claims.release(book, "w000", {0}, "drained", 1.0) == 1  # 0 was committed (its line is durable)
    assert book.free == [2] and book.left["w000"].released == 1
    with pytest.raises(ClaimLost, match="drained"):
        claims.claim(book, "w000", "L0")


def test_random_joins_drains_and_kills_never_commit_a_prompt_twice_or_lose_one(tmp_path):
    """A few hundred random steps of up to four writers: claim, seal, a SIGKILL (the job's memory is lost, the
    next job of the writer joins), a drain (seal, release), a zombie that tries to commit after it was replaced."""
    rng = random.Random(7)
    rd = RunDir(tmp_path).create()
    jobs: dict[str, list] = {}  # writer -> [admission, shard writer, held prompts]
    zombies = []
    for _ in range(300):
        writer = f"w00{rng.randrange(4)}"
        if writer not in jobs:
            jobs[writer] = list(_join(rd, writer, seal_groups=rng.choice((1, 2, 3))))
            continue
        adm, w, held = jobs[writer]
        op = rng.random()
        if op < 0.6:
            index = adm.try_start(0, own=held[0] if held else None)
            held[:] = [p for p in held if p != index]
            w.add(make_group(index, writer=writer))
            if w.seal_due():
                w.seal()
        elif op < 0.75:  # SIGKILL: the buffer is lost; the writer's next job joins later
            zombies.append(jobs.pop(writer))
        elif op < 0.85:  # drain: seal, release
            w.close()
            adm.release("drained")
            del jobs[writer]
        elif zombies:  # a job thought dead tries to commit after its writer was replaced or released
            z_adm, z_w, _ = zombies.pop(0)
            book = read_claims(rd)
            mine = book.claims.get(z_adm.writer)
            if z_w.buffered and (mine is None or mine.lease != z_adm.lease):
                with pytest.raises(ClaimLost):
                    with z_adm.committing([g.prompt_index for g in z_w._buffer]):
                        raise AssertionError("the guard let a replaced job commit")
    committed = _committed(rd)
    assert all(len(ws) == 1 for ws in committed.values()), "no prompt committed twice"
    book = read_claims(rd)
    accounted = set(committed) | book.open_prompts() | set(book.free)
    assert accounted >= set(range(book.next_prompt)), "every prompt claimed is committed, open or free"
    assert not (set(committed) & (book.open_prompts() | set(book.free))), "a committed prompt is neither open nor free"
