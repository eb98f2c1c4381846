"""Fix a run and resume it: ``hpcrl run --resume --run-dir RUN key=value`` applies what is safe on a live
run (recorded in the frozen config's history) and refuses the rest with the reason; the reward or the data
may change when the run stopped because that input failed; a finished run says so; ``--dry-run`` and the
real resume go through the same check; every input problem shows in one pass."""
import time

import pytest
import yaml

from conftest import TINY, make_run
from hpcrl.cli import main as cli_main
from hpcrl.config import ConfigError
from hpcrl.control.fatal import write_fatal
from hpcrl.control.records import TrainerDone
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.launcher.api import plan_run
from hpcrl.launcher.prepare import prepare_run_dir


def resume(rd, *overrides, config=None):
    """What `hpcrl run --resume` does before it submits: plan (the checks), then re-open the run directory."""
    plan = plan_run(config, rd.root, "local", list(overrides), resume=True)
    prepare_run_dir(plan.cfg, rd.root, True, inputs_checked=True, changes=tuple(plan.changes))
    return plan


def test_safe_changes_apply_and_are_recorded_in_the_frozen_configs_history(tmp_path):
    rd = make_run(tmp_path)
    plan = resume(rd, "timeouts.wait_samples_s=900", "resources.trainer.mem_gb=8", "rollout.total_rollout_steps=2000")
    assert plan.changes == [
        "rollout.total_rollout_steps: 1200 -> 2000", "timeouts.wait_samples_s: 120.0 -> 900.0",
        "resources.trainer.mem_gb: 4 -> 8"]
    frozen = rd.load_config()
    assert frozen.timeouts.wait_samples_s == 900 and frozen.rollout.total_rollout_steps == 2000
    resume(rd, "logging.level=DEBUG")
    history = rd.config_history()
    assert len(history) == 4 and history[-1].endswith("--resume logging.level: 'INFO' -> 'DEBUG'"), history
    assert rd.config_path.read_text().startswith("# changed since launch")
    assert yaml.safe_load(rd.config_path.read_text())["logging"]["level"] == "DEBUG"


def test_a_changed_model_path_is_refused_with_the_reason(tmp_path, capsys):
    rd = make_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        plan_run(None, rd.root, "local", ["model.path=builtin:tiny-h64", "actor.lr=0.5"], resume=True)
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert "config model.path: got 'builtin:tiny-h64' on --resume, frozen 'builtin:tiny'" in lines[0]
    assert "checkpoints and weight versions belong to the model it started from" in lines[0]
    assert "actor.lr" in lines[1] and "hpcrl export" in lines[1]
    # the dry run says the same, and creates or changes nothing
    before = rd.config_path.read_bytes()
    assert cli_main(["run", "--resume", "--run-dir", str(rd.root), "model.path=builtin:tiny-h64", "--dry-run"]) == 2
    assert "belong to the model it started from" in capsys.readouterr().err
    assert rd.config_path.read_bytes() == before


def test_the_reward_may_change_once_the_run_stopped_on_it(tmp_path):
    rd = make_run(tmp_path)
    good = tmp_path / "r.py"
    good.write_text("def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="scored by the old reward"):
        plan_run(None, rd.root, "local", [f"reward.path={good}"], resume=True)
    write_fatal(rd, "rollout-w000", "loading the reward failed: ModuleNotFoundError: no module x", "reward")
    plan = resume(rd, f"reward.path={good}")
    assert plan.changes and "(after: reward failed)" in plan.changes[0]
    assert rd.load_config().reward.path == str(good) and not rd.fatal.exists()
    with pytest.raises(ConfigError, match="prompt order"):  # the data did not fail
        plan_run(None, rd.root, "local", ["data.toy_num_prompts=64"], resume=True)


def test_the_changed_config_file_is_accepted_when_only_safe_keys_differ(tmp_path, capsys):
    rd = make_run(tmp_path)
    changed = tmp_path / "tiny2.yaml"
    changed.write_text(TINY.read_text().replace("timeout_min: 30}", "timeout_min: 45}"))
    rc = cli_main(["run", str(changed), "timeouts.wait_samples_s=120", "timeouts.wait_weights_s=120", "--resume",
                   "--run-dir", str(rd.root), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "# --resume changes" in out and "resources.trainer.timeout_min: 30 -> 45" in out, out


def test_resume_of_a_finished_run_says_so_and_exits_0(tmp_path, capsys):
    rd = make_run(tmp_path)
    cfg = rd.load_config()
    write_json_atomic(rd.trainer_done, TrainerDone(cfg.total_updates, cfg.total_updates, 1200, time.time()).to_json())
    assert cli_main(["run", "--resume", "--run-dir", str(rd.root)]) == 0
    out = capsys.readouterr().out
    assert f"finished: {cfg.total_updates} updates" in out and "nothing to resume" in out, out
    # asking for more updates is not "finished": the trainer goes on from its last checkpoint
    plan = resume(rd, "rollout.total_rollout_steps=1600")
    assert plan.finished is None and not rd.trainer_done.exists()


def test_every_input_problem_is_reported_in_one_pass(tmp_path, capsys):
    (tmp_path / "r.py").write_text("import no_such_module_here\n")
    rc = cli_main(["run", str(TINY), "model.path=/nowhere/model", "data.source=/nowhere/train.parquet",
                   f"reward.path={tmp_path / 'r.py'}", "resources.trainer.gpus_per_node=2", "--executor", "local",
                   "--run-dir", str(tmp_path / "run"), "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 5, err
    assert "resources.trainer.gpus_per_node" in err[0] and "--executor local" in err[0]
    assert "model.path" in err[1] and "data.source" in err[2] and "no_such_module_here" in err[3]
    assert err[4] == "hpcrl: 4 problems, found in one pass; nothing was created or submitted"
    assert not (tmp_path / "run").exists()


def test_data_epochs_derive_the_total_and_say_so(tmp_path, capsys):
    assert cli_main(["run", str(TINY), "trainer.total_epochs=2", "data.toy_num_prompts=100", "--run-dir",
                     str(tmp_path / "run"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "data.epochs=2 x 100 prompts = 200 groups, rollout.total_rollout_steps: 200 groups = 50 updates" in out
    assert "total_rollout_steps: 200" in out.split("# resolved config:")[1]
    # given as well, total_rollout_steps caps it (verl takes the same minimum)
    assert cli_main(["run", str(TINY), "trainer.total_epochs=2", "data.toy_num_prompts=100",
                     "rollout.total_rollout_steps=120", "--run-dir", str(tmp_path / "run"), "--dry-run"]) == 0
    assert "capped by rollout.total_rollout_steps=120" in capsys.readouterr().out
