"""The lag bound enforced when a rollout job misses a version: the commit (``Admission.committing``, under the
admission lock) refuses a group that could be trained more than ``max_lag_bound`` versions after its newest
token, from its place in the commit order (``config/knobs.py: late_for_bound``); the job carries it into the
newest version (partial rollout: ``TrajectoryState.reopen``) or generates it again, counted; the trainer drops,
counted, any group that got past. The slow test is the case seen in the suite: a job slow to notice versions
(its change watch delayed on purpose) beside a fast one."""
from __future__ import annotations

import types

import numpy as np
import pytest

from conftest import check_exactly_once, start_rollout, start_trainer, wait_until
from hpcrl.logs import metric_names as M
from hpcrl.config.knobs import late_for_bound, latest_trainer_version
from hpcrl.control.admission import Admission
from hpcrl.control.records import read_heartbeats
from hpcrl.rundir.fsio import read_jsonl
from hpcrl.logs.run_logs import read_staleness
from hpcrl.rollout.engine import FINISH_STOP
from hpcrl.rollout.in_flight import InFlightStates
from hpcrl.rollout.trajectory import GENERATING, TrajectoryState
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.skips import SkipLog
from hpcrl.samples.writer import CommitRefused, ShardWriter
from test_samples import make_group

BIG = 10**9


def test_the_latest_trainer_version_of_a_place_in_the_commit_order():
    """K*R = 4. Version 11 was published after 44 groups: the 45th..48th are trained at 11, the 49th..52nd at 12
    at the latest, the 53rd at 13 (fewer if the trainer drops some: a version then consumes more)."""
    assert [latest_trainer_version(p, 11, 44, 4) for p in (45, 48, 49, 52, 53)] == [11, 11, 12, 12, 13]
    # the suite's case: every token at version 11, committed at the 53rd place while the trainer reached 13
    assert late_for_bound(11, 53, 11, 44, 4, bound=1) and not late_for_bound(11, 52, 11, 44, 4, bound=1)
    assert not late_for_bound(12, 53, 11, 44, 4, bound=1), "carried into version 12, it is within the bound"


def _writer(rd: RunDir, writer: str, lag=None, holding=None) -> tuple[Admission, ShardWriter]:
    adm = Admission(rd, writer, BIG, lag=lag)
    w = ShardWriter(rd, writer, 1, 60, skips=SkipLog(rd), commit_guard=adm.committing)
    adm.join(w.committed_groups, w.committed_prompt_indices, w.skipped_at_start)
    adm.holding = holding
    return adm, w


def test_a_commit_that_would_break_the_bound_is_refused_and_nothing_is_committed(tmp_path):
    """K*R = 4, bound 1. w000 commits 8 groups; w001, still on version 0, finishes a group under version 0: at the
    9th place it is trained at version 2 at the latest, lag 2: refused, its shard file removed, the record as it
    was; a group with a token of version 1 commits."""
    rd = RunDir(tmp_path).create()
    fast, wf = _writer(rd, "w000")
    slow, ws = _writer(rd, "w001", lag=(4, 1), holding=(0, 0))
    late, fresh = slow.try_start(0), slow.try_start(0)
    for _ in range(8):
        wf.add(make_group(fast.try_start(0), writer="w000"))
        wf.seal()
    record = rd.admission.read_bytes()
    ws.add(make_group(late, version=0, writer="w001"))
    with pytest.raises(CommitRefused) as refused:
        ws.seal()
    assert refused.value.prompts == [late] and "more than 1 version" in str(refused.value)
    assert not list(read_jsonl(rd.shard_manifest("w001"))) and not list(rd.writer_dir("w001").glob("shard-*"))
    assert rd.admission.read_bytes() == record and ws.buffered == 1
    assert [g.prompt_index for g in ws.withdraw(refused.value.prompts)] == [late]
    ws.add(make_group(fresh, version=1, writer="w001"))
    assert ws.seal().prompt_indices == [fresh]
    slow.unchecked.add(late)  # no newer version to carry it into: committed without the check
    ws.add(make_group(late, version=0, writer="w001"))
    assert ws.seal().prompt_indices == [late] and not slow.unchecked


def test_a_refused_group_is_carried_by_reopening_its_last_sampled_tokens(tmp_path):
    states = InFlightStates(tmp_path / "in_flight.json", enabled=True)
    trajs, _ = states.start(7, "single_turn", [TrajectoryState() for _ in range(3)])
    for j, t in enumerate(trajs):
        t.add([5, 6, 7 + j], [-0.1, -0.2, -0.3], 11, model=True)
        t.assistant_turns = 1
        t.terminate(FINISH_STOP)
    trajs[2].mask[-1] = 0  # ended on a tool's response: nothing of the model's to take back
    states.finish(7)
    assert states.carry(7)
    again, resumed = states.start(7, "single_turn", [TrajectoryState() for _ in range(3)])
    assert not resumed and again is trajs
    assert [(t.state, t.tokens, t.assistant_turns) for t in again[:2]] == [(GENERATING, [5, 6], 0)] * 2
    assert again[2].done and again[2].tokens == [5, 6, 9], "left as it was"
    states.finish(7)
    trajs[0].reopen(), trajs[1].reopen()
    assert not states.carry(8), "a group it never had"
    states.release([7])
    assert not states.carry(7), "a committed group is gone"


def test_the_trainer_drops_a_group_beyond_the_bound_with_its_reason():
    from hpcrl.trainer.dynamic_sampling import sort_taken

    cfg = types.SimpleNamespace(max_lag_bound=1, async_training=types.SimpleNamespace(max_staleness=2))
    keep_all = types.SimpleNamespace(keeps=lambda g: True, give_back=lambda n: None)  # dynamic sampling off

    def why(g, version):
        kept, dropped = [], {}
        sort_taken([g], kept, dropped, version, cfg, keep_all, 0)
        return next(iter(dropped), "")

    g = make_group(3, version=11)
    assert (why(g, 12), why(g, 13), why(g, 14)) == ("", "lag_bound", "lag_bound")
    g.trajectories[0].token_versions = np.full(len(g.trajectories[0].token_versions), 13)
    assert (why(g, 14), why(g, 13)) == ("max_staleness", "")
    empty = make_group(4, n=1)
    empty.trajectories[0].token_versions = np.zeros(0, dtype=int)
    assert why(empty, 1) == "", "a group without a token has no lag to bound"


def test_the_trainers_waiting_line_names_what_it_dropped():
    """A wait whose groups all go to a drop reason must not read as 'nothing committed' (0/4 for two minutes)."""
    from hpcrl.trainer.dynamic_sampling import describe_dropped

    assert describe_dropped({}) == ""
    groups = [make_group(i) for i in range(3)]
    assert describe_dropped({"lag_bound": groups[:2], "filter_groups": groups[2:]}) == \
        "; 3 dropped: filter_groups 1, lag_bound 2"


SLOW_JOB = {"HPCRL_FAULT_POINT": "change_look:every:sleep=0.5"}
"""The slow job: each look at control/changes.jsonl takes half a second (a version comes every ~0.3 s)."""
SETTING = ["rollout.engine=simulated", "trainer.simulated=true", "eval.every_versions=0", "simulated.time_scale=20",
           "simulated.lengths=geometric", "simulated.length_mean=30", "simulated.update_base_s=4.0",
           "simulated.weight_load_s=1.0", "rollout.response_length=96", "rollout.n=2",
           "rollout.total_rollout_steps=160", "async_training.staleness_threshold=1.0",
           "trainer.checkpoint_every_updates=1000", "resources.rollout_jobs=2", "timeouts.poll_max_s=0.05"]


@pytest.mark.slow
@pytest.mark.parametrize("partial", [True, False], ids=["carried", "dropped"])
def test_a_job_that_misses_versions_never_trains_a_group_beyond_the_bound(tiny_run, partial):
    """Two rollout jobs, one slow to notice versions (its change watch sleeps a second per look, so it finishes
    groups under versions two and more behind): no trained group's newest token lags beyond the bound; the slow
    job's refused groups are counted (carried with partial rollout, generated again without) in its rollout rows
    and the report's drops; exactly once."""
    rd = tiny_run(*SETTING, f"async_training.partial_rollout={str(partial).lower()}")
    cfg = rd.load_config()
    trainer, slow = start_trainer(rd), start_rollout(rd, 1, env=SLOW_JOB)
    wait_until(lambda: getattr(read_heartbeats(rd).get("rollout-w001"), "state", "") == "generating", 120,
               "the slow job generating", jobs=(trainer, slow))  # so that it has groups to finish late
    fast = start_rollout(rd, 0)
    assert trainer.wait(400) == 0, trainer.tail()
    assert fast.wait(120) == 0, fast.tail()
    assert slow.wait(120) == 0, slow.tail()
    st = read_staleness(rd)
    trained = st[st.dropped.fillna("") == ""]
    lag_end = trained.trainer_version - trained.groupby("group_id").version_end.transform("max")
    rows = list(read_jsonl(rd.rollout_metrics("w001")))
    carried, dropped = (sum(r.get(c, 0) for r in rows) for c in (M.LAG_CARRIED, M.LAG_DROPPED))
    last = list(read_jsonl(rd.metrics))[-1]
    print(f"lag of the newest token max {lag_end.max()} (bound {cfg.max_lag_bound}); slow job: {carried} carried, "
          f"{dropped} dropped at commit; trainer dropped {last[M.DROPPED_LAG_BOUND]} beyond the bound; "
          f"groups per writer {trained.drop_duplicates('group_id').writer.value_counts().to_dict()}")
    assert lag_end.max() <= cfg.max_lag_bound
    assert (carried if partial else dropped) > 0 and (dropped if partial else carried) == 0
    assert "the commit refused" in rd.job_log(RunDir.rollout_job("w001")).read_text()
    check_exactly_once(rd, cfg.knobs.group_bound)
    from hpcrl.analysis.load import load_run
    from hpcrl.analysis.tables import drops_table

    reasons = set(drops_table(load_run(rd.root)).reason)
    assert any(r.startswith("lag bound at commit") for r in reasons), reasons
