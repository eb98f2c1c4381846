"""A verl user's first week: their data and reward files work unchanged, broken inputs fail
before anything is submitted (in one line), and the metrics reach TensorBoard and W&B."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, TINY, BackgroundCommand, python
from hpcrl.cli import main as cli_main
from hpcrl.config import DataConfig, load_config
from hpcrl.rollout.data import PromptEncoder
from hpcrl.rollout.dataset import load_rows
from hpcrl.rollout.reward_fn import RewardScorer, load_reward
from hpcrl.rundir.paths import RunDir
from hpcrl.tiny.model import build_tiny_model, load_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}:{% endif %}")
"""A chat template in the tiny vocabulary: "repeat c" + generation prompt -> "repeat c :"."""

USER_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature; a dict: 'score' is the reward, the rest become metrics."""
    assert data_source == "toy/copy" and extra_info["split"] == "train"
    want, got = ground_truth.split(), solution_str.split()
    hits = sum(1 for i, w in enumerate(want) if i < len(got) and got[i] == w)
    if "!" in got[:1]:
        raise RuntimeError("a bug in the user's reward")
    return {"score": hits / len(want), "exact": float(hits == len(want))}
'''


def hpcrl(*args, timeout=120):
    return subprocess.run([python(), "-m", "hpcrl", *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def chat_model(tmp_path):
    """The tiny model with a chat template saved in its tokenizer."""
    folder = build_tiny_model(tmp_path / "chat_model")
    tok = load_tokenizer(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def verl_parquet(path, n=64, seed=0):
    """Toy prompts in verl's layout: chat-message prompt, data_source, reward_model, extra_info."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        c = "abcdefgh"[rng.integers(8)]
        rows.append({"data_source": "toy/copy", "prompt": [{"role": "user", "content": f"repeat {c}"}],
                     "ability": "copy", "reward_model": {"style": "rule", "ground_truth": " ".join([c] * 8)},
                     "extra_info": {"split": "train", "index": i}})
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_verl_rows_chat_template_and_prompt_length_policy(tmp_path):
    folder = chat_model(tmp_path)
    tok = load_tokenizer(folder)
    src = verl_parquet(tmp_path / "train.parquet", n=4)
    rows = load_rows(DataConfig(source=str(src)), answer_len=8)
    assert rows[0]["data_source"] == "toy/copy" and rows[0]["extra_info"] == {"split": "train", "index": 0}
    assert len(rows[0]["answer"].split()) == 8
    kept, counts = PromptEncoder(tok, DataConfig(source=str(src))).prepare(rows)
    assert tok.decode(kept[0]["prompt_ids"]).endswith(":"), "generation prompt of the template added"
    long = [dict(rows[0], prompt="repeat a b c d e f")] + rows[1:]
    for policy, n_kept, ids in (("filter", 3, None), ("left", 4, ["f", ":"]), ("right", 4, ["repeat", "a"])):
        kept, counts = PromptEncoder(tok, DataConfig(source=str(src), max_prompt_length=3, truncation=policy)).prepare(long)
        assert counts.kept == n_kept and counts.filtered + counts.truncated == 1, policy
        if ids:
            assert tok.convert_ids_to_tokens(kept[0]["prompt_ids"])[-2:] == ids or \
                tok.convert_ids_to_tokens(kept[0]["prompt_ids"])[:2] == ids
    with pytest.raises(ValueError, match="max_prompt_length=3"):
        PromptEncoder(tok, DataConfig(source=str(src), max_prompt_length=3, truncation="error")).prepare(long)
    # a plain-string prompt column (JSONL) with the answer in a flat column
    (tmp_path / "p.jsonl").write_text(json.dumps({"question": "repeat b", "answer": "b"}) + "\n")
    flat = load_rows(DataConfig(source=str(tmp_path / "p.jsonl"), prompt_key="question", answer_key="answer"), 8)
    assert flat == [{"prompt": "repeat b", "answer": "b", "data_source": "", "extra_info": None, "agent_name": None}]


def test_user_reward_errors_score_zero_and_are_counted(tmp_path):
    (tmp_path / "r.py").write_text(USER_REWARD)
    cfg = load_config(TINY, [f"reward.path={tmp_path / 'r.py'}"])
    scorer = RewardScorer(load_reward(cfg.reward))
    row = {"data_source": "toy/copy", "answer": "c c", "extra_info": {"split": "train"}}
    assert scorer.score("w000/0/0", row, "c c") == 1.0
    assert scorer.score("w000/0/1", row, "! c") == 0.0  # raised: counted, not fatal
    assert scorer.pop_metrics() == {"reward/errors": 1, "reward_extra/exact": 1.0,
                                    "reward/first_error": "w000/0/1: RuntimeError: a bug in the user's reward"}


@pytest.mark.parametrize("name, response, truth, want", [
    ("gsm8k", "3 + 4 = 7 so\n#### 7", "7", 1.0), ("gsm8k", "#### 1,200", "1200", 1.0),
    ("gsm8k", "the answer is 7", "7", 0.0), ("gsm8k", "#### 8", "Natalia ... #### 7", 0.0),
    ("math_verify", "so the answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
    ("math_verify", "so the answer is $\\frac{1}{3}$", "0.5", 0.0)])
def test_builtin_math_rewards(name, response, truth, want):
    from hpcrl.rollout.rewards import builtin_rule

    assert builtin_rule(name)(response, truth) == want


VERL_YAML = """
# a verl fully_async user's file: verl's keys (hpcrl/config/names.py: VERL_KEYS), hpcrl's tiny-run sizes
hydra: {searchpath: [pkg://verl.trainer.config]}
defaults: [ppo_trainer, _self_]
data: {train_files: [TRAIN], max_prompt_length: 16, max_response_length: 8, train_batch_size: 0, gen_batch_size: 1,
       filter_overlong_prompts: true}
actor_rollout_ref:
  hybrid_engine: false
  model: {path: MODEL, use_remove_padding: true}
  actor: {strategy: fsdp2, ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 32, optim: {lr: 0.001},
          fsdp_config: {param_offload: false}}
  rollout: {name: hf, n: 8, calculate_log_probs: true, temperature: 1.0}
custom_reward_function: {path: REWARD, name: compute_score}
rollout: {nnodes: 1, n_gpus_per_node: 0, total_rollout_steps: 720}
trainer: {nnodes: 1, n_gpus_per_node: 0, save_freq: 20, logger: [console, tensorboard, wandb], project_name: hpcrl}
async_training: {staleness_threshold: 0.0, trigger_parameter_sync_step: 1, require_batches: 1, partial_rollout: false}
resources:
  trainer: {cpus_per_task: 1, mem_gb: 4, timeout_min: 30}
  rollout: {cpus_per_task: 1, mem_gb: 4, timeout_min: 30}
"""


def verl_user_run(folder):
    """A verl user's files in ``folder`` and ``hpcrl run`` on them (its arguments)."""
    model = chat_model(folder)
    src = verl_parquet(folder / "train.parquet")
    (folder / "reward.py").write_text(USER_REWARD)
    (folder / "verl.yaml").write_text(VERL_YAML.replace("TRAIN", str(src)).replace("MODEL", str(model))
                                      .replace("REWARD", str(folder / "reward.py")))
    # --timeout-min: the jobs' own limit; a background run may wait minutes for a core
    return ["run", str(folder / "verl.yaml"), "--run-dir", str(folder / "run"), "--executor", "local",
            "--timeout-min", "30"]


BACKGROUND_RUNS = {"users:verl": BackgroundCommand.hpcrl_args(verl_user_run)}
"""The verl user's run, launched in the background when the session starts (conftest.BackgroundRuns): what it
asserts does not depend on how fast it went."""


def background_keys(item) -> tuple[str, ...]:
    """The background runs a test item reads (none: it runs its own jobs)."""
    return ("users:verl",) if item.originalname == "test_verl_format_run_learns_through_the_launcher" else ()


@pytest.mark.slow
def test_verl_format_run_learns_through_the_launcher(background_runs):
    """verl parquet + chat template + the user's reward file + a config in verl's keys, launched like a user would."""
    out = background_runs.launched("users:verl", timeout_s=400)
    run = Path(out.args[out.args.index("--run-dir") + 1])
    assert out.returncode == 0, out.stdout[-6000:]
    assert "chat template on" in out.stdout and "compute_score(data_source, solution_str" in out.stdout
    assert "verl actor_rollout_ref.rollout.n -> rollout.n" in out.stdout
    assert "actor.ppo_micro_batch_size=4 groups of rollout.n=8 per rank" in out.stdout
    assert f"next: hpcrl report {run}" in out.stdout and "eta " in out.stdout
    from hpcrl.logs.run_logs import read_metrics
    from hpcrl.logs.metric_names import COUNTERS

    m = read_metrics(RunDir(run))
    assert m[list(COUNTERS)].notna().all().all(), "every counter (corrupt_groups_skipped too) in every row"
    assert (m["fully_async/count/corrupt_groups_skipped"] == 0).all()
    r = m["reward/mean"].to_numpy()
    k = len(r) // 5
    first, last = float(r[:k].mean()), float(r[-k:].mean())
    print(f"verl-format run: reward first fifth {first:.3f}, last fifth {last:.3f} ({len(r)} updates)")
    assert last > first + 0.25, f"reward did not rise: {first:.3f} -> {last:.3f}"
    rows = [json.loads(x) for x in (run / "logs" / "rollout-w000.jsonl").read_text().splitlines()]
    assert all("reward/errors" in x for x in rows)
    # the reward's extras are averages over what was scored: a version row with no trajectory has none (the rollout
    # job can load the last version and write its row before it sees the trainer's end)
    assert all("reward_extra/exact" in x for x in rows if x["trajectories"] > 0)
    assert sum(x["trajectories"] > 0 for x in rows) >= len(rows) - 1
    # the same metric names, read back by TensorBoard's and W&B's own libraries
    tb = tensorboard_scalars(RunDir(run).tensorboard, "reward/mean")
    assert [s for s, _ in tb] == list(m["step"]) and np.allclose([v for _, v in tb], m["reward/mean"])
    wb = wandb_history(run / "logs" / "wandb", "reward/mean")
    assert len(wb) == len(m) and np.allclose(wb, m["reward/mean"])
    # the report, with no --out: into RUN/report, training curves included
    rep = hpcrl("report", run, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert (run / "report" / "run" / "training.png").stat().st_size > 10_000


def tensorboard_scalars(folder, tag):
    """(step, value) of one scalar, read by TensorBoard's event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wandb_history(folder, key):
    """The values of ``key`` in an offline W&B run: the ``.wandb`` file is a LevelDB-style log of
    W&B's protobuf Records; wandb 0.31 ships no Python reader for it (its Go core reads it), so the
    32 kB block framing is undone here and each record parsed with wandb's own protobuf classes."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    path = next(folder.glob("offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    pos, block, record, out = 7, 32768, b"", []  # 7-byte W&B header
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            r = pb.Record()
            r.ParseFromString(record)
            if r.WhichOneof("record_type") == "history":
                out += [json.loads(i.value_json) for i in r.history.item if (i.key or "/".join(i.nested_key)) == key]
            record = b""
        elif kind == 0:
            break
    return out


BROKEN_REWARD = "import no_such_module_here\n\ndef compute_score(*a):\n    return 0.0\n"


@pytest.mark.parametrize("case", ["reward_import", "reward_function_name", "reward_raises", "no_tokenizer",
                                  "no_weights", "no_config"])
def test_broken_inputs_fail_before_anything_is_submitted(tmp_path, case, capsys):
    folder = build_tiny_model(tmp_path / "m")
    overrides = []
    if case.startswith("reward"):
        body = {"reward_import": BROKEN_REWARD, "reward_function_name": "def score(*a):\n    return 0.0\n",
                "reward_raises": "def compute_score(*a, **k):\n    return 1 / 0\n"}[case]
        (tmp_path / "r.py").write_text(body)
        overrides = [f"reward.path={tmp_path / 'r.py'}"]
    else:
        pattern = {"no_tokenizer": "tokenizer*", "no_weights": "*.safetensors", "no_config": "config.json"}[case]
        for p in folder.glob(pattern):
            p.unlink()
        overrides = [f"model.path={folder}"]
    capsys.readouterr()  # the model build's progress bar
    for dry in ([], ["--dry-run"]):
        rc = cli_main(["run", str(TINY), *overrides, "--run-dir", str(tmp_path / "run"), "--executor", "local", *dry])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert {"reward_import": "no_such_module_here", "reward_function_name": "no function 'compute_score'",
                "reward_raises": "ZeroDivisionError", "no_tokenizer": "tokenizer", "no_weights": "weights",
                "no_config": "config.json"}[case] in err
        assert not (tmp_path / "run").exists(), "nothing may be created"


def test_cli_rough_edges(tmp_path, capsys, monkeypatch):
    """Each answers in one line on stderr with exit 2, and creates nothing."""
    run = str(tmp_path / "run")
    cases = [
        (["run", "--run-dir", run, "--executor", "local"], "no CONFIG given"),
        (["trainer", str(tmp_path)], "is not an hpcrl run directory"),
        (["rollout", str(tmp_path)], "is not an hpcrl run directory"),
        (["report", str(tmp_path)], str(tmp_path)),  # no --out needed: the run is what is wrong
    ]
    for argv, fragment in cases:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err and "required" not in err, (argv, err)
        assert not (tmp_path / "run").exists()
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands
    assert cli_main(["run", str(TINY), "--run-dir", run, "--executor", "slurm"]) == 2
    err = capsys.readouterr().err
    assert "sbatch" in err and "--executor local" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists(), "nothing may be created when submission is impossible"
    monkeypatch.undo()
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hpcrl ")


def test_dry_run_on_an_existing_run_reports_the_conflict_and_which_keys_differ(tmp_path, capsys):
    from conftest import make_run

    rd = make_run(tmp_path)  # tiny.yaml with two timeouts changed
    assert cli_main(["run", str(TINY), "--run-dir", str(rd.root), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert (f"hpcrl: error: run directory {rd.root} already holds a run of another config (2 keys differ: "
            "timeouts.wait_samples_s: 120.0 -> 600.0, timeouts.wait_weights_s: 120.0 -> 600.0); pass --resume to "
            "continue that run") in err, err
    assert cli_main(["run", str(TINY), "timeouts.wait_samples_s=120", "timeouts.wait_weights_s=120", "--run-dir",
                     str(rd.root), "--dry-run"]) == 2
    assert (f"run directory {rd.root} already holds a run of this same config; pass --resume to continue it"
            in capsys.readouterr().err)


def test_dry_run_of_slurm_jobs_prints_the_sbatch_lines_where_slurm_is_not(tmp_path, capsys, monkeypatch):
    """A laptop or a login node before the cluster: the dry run shows what would be submitted, with a note that a
    real run needs Slurm's commands (which the real run still refuses without)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands
    run = tmp_path / "run"
    assert cli_main(["run", str(TINY), "--run-dir", str(run), "--executor", "slurm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# Slurm's sbatch, squeue, scancel are not on PATH here" in out, out
    lines = [line for line in out.splitlines() if line.startswith("sbatch ")]
    assert len(lines) == 3 and lines[0].startswith("sbatch --parsable --job-name=hpcrl-trainer --nodes=1 ") and \
        lines[0].endswith(f"sbatch/trainer.sbatch {run}") and "--array=0-0" in lines[1], lines
    assert not run.exists()


def test_a_run_directory_that_is_a_file_or_cannot_be_written_is_refused_by_the_dry_run(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for run_dir, fragment in ((afile, f"--run-dir {afile} is a file, not a folder"),
                              (afile / "run", f"--run-dir {afile / 'run'} is under {afile}, a file, not a folder")):
        assert cli_main(["run", str(TINY), "--run-dir", str(run_dir), "--executor", "local", "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"hpcrl: error: {fragment}; fix: choose a --run-dir" in err and "Traceback" not in err, err
    closed = tmp_path / "closed"
    closed.mkdir()
    locked = ["chattr", "+i", str(closed)] if os.geteuid() == 0 else None  # root writes in any mode
    try:
        if locked:
            subprocess.run(locked, check=True)
        else:
            closed.chmod(0o500)
        assert cli_main(["run", str(TINY), "--run-dir", str(closed / "run"), "--executor", "local", "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"hpcrl: error: --run-dir {closed / 'run'}: this process cannot create it in {closed} (" in err, err
    finally:
        if locked:
            subprocess.run(["chattr", "-i", str(closed)], check=True)
        else:
            closed.chmod(0o700)


def test_dry_run_into_a_closed_pipe_ends_quietly(tmp_path):
    proc = subprocess.Popen([python(), "-m", "hpcrl", "run", str(TINY), "--run-dir", str(tmp_path / "r"),
                             "--dry-run"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head -1` once head has exited
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 0 and "BrokenPipeError" not in err and "Traceback" not in err, err


def test_submit_sh_with_a_python_without_hpcrl_says_so(tmp_path):
    out = subprocess.run(["bash", str(REPO / "sbatch" / "submit.sh"), "--dry-run", str(TINY), str(tmp_path / "r")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HPCRL_PYTHON": "/usr/bin/python3"})
    assert out.returncode == 1 and "cannot import hpcrl" in out.stderr and "HPCRL_PYTHON" in out.stderr, out.stderr
