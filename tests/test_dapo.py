"""DAPO as verl's recipes run it (hpcrl/config/dapo.py): the overlong penalty is verl's formula where verl adds it,
overlong filtering masks exactly the truncated responses, verl's keys are read as they are, dynamic sampling keeps
verl's rule and bound, and the admission budget gives a dropped group's place back. Real files, no jobs."""
import math

import pytest
import torch

from conftest import TINY, check_exactly_once, start_rollout, start_trainer
from hpcrl.config import ConfigError, load_config
from hpcrl.control.admission import Admission
from hpcrl.control.fatal import read_fatal_record
from hpcrl.control.records import FilteredGroups, read_filtered_groups, read_heartbeats
from hpcrl.launcher.resume_changes import check_changes
from hpcrl.logs.run_logs import read_metrics, read_staleness
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.rollout.shaping import RewardShaping, overlong_penalty
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.schema import Group, Trajectory
from hpcrl.samples.writer import shard_image
from hpcrl.samples.schema import arrays_from_layout, arrays_to_groups
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.dynamic_sampling import DynamicSampling, varies
from hpcrl.trainer.update import PolicyUpdate
from test_learning import BACKGROUND_RUNS as LEARNING_RUNS

DAPO_RECIPE = ["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
               "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
               "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
               "algorithm.filter_groups.max_num_gen_batches=10", "data.max_response_length=20"]
"""recipe/dapo's keys (run_dapo_qwen2.5_32b.sh, scaled down: 20 tokens, a buffer of 4)."""
FULLY_ASYNC = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "+reward_model.reward_kwargs.max_resp_len=20",
               "+algorithm.filter_groups.enable=True", "+algorithm.filter_groups.metric=acc",
               "data.max_response_length=20"]
"""verl's fully_async DAPO script's keys (dapo_7b_math_fsdp2_16_16_filter.sh, scaled down)."""

FILTER_GROUPS = ["rollout.total_rollout_steps=600", "algorithm.filter_groups.enable=true",
                 "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10"]
"""The tiny run (configs/tiny.yaml: s=0, K=1, R=4, n=8) for 150 updates with DAPO's dynamic sampling on acc (the toy
reward's number: all 8 responses of a group score alike early, when all miss, and late, when all are right)."""
BACKGROUND_RUNS = {"learning:tiny": LEARNING_RUNS["learning:tiny"], "dapo:filter_groups": FILTER_GROUPS}
"""The README's tiny run (tests/test_learning.py's, shared: the same config without dynamic sampling) and this one."""


def background_keys(item) -> tuple[str, ...]:
    """The background runs a test item reads (none: it runs its own jobs)."""
    return {"test_dynamic_sampling_trains_only_groups_that_vary_exactly_once_and_learns_no_slower":
            ("dapo:filter_groups", "learning:tiny")}.get(item.originalname, ())


@pytest.mark.parametrize("length, penalty", [(0, 0.0), (15, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75),
                                             (20, -1.0)])
def test_the_overlong_penalty_is_dapos_formula_at_the_buffers_edges_and_inside(length, penalty):
    """min(0, (max_resp_len - len - L) / len) * penalty_factor: 0 up to the buffer's start (20 - 4 = 16), then
    linear to -factor at the limit."""
    assert overlong_penalty(length, 20, 4, 1.0) == pytest.approx(penalty)
    assert overlong_penalty(length, 20, 4, 0.5) == pytest.approx(penalty / 2)
    assert overlong_penalty(length, 20, 4, 1.0) == pytest.approx(min(0.0, (20 - 4 - length) / 4) * 1.0)


def test_the_penalty_is_added_to_the_score_where_verls_dapo_manager_adds_it_and_logged_under_its_names():
    cfg = load_config(TINY, DAPO_RECIPE)
    shaping = RewardShaping(cfg)
    inside = shaping.shape(1.0, {}, 18)  # a number result: verl records it as acc, then adds the penalty
    assert (inside.reward, inside.metric) == (pytest.approx(0.5), 1.0), "acc is the score before the penalty"
    assert inside.logged == {"overlong_reward": pytest.approx(-0.5), "overlong": 1.0}
    short = shaping.shape(0.0, {}, 16)
    assert (short.reward, short.metric, short.logged) == (0.0, 0.0, {"overlong_reward": 0.0, "overlong": 0.0})
    # a dict result: its keys are the metrics, its score the reward's base
    assert shaping.shape(0.7, {"score": 0.7, "acc": True, "pred": "7"}, 20).metric == 1.0
    assert math.isnan(shaping.shape(0.7, {"score": 0.7}, 20).metric), "a dict without acc has no acc"
    quiet = RewardShaping(load_config(TINY, FULLY_ASYNC))  # overlong_buffer_cfg.log=False: nothing logged
    assert quiet.shape(1.0, {}, 20).logged == {} and quiet.shape(1.0, {}, 20).reward == 0.0
    off = RewardShaping(load_config(TINY, ["rollout.response_length=20"]))
    assert off.shape(1.0, {}, 20).reward == 1.0 and off.shape(1.0, {}, 20).metric is None
    on_reward = RewardShaping(load_config(TINY, [*DAPO_RECIPE, "algorithm.filter_groups.metric=seq_reward"]))
    assert on_reward.shape(1.0, {}, 18).metric is None, "seq_reward is the shard's reward: no value of its own"


def test_verls_dapo_keys_are_read_as_they_are():
    """recipe/dapo's and the fully_async scripts' keys give the same config; Hydra's + and verl's spellings too."""
    notes = []
    recipe = load_config(TINY, DAPO_RECIPE, notes=notes)
    ob, fg = recipe.reward.overlong_buffer, recipe.algorithm.filter_groups
    assert (ob.enable, ob.len, ob.penalty_factor, ob.max_resp_len) == (True, 4, 1.0, None)
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (True, "acc", 10)
    assert recipe.rollout.response_length == 20
    assert any(n.startswith("verl reward_model.overlong_buffer.enable") and "reward.overlong_buffer.*" in n
               for n in notes)
    fully_async = load_config(TINY, FULLY_ASYNC)
    assert fully_async.reward.overlong_buffer.max_resp_len == 20 and fully_async.reward.overlong_buffer.log is False
    assert fully_async.algorithm.filter_groups.max_num_gen_batches == 0, "verl's default: no limit"
    old = load_config(TINY, ["custom_reward_function.overlong_buffer.enable=true",
                             "custom_reward_function.overlong_buffer.len=4", "rollout.response_length=20"])
    assert old.reward.overlong_buffer.enable and old.reward.overlong_buffer.len == 4


@pytest.mark.parametrize("overrides, fragment", [
    (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.metric=acc"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9"], "at most rollout.response_length = 8"),
    (["reward.overlong_buffer.enable=true"], "config reward.overlong_buffer.len: got 0"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4", "reward.overlong_buffer.max_resp_len=3"],
     "at most reward.overlong_buffer.max_resp_len = 3"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], "filter on seq_reward"),
    (["reward_model.reward_manager=prime"], "naive or dapo"),
])
def test_what_dapo_cannot_mean_is_refused_before_submission(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert fragment in str(e.value), str(e.value)


def test_a_metric_no_reward_result_offers_is_refused_at_launch(tmp_path):
    """The launch probe calls the reward on a real row: filtering on a key its dict never has would keep every group
    (the metric missing everywhere), so it is refused before submission with the keys it does have."""
    from hpcrl.launcher.inputs import check_inputs

    reward = tmp_path / "judge.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 1.0, 'pred': 'x', 'correct': True}\n")
    dapo = ["algorithm.filter_groups.enable=true", f"reward.path={reward}"]
    for metric in ("correct", "score", "seq_reward"):
        check_inputs(load_config(TINY, [*dapo, f"algorithm.filter_groups.metric={metric}"]))
    with pytest.raises(ConfigError, match="allowed: a metric your reward's results offer: correct, score, "):
        check_inputs(load_config(TINY, [*dapo, "algorithm.filter_groups.metric=acc"]))
    with pytest.raises(ConfigError, match="overlong only with reward.overlong_buffer.enable and .log"):
        check_inputs(load_config(TINY, [*dapo, "algorithm.filter_groups.metric=overlong"]))
    check_inputs(load_config(TINY, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]))


def _traj(reward: float, length: int = 3, truncated=None, metric=None) -> Trajectory:
    return Trajectory(prompt_ids=[1, 2], response_ids=list(range(3, 3 + length)), response_mask=[1] * length,
                      logprobs=[-1.0] * length, token_versions=[0] * length, reward=reward, truncated=truncated,
                      filter_metric=metric)


def test_the_shards_carry_truncation_and_the_metric_only_when_the_run_needs_them():
    groups = [Group("w000", 0, [_traj(1.0, truncated=True, metric=1.0), _traj(0.0, truncated=False,
                                                                              metric=float("nan"))], 0.0, 1.0)]
    image, layout = shard_image(groups, "w000", 0)
    back = arrays_to_groups(arrays_from_layout(image, layout), "w000")
    assert [t.truncated for t in back[0].trajectories] == [True, False]
    assert back[0].trajectories[0].filter_metric == 1.0 and math.isnan(back[0].trajectories[1].filter_metric)
    image, layout = shard_image([Group("w000", 0, [_traj(1.0)], 0.0, 1.0)], "w000", 0)
    assert "traj/truncated" not in layout and "traj/filter_metric" not in layout


def test_overlong_filtering_masks_exactly_the_truncated_responses():
    """Their tokens leave the actor's loss mask and nothing else does; their rewards still make the group's baseline,
    so the advantages are those of the same batch without filtering."""
    flags = [[True, False, False, True], [False, False, False, False]]
    groups = [Group("w000", g, [_traj(float(j % 2), 3 + j, truncated=flags[g][j]) for j in range(4)], 0.0, 1.0)
              for g in range(2)]
    batches = {}
    for on in (True, False):
        cfg = load_config(TINY, [f"actor.overlong_filter={str(on).lower()}", "rollout.n=4"])
        batch = build_batch(groups, pad_id=0, trainer_version=0)
        stats = PolicyUpdate(cfg, engine=None, layout=None).prepare(batch)  # grpo, rollout log-probs: no model
        batches[on] = (batch, stats)
    (filtered, stats), (plain, _) = batches[True], batches[False]
    truncated = torch.tensor([f for row in flags for f in row])
    assert torch.equal(filtered.loss_mask[truncated], torch.zeros_like(filtered.loss_mask[truncated]))
    assert torch.equal(filtered.loss_mask[~truncated], plain.loss_mask[~truncated])
    assert plain.loss_mask[truncated].sum() > 0
    assert torch.equal(filtered.advantages, plain.advantages) and torch.equal(filtered.adv_mask, plain.adv_mask)
    assert stats["response_length/clip_ratio"] == pytest.approx(2 / 8)
    no_flags = build_batch([Group("w000", 0, [_traj(1.0), _traj(0.0)], 0.0, 1.0)], pad_id=0, trainer_version=0)
    with pytest.raises(ValueError, match="traj/truncated"):
        PolicyUpdate(load_config(TINY, ["actor.overlong_filter=true", "rollout.n=2"]), None, None).prepare(no_flags)


def test_a_group_is_dropped_exactly_when_its_metric_has_no_spread():
    """verl's rule: keep std > 0 or a group of one; values the result lacked (NaN) are left out."""
    assert not varies([1.0] * 8) and not varies([0.0] * 8) and not varies([0.1] * 16)
    assert varies([1.0] * 7 + [0.0]) and varies([1.0]) and varies([])
    assert not varies([1.0, 1.0, float("nan")]) and varies([1.0, float("nan")])
    cfg = load_config(TINY, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"])
    ds = DynamicSampling(cfg, RunDir("/nonexistent"))
    same_acc = Group("w000", 0, [_traj(1.0 - j * 0.1, metric=1.0) for j in range(3)], 0.0, 1.0)
    assert not ds.keeps(same_acc), "acc decides, not the shaped reward"
    seq = DynamicSampling(load_config(TINY, ["algorithm.filter_groups.enable=true",
                                             "algorithm.filter_groups.metric=seq_reward"]), RunDir("/nonexistent"))
    assert seq.keeps(same_acc) and DynamicSampling(load_config(TINY), RunDir("/nonexistent")).keeps(
        Group("w000", 0, [_traj(1.0)] * 3, 0.0, 1.0)), "off, every group is kept"


def test_max_num_gen_batches_stops_after_that_many_batches_of_R_without_R_that_vary():
    """verl raises once num_gen_batches >= max_num_gen_batches and the batch is not full; 0 or less: no limit."""
    cfg = load_config(TINY, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                             "algorithm.filter_groups.max_num_gen_batches=3"])  # R = 4
    ds = DynamicSampling(cfg, RunDir("/nonexistent"))
    assert [ds.gen_batches(n) for n in (1, 4, 5, 12)] == [1, 1, 2, 3]
    assert ds.exhausted(11, 0, 0) is None and ds.exhausted(12, 4, 0) is None
    line = ds.exhausted(12, 3, 6)
    assert line is not None and "\n" not in line
    assert "took 12 groups = 3 batches of R=4 for update 7 and only 3 of them varied in acc" in line
    assert "algorithm.filter_groups.max_num_gen_batches (3; 0: no limit)" in line
    unlimited = DynamicSampling(load_config(TINY, ["algorithm.filter_groups.enable=true",
                                                   "algorithm.filter_groups.metric=acc"]), RunDir("/nonexistent"))
    assert unlimited.exhausted(10**6, 0, 0) is None


def test_the_budget_gives_a_dropped_groups_place_back(tmp_path):
    """B = 4 starts per version; the trainer dropping 2 groups without spread lets the fleet start 2 more under the
    same version, and the next version's base (manifest consumed_groups) leaves them out."""
    rd = RunDir(tmp_path).create()
    adm = Admission(rd, "w000", budget=4)
    adm.join(0, set())
    starts = lambda base: sum(1 for _ in iter(lambda: adm.try_start(base), None))  # noqa: E731
    assert starts(0) == 4 and read_filtered_groups(rd) == 0
    ds = DynamicSampling(load_config(TINY, ["algorithm.filter_groups.enable=true",
                                            "algorithm.filter_groups.metric=acc"]), rd)
    ds.give_back(2)
    assert read_filtered_groups(rd) == 2
    assert starts(0) == 2, "the two dropped groups' places"
    # the trainer trains 4 (6 consumed, 2 of them dropped) and publishes with base 6 - 2 = 4: B more starts
    assert starts(4) == 4
    write_json_atomic(rd.filtered_groups, {"not": "a record"})
    assert read_filtered_groups(rd) == 0, "a damaged record gives less budget, never more"
    assert starts(4) == 0
    write_json_atomic(rd.filtered_groups, FilteredGroups(3, 0.0).to_json())
    assert starts(4) == 1


def _reward_reached(st, threshold: float, window: int = 10):
    """The first update at which the mean reward of every response consumed (kept and dropped) over the last
    ``window`` updates reaches ``threshold``; None if never."""
    per_step = st.groupby("trainer_step").reward.mean().rolling(window, min_periods=window).mean()
    hit = per_step[per_step >= threshold]
    return None if hit.empty else int(hit.index[0])


@pytest.mark.slow
def test_dynamic_sampling_trains_only_groups_that_vary_exactly_once_and_learns_no_slower(background_runs):
    """s=0 with groups dropped all along: no deadlock (each dropped group's place is given back), the exactly-once
    audit holds with the dropped groups consumed and not trained, every trained group's acc varies, and the reward
    of the responses generated climbs at least as fast per update as the same run's without dynamic sampling."""
    rd = background_runs.finish("dapo:filter_groups", trainer_s=900)
    m, st = read_metrics(rd), read_staleness(rd)
    cfg = rd.load_config()
    audit = check_exactly_once(rd, cfg.rollout.max_concurrent_groups)
    dropped = int(m["fully_async/count/dropped_filter_groups"].iloc[-1])
    assert dropped > 0 and audit["not_trained"] == {"filter_groups": dropped}
    assert audit["consumed_groups"] == cfg.total_updates * cfg.groups_per_update + dropped == m.consumed_groups.iloc[-1]
    assert read_filtered_groups(rd) == dropped, "the places given back are the groups dropped"
    trained = st[st.dropped == ""]
    assert (trained.groupby("group_id").reward.std(ddof=0) > 0).all(), "a trained group without spread"
    assert (st[st.dropped == "filter_groups"].groupby("group_id").reward.std(ddof=0) == 0).all()
    assert (trained.lag == 0).all(), "s=0: the budget still keeps the trained groups on-policy"
    assert (m["train/num_gen_batches"] >= 1).all() and m["train/num_gen_batches"].max() > 1
    tiny = background_runs.launched("learning:tiny", timeout_s=900)
    assert tiny.returncode == 0, tiny.stdout[-3000:]
    base = read_staleness(RunDir(tiny.args[tiny.args.index("--run-dir") + 1]))
    base = base[base.trainer_step <= cfg.total_updates]
    reached = {name: (_reward_reached(s_, 0.5), _reward_reached(s_, 0.8)) for name, s_ in (("filter", st), ("base", base))}
    last = {name: s_[s_.trainer_step > cfg.total_updates - 10].reward.mean() for name, s_ in (("filter", st),
                                                                                              ("base", base))}
    print(f"dynamic sampling: reward (10-update mean of every response consumed) >= 0.5 / 0.8 at update "
          f"{reached['filter']}, updates {cfg.total_updates - 9}-{cfg.total_updates} {last['filter']:.3f}, "
          f"{audit['consumed_groups']} groups for {cfg.total_updates * cfg.groups_per_update} trained; without: "
          f"{reached['base']}, {last['base']:.3f}, {cfg.total_updates * cfg.groups_per_update} groups")
    assert reached["filter"][1] is not None, f"the reward never reached 0.8: {reached}"
    assert last["filter"] >= last["base"] - 0.05, f"slower than without dynamic sampling: {last}"


@pytest.mark.slow
def test_a_run_whose_groups_never_vary_stops_after_max_num_gen_batches_with_one_line(tiny_run, tmp_path):
    """A reward that is always 1: every group is dropped; after max_num_gen_batches batches of R for the first
    update the trainer records the cause (one line) and both jobs end, instead of waiting for groups that never
    come."""
    always_one = tmp_path / "always_one.py"
    always_one.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          "    return 1.0\n")
    rd = tiny_run(f"reward.path={always_one}", "algorithm.filter_groups.enable=true",
                  "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=3")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    assert trainer.wait(180) == 0, trainer.tail()
    assert rollout.wait(60) == 0, rollout.tail()
    fatal = read_fatal_record(rd)
    assert fatal is not None and fatal.job == "trainer" and fatal.input == "data", fatal
    assert "took 12 groups = 3 batches of R=4 for update 1 and only 0 of them varied in acc" in fatal.message
    errors = [line for line in rd.job_log("trainer").read_text().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and fatal.message in errors[0], errors
    beats = read_heartbeats(rd)
    assert beats["trainer"].state == "stopped" and beats["rollout-w000"].state == "stopped"
    assert read_staleness(rd).empty and read_filtered_groups(rd) == 12, "no update ran; 12 places given back"
    # the line's own fix is allowed on --resume (a data failure); other algorithm keys still are not
    frozen = rd.load_config()
    raised = load_config(rd.config_path, ["algorithm.filter_groups.max_num_gen_batches=20"])
    assert [c.key for c in check_changes(frozen, raised, fatal)] == ["algorithm.filter_groups.max_num_gen_batches"]
    with pytest.raises(ConfigError, match="algorithm.filter_groups.max_num_gen_batches"):
        check_changes(frozen, raised, None)
