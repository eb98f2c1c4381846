"""Config: every shipped file parses; bad input fails with the key, the allowed values and a fix."""
import re
from pathlib import Path

import pytest

from hpcrl.cli import main as cli_main
from hpcrl.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def test_there_are_configs():
    assert CONFIGS, "configs/ must hold at least the tiny default"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_file_parses_and_validates(path):
    cfg = load_config(path)
    assert cfg.total_updates >= 1
    assert cfg.admission_budget >= cfg.groups_per_version


def test_precision_is_bf16_on_a_gpu_and_fp32_on_cpu_unless_set():
    cfg = load_config(TINY)
    assert (cfg.rollout.dtype, cfg.actor.bf16) == ("auto", "auto")
    assert cfg.rollout.dtype_on("cuda") == "bfloat16" and cfg.rollout.dtype_on("cpu") == "float32"
    assert cfg.actor.bf16_on(cuda=True) is True and cfg.actor.bf16_on(cuda=False) is False
    cfg = load_config(TINY, ["rollout.dtype=float32", "actor.bf16=false"])
    assert cfg.rollout.dtype_on("cuda") == "float32" and cfg.actor.bf16_on(cuda=True) is False
    cfg = load_config(TINY, ["rollout.dtype=bfloat16", "actor.bf16=true"])
    assert cfg.rollout.dtype_on("cpu") == "bfloat16" and cfg.actor.bf16_on(cuda=False) is True
    with pytest.raises(ConfigError, match="actor.bf16"):
        load_config(TINY, ["actor.bf16=sometimes"])


def test_overrides_apply_with_types():
    cfg = load_config(TINY, ["async_training.staleness_threshold=0.5", "rollout.n=4",
                                   "async_training.max_staleness=null"])
    assert cfg.async_training.staleness_threshold == 0.5 and cfg.rollout.n == 4
    assert cfg.async_training.max_staleness is None


def test_exponent_floats_without_a_dot_are_floats(tmp_path):
    """YAML 1.1 reads 1e-6 as a string; verl configs write lr: 1e-6."""
    path = tmp_path / "c.yaml"
    path.write_text(TINY.read_text().replace("lr: 0.001", "lr: 1e-6"))
    cfg = load_config(path, ["async_training.staleness_threshold=5E-1", "critic.lr=2e-5"])
    assert cfg.actor.lr == 1e-6 and cfg.async_training.staleness_threshold == 0.5 and cfg.critic.lr == 2e-5
    with pytest.raises(ConfigError, match="actor.lr"):
        load_config(TINY, ["actor.lr=1e-x"])


@pytest.mark.parametrize("override, fragment", [
    (["async_training.staleness_treshold=0.5"], "async_training.staleness_treshold"),  # typo: unknown key
    (["async_training.staleness_threshold=-1"], "a number >= 0"),
    (["rollout.n=zero"], "rollout.n"),
    (["actor.zero_stage=4"], "[0, 3]"),
    (["actor.ppo_micro_batch_size=3"], "a multiple of data-parallel trainer ranks"),
    (["rollout.total_rollout_steps=2"], "at least R"),
    (["rollout.temperature=0.7"], "equal to rollout.temperature"),
    (["data.source=/data/prompts.csv"], "a .jsonl/.parquet file"),
    (["data.truncation=middle"], "'filter'"),
    (["data.max_prompt_length=0"], "data.max_prompt_length"),
    (["reward.path=/my/reward.txt"], "a .py file"),
    (["reward.name=gsm9k"], "'math_verify'"),
    (["logging.backends=[tensorboard, mlflow]"], "'wandb'"),
    (["logging.wandb_mode=cloud"], "'offline'"),
    (["async_training.partial_rollout=true"], "staleness_threshold is 0"),
    (["nosuchsection.x=1"], "allowed: the sections model, data"),
    (["algorithm.adv_estimator=ppo"], "'reinforce_plus_plus'"),
    (["algorithm.adv_estimator=rloo", "rollout.n=1"], "at least 2 with adv_estimator=rloo"),
    (["algorithm.gamma=1.5"], "algorithm.gamma"),
    (["algorithm.kl_penalty=k4"], "'low_var_kl'"),
    (["algorithm.kl_ctrl.type=pid"], "'adaptive'"),
    (["algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon"),
    (["algorithm.rollout_correction.rollout_is=token"], "async_training.compute_prox_log_prob=true"),
    (["algorithm.rollout_correction.rollout_rs=seq"], "seq_mean_k1"),
    (["async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_rs=geometric",
      "algorithm.rollout_correction.rollout_rs_threshold=2.0"], "use 'seq_mean_k1'"),
    (["async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_rs=token_k1"],
     "rollout_rs_threshold"),
    (["async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_rs=token_k3",
      "algorithm.rollout_correction.rollout_rs_threshold='0.5_2'"], "only *_k1"),
    (["async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k2",
      "algorithm.rollout_correction.rollout_rs_threshold='0.5_2,0.1,3'"], "2 rollout_rs options but 3"),
    (["async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_rs=seq_sum_k1",
      "algorithm.rollout_correction.rollout_rs_threshold='2_0.5'"], "0 < lower <= upper"),
    (["algorithm.rollout_correction.rollout_rs_threshold_lower=0.5"], "lower_upper"),
    (["actor.policy_loss.loss_mode=ppo"], "'geo_mean'"),
    (["actor.policy_loss.clip_cov_ub=0.5"], "clip_cov_lb"),
    (["actor.loss_scale_factor=0"], "actor.loss_scale_factor"),
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "at least 2 with adv_estimator=grpo_passk"),
    (["algorithm.rollout_correction.rollout_is_threshold=0.5"], "a number >= 1.0"),
    (["algorithm.rollout_correction.max_token_lag=-1"], "max_token_lag"),
    (["actor.loss_agg_mode=token-max"], "'seq-mean-token-sum-norm'"),
    (["actor.clip_ratio_c=0.5"], "a number > 1 or null"),
    (["actor.kl_loss_type=full"], "actor.kl_loss_type"),
    (["critic.vf_coef=0"], "critic.vf_coef"),
    # verl 0.9.1's later options: one line each for what they cannot be combined with
    (["algorithm.rollout_correction.rollout_is_threshold=abc"], "neither a number nor"),
    (["algorithm.rollout_correction.rollout_is_threshold='2.0_0.5'"], "0 < lower <= upper"),
    (["algorithm.rollout_correction.bypass_mode=true", "async_training.compute_prox_log_prob=true"],
     "false while the trainer computes proximal log-probs"),
    (["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss.loss_mode=gspo"],
     "vanilla with bypass_mode=true"),
    (["algorithm.rollout_correction.loss_type=reinforce"], "ppo_clip unless bypass_mode=true"),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=pg"], "'reinforce'"),
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_token_veto_threshold=0.1"],
     "has no veto"),
    (["actor.policy_loss.loss_mode=dro"], "a number > 0 with loss_mode=dro"),
    (["actor.policy_loss.loss_mode=dppo_tv", "actor.clip_ratio_c=null"], "a number > 1 with loss_mode=dppo_tv"),
    (["actor.tau_neg=0"], "actor.tau_neg"),
    (["algorithm.adv_estimator=optimal_token_baseline", "rollout.n=1"], "at least 2 with adv_estimator=optimal"),
    (["algorithm.use_pf_ppo=true"], "verl resamples only with an estimator on a critic"),
    (["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=top"],
     "'max_random'"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format, accuracy]"], "one reward per trajectory"),
    (["algorithm.gdpo_reward_weights=[1.0]"], "null while gdpo_reward_keys is null"),
    (["actor.kl_loss_type=k4+"], "'k3+'"),
    (["actor.policy_loss.loss_mode=bypass_mode"], "set algorithm.rollout_correction.bypass_mode=true"),
    (["rollout"], "key=value"),
])
def test_bad_values_are_refused_with_a_clear_message(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, override)
    assert fragment in str(e.value)
    assert all(line.startswith(("config ", "override ")) for line in str(e.value).splitlines()), str(e.value)


def test_every_bad_value_is_reported_in_one_pass_with_what_is_allowed_and_the_fix():
    """The README's "all of them at once": values out of range in three sections, an unknown key, a wrong type and a
    rule between sections, one line each. A rule that reads a value already reported (actor.temperature against
    rollout.temperature, the mini-batch against its micro-batches) says nothing more, and does not crash on it."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["rollout.n=0", "actor.ppo_mini_batch_size=0", "rollout.temperature=-3", "rollout.nn=3",
                           "actor.ppo_micro_batch_size=0", "trainer.keep_checkpoints=abc", "algorithm.use_pf_ppo=true",
                           "actor.temperature=0.5"])
    lines = str(e.value).splitlines()
    keys = [re.match(r"config ([\w.]+): got ", line).group(1) for line in lines]
    assert sorted(keys) == sorted(["rollout.n", "actor.ppo_mini_batch_size", "rollout.temperature", "rollout.nn",
                                   "actor.ppo_micro_batch_size", "trainer.keep_checkpoints", "algorithm.use_pf_ppo"]), lines
    assert all("; allowed: " in line and "; fix: " in line for line in lines), lines
    assert "config rollout.n: got 0; allowed: an integer >= 1; fix: e.g. rollout.n=8 (the default)" in lines
    assert "fix: did you mean rollout.n?" in lines[keys.index("rollout.nn")]
    with pytest.raises(ConfigError) as e:  # a malformed override too
        load_config(TINY, ["rollout", "actor.lr=-1"])
    assert [line.split(":")[0] for line in str(e.value).splitlines()] == ["override 'rollout'", "config actor.lr"]
    # a section checked on its own still stops at its first problem
    from hpcrl.config import RolloutConfig

    with pytest.raises(ConfigError) as e:
        RolloutConfig(n=0, temperature=-3.0).validate()
    assert str(e.value) == "config rollout.n: got 0; allowed: an integer >= 1"


def test_the_config_and_the_inputs_are_checked_in_one_pass(tmp_path, capsys):
    rc = cli_main(["run", str(TINY), "rollout.n=0", "actor.ppo_mini_batch_size=0", "rollout.temperature=-3",
                   "model.path=/nowhere/model", "--run-dir", str(tmp_path / "r"), "--executor", "local", "--dry-run"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 5, err
    assert [line.split(":")[2].split()[-1] for line in err[:4]] == ["actor.ppo_mini_batch_size", "rollout.n",
                                                                    "rollout.temperature", "model.path"], err
    assert err[4] == "hpcrl: 4 problems, found in one pass; nothing was created or submitted"
    assert not (tmp_path / "r").exists()


def test_algorithm_options_parse_with_verl_names():
    cfg = load_config(TINY, ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.use_kl_in_reward=true",
                                   "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05",
                                   "async_training.compute_prox_log_prob=true",
                                   "algorithm.rollout_correction.rollout_is=sequence",
                                   "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                                   "algorithm.rollout_correction.rollout_rs_threshold=1.01",
                                   "actor.clip_ratio_c=null", "actor.use_kl_loss=true", "actor.kl_loss_type=k3"])
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.algorithm.rollout_correction.rollout_is == "sequence"
    assert cfg.actor.clip_ratio_c is None and cfg.needs_reference and cfg.uses_prox_log_prob
    # use_rollout_log_probs=false also gives proximal log-probs (the trainer recomputes the anchor)
    assert load_config(TINY, ["async_training.use_rollout_log_probs=false",
                                    "algorithm.rollout_correction.rollout_is=token"]).uses_prox_log_prob


def test_verl_0_9_1_later_options_parse():
    rc = "algorithm.rollout_correction."
    cfg = load_config(TINY, [rc + "bypass_mode=true", rc + "loss_type=reinforce", rc + "rollout_is=sequence",
                             rc + "rollout_is_threshold='0.5_5.0'", rc + "rollout_rs=seq_mean_k1",
                             rc + "rollout_rs_threshold='0.9_1.1'", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+",
                             "algorithm.kl_penalty=low_var_kl+", "algorithm.adv_estimator=tir_optimal_token_baseline"])
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_5.0" and not cfg.uses_prox_log_prob
    assert load_config(TINY, [rc + "rollout_is_threshold=3"]).algorithm.rollout_correction.rollout_is_threshold == 3.0
    cfg = load_config(TINY, ["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1",
                             "algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true",
                             "algorithm.pf_ppo.reweight_method=max_min"])
    assert cfg.algorithm.pf_ppo.reweight_method == "max_min" and cfg.actor.policy_loss.dro_beta == 0.1
    for mode in ("dppo_tv", "dppo_kl", "sapo"):
        assert load_config(TINY, [f"actor.policy_loss.loss_mode={mode}"]).actor.policy_loss.loss_mode == mode


def test_derived_budget_matches_design():
    cfg = load_config(TINY, ["actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=2",
                                   "async_training.require_batches=2", "async_training.trigger_parameter_sync_step=3",
                                   "async_training.staleness_threshold=0.5"])
    assert cfg.groups_per_update == 8 and cfg.groups_per_version == 24
    assert cfg.admission_budget == 36  # floor(1.5 * 3 * 8)
    assert cfg.max_lag_bound == 1      # floor((36 - 1) / 24)


def test_cli_bad_config_fails_before_submitting(tmp_path, capsys):
    rc = cli_main(["run", str(TINY), "rollout.n=1", "--run-dir", str(tmp_path / "r"), "--executor", "local"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "rollout.n" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists(), "nothing may be created or submitted for a bad config"


def test_cli_dry_run_prints_jobs_and_submits_nothing(tmp_path, capsys):
    rc = cli_main(["run", str(TINY), "--run-dir", str(tmp_path / "r"), "--executor", "local", "--dry-run"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "would submit trainer" in out and "would submit rollout-w000" in out
    assert not (tmp_path / "r").exists()


def test_cli_accepts_overrides_after_the_options(tmp_path, capsys):
    rc = cli_main(["run", str(TINY), "--run-dir", str(tmp_path / "r"), "--dry-run", "rollout.n=4"])
    assert rc == 0 and "n: 4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["run", str(TINY), "--run-dir", str(tmp_path / "r"), "--dry-run", "--bogus"])


def test_unknown_key_suggests_the_nearest_known_one():
    with pytest.raises(ConfigError, match=r"did you mean async_training\.staleness_threshold\?"):
        load_config(TINY, ["async_training.staleness_treshold=0.5"])
    with pytest.raises(ConfigError, match=r"did you mean rollout\.n\?"):
        load_config(TINY, ["rollot.n=4"])


def test_paths_are_checked_at_launch_not_at_parse(tmp_path, capsys):
    """A shipped config may hold a placeholder model path: it parses; launching it (even a dry
    run) says what is missing in one line and creates nothing."""
    cfg = load_config(TINY, ["model.path=/path/to/your/model", "data.source=/nowhere/train.parquet"])
    assert cfg.model.path == "/path/to/your/model"
    for override, fragment in (("model.path=/path/to/your/model", "existing local HF model folder"),
                               ("data.source=/nowhere/train.parquet", "does not exist")):
        rc = cli_main(["run", str(TINY), override, "--run-dir", str(tmp_path / "r"), "--dry-run"])
        err = capsys.readouterr().err
        assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_a_yaml_syntax_error_is_one_problem_placed_in_the_file(tmp_path, capsys):
    """It was counted as 4 problems (PyYAML's message lines), located in "<unicode string>"."""
    from hpcrl.cli import main as cli_main

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  path: builtin:tiny\nrollout:\n  n: 8\n   temperature: 1.0\n")
    assert cli_main(["run", str(bad_yaml), "--run-dir", str(tmp_path / "run"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"hpcrl: error: config file {bad_yaml} is not valid YAML: line 5, column 15: mapping "
                                "values are not allowed here; fix: check the indentation and the ': ' after each key "
                                "there (a value with ': ' or '#' in it needs quotes)"], err


def test_a_value_of_neither_allowed_type_names_both():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["data.val_files=null"])
    assert "config data.val_files: got None; allowed: a list or a value of type str" in str(e.value), str(e.value)
