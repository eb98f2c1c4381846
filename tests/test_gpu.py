"""The update step and the engines on CUDA (marked ``gpu``: skipped with the reason where torch sees no GPU;
``bench/gpu_check.sh`` runs them first). The update step also runs on CPU, in the fast tier, so the script
the GPU runs is the one CI keeps working. The trainer's math on CUDA is ``tests/test_cuda_math.py``.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO
from hpcrl.rollout.engine import EngineOptions, EngineRunner
from hpcrl.samples.schema import Group, Trajectory
from hpcrl.tiny.model import build_tiny_model
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.forward import logprobs_of
from hpcrl.trainer.models import load_reference

NO_GPU = "no CUDA device: torch.cuda.is_available() is False (these run on a GPU node: bench/gpu_check.sh)"
on_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=on_gpu)])
def test_the_update_step_runs_every_part_as_the_trainer_builds_it(tmp_path, device):
    """tests/update_step_peer.py: the trainer's process group, parts (bf16 on a GPU by default) and one update per
    setting (critic, reference and KL, importance weights and rejection, bypass mode, a token baseline, PF-PPO,
    remax, DAPO's overlong filtering), each leaving finite metrics and moved weights."""
    out = subprocess.run([sys.executable, str(REPO / "tests" / "update_step_peer.py"), str(tmp_path), device],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    done = [line.split()[0] for line in out.stdout.splitlines() if " ok " in line]
    assert done == ["grpo", "gae+pf_ppo", "kl+correction", "token_baseline+bypass", "remax", "dapo"], out.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gpu") / "m", seed=0, head_dim=64)


def sampled(engine, runner, prompts, n=4):
    groups = []
    for gi, prompt in enumerate(prompts):
        samples = runner.call(lambda: engine.generate(prompt, n, seed=gi), 300, "generate")
        trajs = [Trajectory(prompt, s.response_ids, np.ones(len(s.response_ids), np.int8), s.logprobs,
                            np.zeros(len(s.response_ids), np.int32), 0.0) for s in samples]
        groups.append(Group("w000", gi, trajs, 0.0, 0.0))
    return groups


@pytest.mark.parametrize("name", ["transformers", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"))])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_an_engine_on_cuda_samples_with_the_trainers_log_probs_and_takes_a_new_version(model_dir, tmp_path, name,
                                                                                         dtype):
    """The engine's log-probs of what it sampled are the trainer's (fp32 on CUDA) up to the engine's precision; a
    new version it loads (the other seed's weights, from a folder) changes what it generates to that model's."""
    from hpcrl.rollout.engines import make_engine
    from hpcrl.weights.base import WeightVersion

    runner = EngineRunner()
    from hpcrl.config import RunConfig

    opts = EngineOptions(model_dir, max_new_tokens=8, temperature=0.7, top_p=1.0, device="cuda", dtype=dtype)
    cfg = RunConfig()
    cfg.rollout.max_model_len, cfg.rollout.max_num_seqs, cfg.rollout.gpu_memory_utilization = 128, 32, 0.2
    engine = make_engine(name, opts, cfg, runner, timeout_s=600)
    try:
        batch = build_batch(sampled(engine, runner, [[30, 5], [31, 7, 8, 9]]), pad_id=0, trainer_version=0)
        with torch.no_grad():
            logp = logprobs_of(load_reference(model_dir, "cuda"), batch, 0.7)[0].cpu()
        m = batch.mask > 0
        diff = float((logp[m] - batch.behav_logp[m]).abs().max())
        assert diff < (0.1 if dtype == "bfloat16" else 1e-3), f"{name} {dtype}: max |engine - trainer| {diff}"
        other = build_tiny_model(tmp_path / "m1", seed=1, head_dim=64)
        state = {k: v.to("cuda") for k, v in load_reference(other).state_dict().items()}
        version = WeightVersion(1, None, other, state, "memory", 0.0, 0)
        runner.call(lambda: engine.load_weights(version), 300, "load_weights")
        batch = build_batch(sampled(engine, runner, [[30, 5]]), pad_id=0, trainer_version=1)
        with torch.no_grad():
            new = logprobs_of(load_reference(other, "cuda"), batch, 0.7)[0].cpu()
            old = logprobs_of(load_reference(model_dir, "cuda"), batch, 0.7)[0].cpu()
        m = batch.mask > 0
        assert float((new[m] - batch.behav_logp[m]).abs().max()) < float((old[m] - batch.behav_logp[m]).abs().max())
    finally:
        engine.close()
        runner.close()
