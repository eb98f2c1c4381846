"""Validation metrics: verl's names and definitions (``hpcrl/eval/metrics.py``), checked on hand-computed inputs
and against verl 0.9.1's own ``process_validation_metrics`` and ``_val_metrics_update``, taken from the wheel on
PyPI at test time (nothing of verl is copied into the repository)."""
from __future__ import annotations

import ast
import os
import random
import subprocess
import sys
import typing
import zipfile
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from hpcrl.eval import metrics
from hpcrl.eval.evaluate import summarize
from hpcrl.logs.eval_log import EvalSample, split_metric

VERL = "verl==0.9.1"


def test_mean_std_best_worst_and_the_core_names_by_hand():
    """Two prompts of one source, N = 2 and N = 1 values of ``reward`` (floats), one of them None."""
    nested = metrics.validation_metrics(["d", "d", "d", "d"], ["p", "p", "q", "q"],
                                        {"reward": [1.0, 0.0, 0.5, None]})
    r = nested["d"]["reward"]
    # p: mean 0.5, std 0.5 (population), best@2 / worst@2 from draws of two; q: one value left, mean 0.5
    assert r["mean@2"] == 0.5 and r["std@2"] == 0.5 and r["mean@1"] == 0.5
    idx = np.random.RandomState(42).choice(2, size=(1000, 2), replace=True)
    drawn = np.array([1.0, 0.0])[idx]
    assert r["best@2/mean"] == pytest.approx(drawn.max(1).mean()) and r["worst@2/mean"] == pytest.approx(
        drawn.min(1).mean())
    assert 0.70 < r["best@2/mean"] < 0.80  # P(max of two draws of {1, 0} is 1) = 3/4
    names = metrics.metric_names(nested)
    assert names["val-core/d/reward/mean@2"] == 0.5
    assert "val-core/d/reward/best@2/mean" in names and "val-core/d/reward/best@2/std" in names
    assert "val-aux/d/reward/worst@2/mean" in names and "val-aux/d/reward/std@2" in names
    assert "val-aux/d/reward/mean@1" in names, "mean@1 does not mention the largest N (2): aux, as in verl"


def test_eight_identical_responses_give_exact_bootstrap_statistics():
    """N = 8 with one value and one pred: every draw's max, min and majority value is that value, std 0."""
    nested = metrics.validation_metrics(["d"] * 8, ["p"] * 8, {"reward": [0.25] * 8, "acc": [True] * 8,
                                                               "pred": ["42"] * 8})
    acc, reward = nested["d"]["acc"], nested["d"]["reward"]
    for k in (2, 4, 8):
        for stat in ("best", "worst", "maj"):
            assert acc[f"{stat}@{k}/mean"] == 1.0 and acc[f"{stat}@{k}/std"] == 0.0
            assert reward[f"{stat}@{k}/mean"] == 0.25
    assert "pred" not in nested["d"], "a string key is no metric"
    names = metrics.metric_names(nested)
    core = sorted(n for n in names if n.startswith("val-core/"))
    assert core == ["val-core/d/acc/best@8/mean", "val-core/d/acc/best@8/std", "val-core/d/acc/maj@8/mean",
                    "val-core/d/acc/maj@8/std", "val-core/d/acc/mean@8"], "acc is the core key when present"
    assert metrics.headline(nested) == (1.0, "val-core/d/acc/mean@8")


def test_majority_vote_by_hand():
    """Per draw: the most frequent pred, ties to the one drawn first; its value is that of its first draw."""
    values = np.array([1.0, 0.0, 0.0, 1.0])
    preds = ["A", "B", "B", "A"]
    idx = np.array([[0, 1, 2],   # A B B -> B, first B is draw 1 = response 1 -> 0
                    [1, 0, 3],   # B A A -> A, first A is draw 1 = response 0 -> 1
                    [3, 0, 1],   # A A B -> A, first draw = response 3 -> 1
                    [1, 0, 2],   # B A B -> B, response 1 -> 0
                    [0, 1, 3]])  # A B A -> A -> response 0 -> 1
    assert metrics.majority_values(values, preds, idx).tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
    tie = np.array([[2, 3], [3, 2]])  # B A and A B: a tie goes to the pred drawn first
    assert metrics.majority_values(values, preds, tie).tolist() == [0.0, 1.0]


def test_bootstrap_draws_are_verls_without_touching_numpys_global_state():
    state = np.random.get_state()
    np.random.seed(42)
    want = np.random.choice(8, size=(1000, 4), replace=True)
    np.random.set_state(state)
    before = np.random.get_state()[1].copy()
    assert (metrics.bootstrap_indices(8, 4) == want).all()
    assert (np.random.get_state()[1] == before).all()
    assert metrics.bootstrap_sizes(8) == [2, 4, 8] and metrics.bootstrap_sizes(6) == [2, 4, 6]
    assert metrics.bootstrap_sizes(1) == []


def test_a_versions_samples_become_metrics_per_data_source_with_lengths():
    def sample(source, uid, j, reward, extras, tokens=4, reason="stop"):
        return EvalSample(version=3, prompt_id=uid, data_source=source, index=j, prompt="p", response="r",
                          ground_truth="g", reward=reward, extras=extras, response_tokens=tokens, finish_reason=reason,
                          num_turns=1)

    samples = [sample("a", "0:0", 0, 1.0, {"score": 1.0, "acc": True, "pred": "x"}),
               sample("a", "0:0", 1, 0.0, {"score": 0.0, "acc": False, "pred": "y"}, tokens=8, reason="length"),
               sample("b", "1:0", 0, 0.5, {}), sample("b", "1:0", 1, 0.5, {})]
    values, score, name = summarize(samples)
    assert values["val-core/a/acc/mean@2"] == 0.5 and values["val-core/b/reward/mean@2"] == 0.5
    assert values["val-aux/a/score/mean@2"] == 0.5 and values["val-aux/a/reward/mean@2"] == 0.5
    assert "val-aux/b/acc/mean@2" not in values, "a source that reports no acc gets none"
    assert values["val-aux/a/response_length/mean"] == 6.0 and values["val-aux/a/response_length/clip_ratio"] == 0.5
    assert score == 0.5 and "2 data sources" in name
    assert split_metric("val-core/openai/gsm8k/acc/maj@8/mean") == ("val-core", "openai/gsm8k", "acc", "maj@8/mean")


# ---- against verl 0.9.1 itself ---------------------------------------------------------------

@pytest.fixture(scope="module")
def verl_functions():
    """verl 0.9.1's ``process_validation_metrics`` (with its helpers) and ``RayPPOTrainer._val_metrics_update``,
    compiled from the wheel's sources (their module imports torch, ray and more; these functions need numpy)."""
    cache = Path(os.environ.get("HPCRL_TEST_CACHE", Path.home() / ".cache" / "hpcrl-tests")) / "verl-0.9.1"
    wheels = sorted(cache.glob("verl-0.9.1-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", VERL, "-d", str(cache)],
                             capture_output=True, text=True, timeout=300)
        wheels = sorted(cache.glob("verl-0.9.1-*.whl"))
        if out.returncode != 0 or not wheels:
            pytest.skip(f"cannot download {VERL} from PyPI (offline?): {out.stderr.strip()[-300:]}")
    ns = {"np": np, "defaultdict": defaultdict, "partial": partial, "Any": typing.Any, "Callable": typing.Callable}
    with zipfile.ZipFile(wheels[0]) as z:
        utils = ast.parse(z.read("verl/trainer/ppo/metric_utils.py"))
        trainer = ast.parse(z.read("verl/trainer/ppo/ray_trainer.py"))
    wanted = [n for n in utils.body if isinstance(n, ast.FunctionDef)
              and n.name in ("bootstrap_metric", "calc_maj_val", "process_validation_metrics")]
    wanted += [m for c in trainer.body if isinstance(c, ast.ClassDef) for m in c.body
               if isinstance(m, ast.FunctionDef) and m.name == "_val_metrics_update"]
    assert len(wanted) == 4, [n.name for n in wanted]
    exec(compile(ast.Module(wanted, []), "verl-0.9.1", "exec"), ns)
    return ns


def _random_inputs(rng: random.Random, n: int):
    sources, uids, infos = [], [], defaultdict(list)
    for p in range(rng.randint(1, 5)):
        source = rng.choice(["openai/gsm8k", "toy"])
        for _ in range(n):
            sources.append(source)
            uids.append(f"{source}-{p}")
            infos["reward"].append(round(rng.random(), 3))
            infos["acc"].append(rng.random() < 0.4)
            infos["pred"].append(rng.choice(["1", "2", "3"]))
    return sources, uids, dict(infos)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_the_metrics_equal_verls_own_functions(verl_functions, n):
    """Same inputs (floats, bools, a pred for the majority vote), same numbers to the last bit, same names."""
    rng = random.Random(n)
    for _ in range(5):
        sources, uids, infos = _random_inputs(rng, n)
        want = verl_functions["process_validation_metrics"](sources, uids, infos)
        got = metrics.validation_metrics(sources, uids, infos)
        assert {s: {k: dict(m) for k, m in by_k.items()} for s, by_k in want.items()} == got
        named = verl_functions["_val_metrics_update"](None, np.array(sources, dtype=object), uids, infos, [])
        assert {k: float(v) for k, v in named.items()} == metrics.metric_names(got)
