"""LoRA runs end to end (trainer + rollout jobs, real processes): the tiny task learns with a rank-8 adapter to the
level full fine-tuning reaches in the same 300 updates (transformers engine); vLLM serves every adapter version as
the trainer computes it (a short launched run, both in the background: ``conftest.BackgroundRuns``); and a run whose
trainer and rollout job are SIGKILLed while an adapter version is published and being loaded resumes from the adapter
checkpoint with every group trained on once."""
import importlib.util
import signal
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import (REPO, TINY, BackgroundCommand, check_exactly_once, python, start_rollout, start_trainer,
                      wait_until)
from hpcrl.logs.eval_log import EVALUATED, read_eval_rows
from hpcrl.rundir.fsio import read_json, read_jsonl
from hpcrl.logs.run_logs import read_metrics
from hpcrl.rundir.paths import EVAL_JOB, RunDir

pytestmark = pytest.mark.slow

LORA = ["actor.lora_rank=8", "actor.lora_alpha=16",
        "actor.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"]
"""configs/tiny-lora.yaml as overrides of configs/tiny.yaml (checked below)."""
VLLM_UPDATES = 20
"""The vLLM LoRA run checks serving, not learning: at lag 0 its PPO ratio is 1, so the engine samples from exactly
the trainer's adapter policy, whose learning the transformers run holds to 0.8. Learning through vLLM was measured
at 160 updates (docs/lora.md: 0.84, 0.72, 0.94; one run in eight stayed at 0.1-0.2 for 100 updates): on CPU, vLLM's
LoRA path generates ~300 tokens/s against ~1,260 without an adapter, and a learning run cost the suite 190-280 CPU-s,
against ~110 for 40 updates in the background (two vLLM engines start, the rollout job's and the evaluation
job's)."""


def sharp_base(folder: Path) -> Path:
    """The tiny model (head dim 64, for vLLM's CPU attention) with its output layer scaled by 3: a stand-in for a
    pretrained model, whose frozen output layer does not bound the logits as the random-init one does (README,
    "LoRA"), so that an adapter on the layers' projections alone (what vLLM serves) can learn the task."""
    from safetensors.torch import load_file, save_file

    from hpcrl.tiny.model import build_tiny_model

    base = build_tiny_model(folder / "base", seed=0, head_dim=64)
    weights = load_file(base / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    return base


def vllm_lora_run(folder: Path) -> list[str]:
    """``hpcrl run`` of the tiny task on :func:`sharp_base` with a rank-8 adapter on the projections, vLLM serving
    it (the launch checks ask this vLLM build whether it serves LoRA)."""
    return ["run", str(TINY), f"model.path={sharp_base(folder)}", "rollout.engine=vllm", "actor.lora_rank=8",
            f"rollout.total_rollout_steps={4 * VLLM_UPDATES}", f"eval.every_versions={VLLM_UPDATES // 2}", "--run-dir",
            str(folder / "run"), "--executor", "local", "--timeout-min", "30"]


BACKGROUND_RUNS = {"lora:tiny": LORA}
if importlib.util.find_spec("vllm") is not None:
    BACKGROUND_RUNS["lora:vllm"] = BackgroundCommand.hpcrl_args(vllm_lora_run)


def background_keys(item):
    return {"test_lora_learns_the_tiny_task_as_full_fine_tuning_does": ("lora:tiny",),
            "test_lora_through_vllm_serves_every_adapter_version_as_the_trainer_computes_it": ("lora:vllm",)
            }.get(item.originalname, ())


def fifths(values):
    k = max(len(values) // 5, 1)
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))


def test_the_lora_config_is_the_tiny_config_with_the_lora_overrides():
    lora = yaml.safe_load((REPO / "configs" / "tiny-lora.yaml").read_text())
    tiny = yaml.safe_load(TINY.read_text())
    assert lora.pop("actor") == {**tiny.pop("actor"), "lora_rank": 8, "lora_alpha": 16,
                                 "lora_target_modules": LORA[2].split("=")[1].strip("[]").split(",")}
    assert lora == tiny


def test_lora_learns_the_tiny_task_as_full_fine_tuning_does(background_runs):
    """Full fine-tuning of the same task reaches a last fifth of 0.97-1.0 in these 300 updates (measured side by
    side: docs/lora.md; tests/test_learning.py holds it to its own bound each session); LoRA must come within
    0.2 of that, with versions that are the adapter alone."""
    lora = background_runs.finish("lora:tiny", trainer_s=900)
    m = read_metrics(lora)
    lora_first, lora_last = fifths(m["reward/mean"].to_numpy())
    print(f"300 updates, reward first/last fifth: LoRA rank 8 {lora_first:.3f} -> {lora_last:.3f}")
    assert len(m) == 300
    assert lora_last > lora_first + 0.5, "LoRA learns"
    # measured: 0.950 and 0.930 against full fine-tuning's 0.969 and 0.997; runs are not bit-reproducible
    assert lora_last >= 0.8, "near full fine-tuning's level in the same updates"
    from transformers import AutoModelForCausalLM

    from hpcrl.tiny.model import tiny_config

    full_bytes = 4 * AutoModelForCausalLM.from_config(tiny_config()).num_parameters()
    assert (m["weights/bytes"] < full_bytes / 4).all(), f"a version is the adapter alone (full model: {full_bytes} B)"
    assert max(m["actor/ratio_max"].max() - 1, 1 - m["actor/ratio_min"].min()) < 1e-3, \
        "at lag 0 the engine's adapter log-probs are the trainer's"
    check_exactly_once(lora, lora.load_config().rollout.max_concurrent_groups)
    out = subprocess.run([python(), "-m", "hpcrl", "eval", str(lora.root), "--versions", "last", "--out",
                          str(lora.root / "offline")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    row, = read_eval_rows(RunDir(lora.root / "offline").eval_log)  # hpcrl eval scores the last adapter version
    assert row.version == 300 and row.status == EVALUATED and row.score >= 0.8, row


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_lora_through_vllm_serves_every_adapter_version_as_the_trainer_computes_it(background_runs):
    """Launched like a user's run: every adapter version reaches vLLM's engine (the rollout job's and the evaluation
    job's), and at lag 0 vLLM's log-probs under the adapter are the trainer's (the PPO ratio is 1)."""
    out = background_runs.launched("lora:vllm", timeout_s=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "LoRA: rank 8, alpha 16 on 14 layers" in out.stdout, "the launch check says what is trained"
    rd = RunDir(Path(out.args[out.args.index("--run-dir") + 1]))
    m = read_metrics(rd)
    ro = pd.read_json(rd.rollout_metrics("w000"), lines=True)
    ratio = max(m["actor/ratio_max"].max() - 1, 1 - m["actor/ratio_min"].min())
    print(f"vLLM LoRA run, {VLLM_UPDATES} updates: |ratio - 1| <= {ratio:.1e}")
    assert len(m) == VLLM_UPDATES and set(range(VLLM_UPDATES)) <= set(ro.param_version), \
        "every version reached the engine"
    assert "into the engine's adapter" in rd.job_log(RunDir.rollout_job("w000")).read_text()
    assert ratio < 1e-3, "at lag 0 vLLM's log-probs under the adapter are the trainer's: the PPO ratio is 1"
    assert m["actor/grad_norm"].gt(0).mean() > 0.8, "the adapter trains (0: every sample of an update scored alike)"
    rows = read_eval_rows(rd.eval_log)  # the evaluation job (vLLM too) scores the adapter versions
    assert [(r.version, r.status) for r in rows] == [(v, EVALUATED) for v in (0, VLLM_UPDATES // 2, VLLM_UPDATES)]
    assert all(r.sampling["engine"] == "vllm" for r in rows) and "LoRA up to rank 8" in rd.job_log(EVAL_JOB).read_text()
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)


def n_updates(rd) -> int:
    return sum(1 for _ in read_jsonl(rd.metrics))


def test_trainer_and_rollout_sigkilled_at_an_adapter_version_resume_from_the_adapter_checkpoint(tiny_run):
    """The rollout job SIGKILLs itself as it hands adapter version 25 to its engine (a fault point); the trainer,
    which has just published it, is SIGKILLed at once. Both start again: the trainer resumes from its adapter
    checkpoint at step 20 (no base weights in it), withdraws the versions after it, and the run completes with every
    committed group trained on once."""
    rd = tiny_run(*LORA, "rollout.total_rollout_steps=160", "trainer.checkpoint_every_updates=10",
                  "async_training.staleness_threshold=0.5", "rollout.max_concurrent_groups=3")
    cfg = rd.load_config()
    trainer = start_trainer(rd)
    rollout = start_rollout(rd, env={"HPCRL_FAULT_POINT": "engine_load:26:kill"})  # its 26th load: version 25
    wait_until(lambda: rollout.proc.poll() is not None, 240, "the rollout job's SIGKILL at loading version 25",
               jobs=(trainer,))
    trainer.kill(signal.SIGKILL)
    assert rollout.proc.returncode == -signal.SIGKILL
    published = sorted(RunDir.parse_weight_version(p.name) for p in rd.weights.iterdir()
                       if RunDir.parse_weight_version(p.name) is not None and (p / "manifest.json").exists())
    ckpt = read_json(rd.latest_checkpoint)["step"]
    assert published[-1] >= 25 > ckpt == 20, (published, ckpt)
    ckpt_dir = rd.checkpoints / f"step-{ckpt:08d}"
    assert sum(p.stat().st_size for p in ckpt_dir.iterdir()) < (rd.base_model / "model.safetensors").stat().st_size, \
        "the checkpoint holds the adapter and its optimizer state, not the base"
    trainer2, rollout2 = start_trainer(rd), start_rollout(rd)
    assert trainer2.wait(300) == 0, trainer2.tail()
    assert rollout2.wait(120) == 0, rollout2.tail()
    assert f"resumed from step-{ckpt:08d}" in trainer2.log_path.read_text()
    assert [r["step"] for r in read_jsonl(rd.metrics)] == list(range(1, cfg.total_updates + 1))
    log = rd.job_log(RunDir.rollout_job("w000")).read_text()
    resumed_loads = [int(line.split("loaded weight version ")[1].split()[0]) for line in log.splitlines()
                     if "loaded weight version" in line and "into the engine's adapter" in line]
    assert max(resumed_loads) > 25, "the new rollout job loads the versions the resumed trainer publishes"
    final = rd.weight_version_dir(cfg.total_updates)
    assert sorted(p.name for p in final.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                       "manifest.json"]
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)
