"""The admission budget shared by load (``control/admission.py``, ``config/knobs.py: may_start``): under the same
lock and the same inequality, each live rollout job takes an even share of what the budget lets the fleet have
in flight, re-derived at every start (a job joining, leaving or reclaimed, a version landing), with
``rollout.max_concurrent_groups`` an upper bound (``auto`` by default); first come keeps the rule before. The
planner applies the same function (``hpcrl/plan/``). Real files, real flock, real shard writers."""
from __future__ import annotations

import pytest

from hpcrl.config import load_config
from hpcrl.config.checks import ConfigError
from hpcrl.config.knobs import AUTO, group_bound, may_start, share_level
from hpcrl.config.names import FIRST_COME, SHARE_BY_LOAD
from hpcrl.config.simulated import SimulatedConfig
from hpcrl.control.admission import Admission, read_claims, release_writer
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.skips import SkipLog
from hpcrl.samples.writer import ShardWriter
from test_samples import make_group

from conftest import TINY


def _join(rd: RunDir, writer: str, budget: int, share: str = SHARE_BY_LOAD, bound=None):
    adm = Admission(rd, writer, budget, bound=bound, share=share)
    w = ShardWriter(rd, writer, 1, 60, skips=SkipLog(rd), commit_guard=adm.committing)
    adm.join(w.committed_groups, w.committed_prompt_indices, w.skipped_at_start)
    return adm, w


def _starts(adm: Admission, consumed: int) -> list[int]:
    """Every start the admission allows now (the job asking until it is refused)."""
    out = []
    while (index := adm.try_start(consumed)) is not None:
        out.append(index)
    return out


def test_the_rule_shares_what_the_budget_lets_the_fleet_have_in_flight():
    assert share_level(fleet_in_flight=0, budget_left=768, jobs=64) == 12
    assert share_level(fleet_in_flight=10, budget_left=8, jobs=2) == 9  # F + left does not move when one starts
    assert share_level(fleet_in_flight=11, budget_left=7, jobs=2) == 9
    assert not may_start(SHARE_BY_LOAD, 12, 16, 1, 767, 64) and may_start(SHARE_BY_LOAD, 11, 16, 1, 767, 64)
    assert not may_start(SHARE_BY_LOAD, 0, 16, 0, 768, 64), "no start beyond the budget, whatever the share"
    assert may_start(FIRST_COME, 15, 16, 1, 767, 64) and not may_start(FIRST_COME, 16, 16, 500, 16, 64)
    # auto: what the engine decodes at once (256 sequences of 16: 16 groups), never more than B
    assert group_bound(AUTO, 768, 256, 16) == 16 and group_bound(AUTO, 6, 256, 2) == 6
    assert group_bound(4, 768, 256, 16) == 4


def test_the_config_takes_auto_or_a_number_and_a_share_by_name(tmp_path):
    cfg = load_config(TINY, ["rollout.max_concurrent_groups=auto"])
    assert cfg.rollout.max_concurrent_groups == AUTO and cfg.rollout.budget_share == SHARE_BY_LOAD
    assert cfg.knobs.group_bound == min(cfg.admission_budget, -(-cfg.rollout.max_num_seqs // cfg.rollout.n))
    assert load_config(TINY, ["rollout.max_concurrent_groups=3"]).knobs.group_bound == 3
    for bad, said in (("rollout.max_concurrent_groups=0", "an integer >= 1 or auto"),
                      ("rollout.max_concurrent_groups=many", "an integer >= 1 or auto"),
                      ("rollout.budget_share=fair", "first_come")):
        with pytest.raises(ConfigError, match=said):
            load_config(TINY, [bad])


def test_jobs_of_a_fleet_share_a_version_evenly_whoever_asks_first(tmp_path):
    """B=8 over 4 writers: whichever asks first gets 2 (not 8), each of the others 2; first come: the first 8."""
    rd = RunDir(tmp_path / "load").create()
    jobs = [_join(rd, f"w00{i}", 8)[0] for i in range(4)]
    got = [_starts(adm, 0) for adm in jobs]
    assert [len(g) for g in got] == [2, 2, 2, 2] and jobs[0].refused == "share"
    assert _starts(jobs[0], 0) == [] and jobs[0].refused == "budget", "the budget, once all is started"
    rd = RunDir(tmp_path / "first").create()
    jobs = [_join(rd, f"w00{i}", 8, share=FIRST_COME)[0] for i in range(4)]
    assert [len(_starts(adm, 0)) for adm in jobs] == [8, 0, 0, 0]


def test_a_bound_caps_a_job_and_the_budget_left_goes_to_jobs_that_ask(tmp_path):
    """With a bound of 3, a job never has more in flight; a job that commits may take the share of one that does
    not ask (the level falls with what is committed, its own in flight falls faster)."""
    rd = RunDir(tmp_path).create()
    (a, wa), (b, _) = _join(rd, "w000", 12, bound=3), _join(rd, "w001", 12, bound=3)
    assert len(_starts(a, 0)) == 3 and a.refused == "share", "its bound (the share is 6)"
    for index in range(3):  # a commits its three groups; b never asks
        wa.add(make_group(index))
        wa.seal()
    assert len(_starts(a, 0)) == 3, "a takes more of the budget while b does not ask"
    assert len(_starts(b, 0)) == 3 and len(_starts(a, 0)) == 0


def test_the_share_is_rederived_when_a_job_joins_leaves_or_a_version_lands(tmp_path):
    rd = RunDir(tmp_path).create()
    a, wa = _join(rd, "w000", 6)
    b, _ = _join(rd, "w001", 6)
    assert len(_starts(a, 0)) == 3 and len(_starts(b, 0)) == 3
    c, _ = _join(rd, "w002", 6)  # joins: the budget is spent, its share comes with the next version
    assert _starts(c, 0) == [] and c.refused == "budget"
    for index in range(3):  # a commits its three; the trainer consumes 4 and publishes: 4 more starts
        wa.add(make_group(index))
        wa.seal()
    got = {"a": _starts(a, 4), "c": _starts(c, 4), "b": _starts(b, 4)}
    # F = 3 (b) + 0 + 0, left 4: level ceil(7 / 3) = 3: a and c take 3 and 1 (the budget), b none
    assert {k: len(v) for k, v in got.items()} == {"a": 3, "c": 1, "b": 0}
    release_writer(rd, "w000", "drained")  # a leaves: its three groups in flight go back to the budget
    assert "w000" not in read_claims(rd).claims
    # F = 3 (b) + 1 (c), left 3, two jobs: level ceil(7 / 2) = 4: b takes 1, c 2
    assert (len(_starts(b, 4)), len(_starts(c, 4))) == (1, 2)


def _turns(jobs: list[Admission], bound: int) -> list[int]:
    """Jobs that ask at the same moment, taking turns at the admission lock: in each round every job gets one
    acquisition and asks, as the rollout job's group loop does, for all it has room for (``Admission.start``),
    until a round starts nothing; the groups each job started."""
    got = [0] * len(jobs)
    while True:
        round_ = [len(adm.start(0, bound - got[i], in_flight=got[i])) for i, adm in enumerate(jobs)]
        if not any(round_):
            return got
        got = [g + r for g, r in zip(got, round_)]


@pytest.mark.parametrize("share", [FIRST_COME, SHARE_BY_LOAD])
def test_jobs_asking_together_spread_a_version_as_the_planner_serves_them(tmp_path, share):
    """Jobs that load a version together and ask at once: the real lock serves each one turn after another, and
    in its turn a job takes every start the rule allows; the planner serves each job all the rule allows in turn
    (``starts_allowed`` in both). The same spread over the jobs: first come with a cap of 4 gives B=10 to three of
    four jobs (4, 4, 2), by load each takes up to the even share of 3 (3, 3, 3, 1). (When the lock gave one start
    per acquisition, the turns interleaved: 3, 3, 2, 2 either way, the spread of bench_share_runs' runs.)"""
    from hpcrl.plan import events
    from hpcrl.plan.model import Draws, Knobs

    rd = RunDir(tmp_path).create()
    real = _turns([_join(rd, f"w00{i}", 10, share=share, bound=4)[0] for i in range(4)], bound=4)
    sim = SimulatedConfig()
    k = Knobs(rollout_jobs=4, staleness_threshold=1.5, ppo_mini_batch_size=4, n=2, max_concurrent_groups=4,
              budget_share=share, partial_rollout=True)
    assert k.budget == 10
    pipe = events.Pipeline(sim, k, Draws(sim, 2, 1536, prompts=2))
    pipe.run(2)
    planned = [sum(1 for v, rank in pipe.starts if v == 0 and rank == r) for r in range(4)]
    assert sorted(real, reverse=True) == sorted(planned, reverse=True) == \
        ([4, 4, 2, 0] if share == FIRST_COME else [3, 3, 3, 1])


def test_the_planner_and_the_admission_take_the_same_starts(tmp_path):
    """What a version's budget gives each of 4 jobs asking in turn, by the admission lock and by the planner's job
    (both call ``may_start``): the same numbers."""
    from hpcrl.plan import events
    from hpcrl.plan.model import Draws, Knobs

    rd = RunDir(tmp_path).create()
    jobs = [_join(rd, f"w00{i}", 10, bound=4)[0] for i in range(4)]
    real = [len(_starts(adm, 0)) for adm in jobs]
    sim = SimulatedConfig()
    k = Knobs(rollout_jobs=4, staleness_threshold=1.5, ppo_mini_batch_size=4, n=2, max_concurrent_groups=4)
    assert k.budget == 10
    pipe = events.Pipeline(sim, k, Draws(sim, 2, 64, prompts=2))
    for job in pipe.jobs:
        job.version = 0  # version 0 loaded
        job.loading_until = None
    for job in pipe.jobs:
        job.service(0.0, pipe)
    assert [job.in_flight for job in pipe.jobs] == real == [3, 3, 3, 1]
