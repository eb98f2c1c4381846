"""Reward functions called as verl calls them: by keyword, with only the names a function accepts. verl's
own scorers (``verl/utils/reward_score/gsm8k.py`` and ``math_reward.py``, taken at test time from the verl
0.9.1 wheel on PyPI and imported by path, nothing copied into the repository) work unchanged through
``reward.path``; hpcrl's ``by_data_source`` dispatch scores the same rows the same; a verl-style custom
function scores correctly whatever the order of its parameters; a function that cannot be called so is
refused at launch with its signature and the expected one."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from conftest import TINY
from hpcrl.cli import main as cli_main
from hpcrl.config import RewardConfig
from hpcrl.rollout.reward_fn import RewardLoadError, RewardScorer, check_reward, load_reward

VERL = "verl==0.9.1"
CACHE = Path(os.environ.get("HPCRL_TEST_CACHE", Path.home() / ".cache" / "hpcrl-tests"))
"""Where the downloaded wheel is kept between runs (outside the repository)."""


@pytest.fixture(scope="module")
def verl_scorers(tmp_path_factory) -> Path:
    """The folder holding verl 0.9.1's ``gsm8k.py`` and ``math_reward.py``, unzipped from its wheel."""
    wheels = sorted(CACHE.glob("verl-0.9.1-*.whl"))
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", VERL, "-d",
                                  str(CACHE)], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip(f"PyPI did not answer in 300 s: `pip download --no-deps {VERL}` is needed for verl's scorers")
        wheels = sorted(CACHE.glob("verl-0.9.1-*.whl"))
        if out.returncode != 0 or not wheels:
            pytest.skip(f"PyPI is unreachable (`pip download --no-deps {VERL}` failed: "
                        f"{(out.stderr.strip().splitlines() or ['?'])[-1]}); verl's own scorers cannot be fetched")
    folder = tmp_path_factory.mktemp("verl_scorers")
    with zipfile.ZipFile(wheels[-1]) as z:
        for name in ("gsm8k.py", "math_reward.py"):
            (folder / name).write_bytes(z.read(f"verl/utils/reward_score/{name}"))
    return folder


def row(source, truth, extra=None):
    return {"data_source": source, "answer": truth, "extra_info": extra}


GSM8K = [("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
         ("So she sold 72 clips in all.", "72", 0.0),
         ("#### 71", "72", 0.0),
         ("1000 + 200 = 1,200\n#### 1,200", "1200", 1.0)]
MATH = [("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("the answer is $\\boxed{3}$", "4", 0.0),
        ("I do not know.", "\\frac{1}{2}", 0.0)]


@pytest.mark.parametrize("name, source, cases", [("gsm8k.py", "openai/gsm8k", GSM8K),
                                                  ("math_reward.py", "lighteval/MATH", MATH)])
def test_verls_own_scorers_through_reward_path_and_the_dispatch(verl_scorers, name, source, cases):
    verl = RewardScorer(load_reward(RewardConfig(path=str(verl_scorers / name))))
    ours = RewardScorer(load_reward(RewardConfig(name="by_data_source")))
    for j, (response, truth, want) in enumerate(cases):
        assert verl.score(f"w000/0/{j}", row(source, truth), response) == want, (name, response)
        assert ours.score(f"w000/0/{j}", row(source, truth), response) == want, ("by_data_source", response)
    assert verl.pop_metrics()["reward/errors"] == 0 and ours.pop_metrics()["reward/errors"] == 0
    if source == "lighteval/MATH":  # the one difference: math-verify finds a final answer without \boxed{}
        assert (verl.score("w000/1/0", row(source, "\\frac{1}{2}"), "the answer is 1/2"),
                ours.score("w000/1/0", row(source, "\\frac{1}{2}"), "the answer is 1/2")) == (0.0, 1.0)
    assert load_reward(RewardConfig(path=str(verl_scorers / name))).passed == ("solution_str", "ground_truth")


def test_verls_gsm8k_scorer_takes_its_options_from_reward_kwargs(verl_scorers):
    flexible = load_reward(RewardConfig(path=str(verl_scorers / "gsm8k.py"), kwargs={"method": "flexible"}))
    assert flexible("openai/gsm8k", "So she sold 72 clips in all.", "72", None) == 1.0
    with pytest.raises(RewardLoadError, match=r"reward.kwargs methd are not parameters of compute_score\(solution_str"):
        load_reward(RewardConfig(path=str(verl_scorers / "gsm8k.py"), kwargs={"methd": "flexible"}))


VERL_STYLE = '''
def compute_score(solution_str, ground_truth, data_source=None, extra_info=None):
    """The signature that positional calls mis-scored (every reward 0)."""
    assert data_source == "openai/gsm8k" and extra_info["split"] == "train", (data_source, extra_info)
    return float(solution_str.strip().endswith("#### " + ground_truth))
'''


def test_a_verl_style_custom_function_scores_correctly(tmp_path):
    (tmp_path / "r.py").write_text(VERL_STYLE)
    scorer = RewardScorer(load_reward(RewardConfig(path=str(tmp_path / "r.py"))))
    r = row("openai/gsm8k", "72", {"split": "train"})
    assert [scorer.score("w000/0/0", r, "#### 72"), scorer.score("w000/0/1", r, "#### 7")] == [1.0, 0.0]
    assert scorer.pop_metrics()["reward/errors"] == 0
    assert "openai/gsm8k '#### 72' -> 1" in check_reward(RewardConfig(path=str(tmp_path / "r.py")), [r])


def gsm8k_parquet(path):
    pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "repeat a"}],
                   "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train"}}]
                 ).to_parquet(path)
    return path


def test_the_launch_check_shows_the_signature_and_a_real_rows_score(verl_scorers, tmp_path, capsys):
    data = gsm8k_parquet(tmp_path / "train.parquet")
    rc = cli_main(["run", str(TINY), f"data.source={data}", f"custom_reward_function.path={verl_scorers / 'gsm8k.py'}",
                   "--run-dir", str(tmp_path / "run"), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert ("compute_score(solution_str, ground_truth, method='strict', format_score=0.0, score=1.0) from" in out
            and "called with solution_str, ground_truth" in out and "openai/gsm8k '#### 72' -> 1" in out), out


@pytest.mark.parametrize("body, fragment", [
    ("def compute_score(response, answer):\n    return 0.0\n", "cannot take solution_str and ground_truth by name"),
    ("def compute_score(*args):\n    return 0.0\n", "cannot take solution_str and ground_truth by name"),
    ("def compute_score(solution_str, ground_truth, tokenizer):\n    return 0.0\n", "needs tokenizer"),
])
def test_a_function_verl_could_not_call_is_refused_at_launch_with_both_signatures(tmp_path, capsys, body, fragment):
    (tmp_path / "r.py").write_text(body)
    rc = cli_main(["run", str(TINY), f"reward.path={tmp_path / 'r.py'}", "--run-dir", str(tmp_path / "run"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert "expected compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)" in err or \
        "needs" in fragment
    assert not (tmp_path / "run").exists()


def test_by_data_source_names_the_known_sources_for_an_unknown_one(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('{"data_source": "my/task", "prompt": "repeat a", "reward_model": {"ground_truth": "a"}}\n')
    rc = cli_main(["run", str(TINY), f"data.source={src}", "reward.name=by_data_source", "--run-dir",
                   str(tmp_path / "run"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "no scorer for data_source 'my/task'" in err and "openai/gsm8k" in err, err
