"""The trainer's update step on one device, as the trainer job builds it: ``python tests/update_step_peer.py
FOLDER DEVICE`` (``cpu`` or ``cuda``). Started by ``tests/test_gpu.py`` in a process of its own (DeepSpeed's
process group must not leak into the test process).

The trainer's own process group (``init_distributed``: gloo on CPU; NCCL for CUDA tensors and gloo for host
tensors on a GPU), then for each setting below the trainer's parts (``build_parts``: the model under
DeepSpeed, bf16 on a GPU by ``actor.bf16: auto``, the reference when a KL term needs it) and one update
(``PolicyUpdate.run``) on groups sampled by the transformers engine on the same device. Prints one
``SETTING ok`` line each, after checking that the update's metrics are finite and the weights moved, and
that a trainer resumed from a checkpoint of it (``checkpoint.save`` / ``build_parts``) holds the same weights
on the same device and updates again.
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = {
    "grpo": [],
    "gae+pf_ppo": ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true"],
    "kl+correction": ["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true", "async_training.compute_prox_log_prob=true",
                      "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
                      "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0", "actor.policy_loss.loss_mode=gspo"],
    "token_baseline+bypass": ["algorithm.adv_estimator=optimal_token_baseline", "actor.loss_agg_mode=seq-mean-token-sum",
                              "algorithm.rollout_correction.bypass_mode=true",
                              "algorithm.rollout_correction.rollout_is=token"],
    "remax": ["algorithm.adv_estimator=remax", "actor.policy_loss.loss_mode=clip_cov"],
}
"""Settings that reach every part of the update: the critic, a reference, importance weights and rejection,
bypass mode, a token baseline, PF-PPO's resampling, remax's baselines."""


def groups_on(device: str, model_dir: Path, n: int, with_baseline: bool):
    """Four groups of ``n`` sampled by the transformers engine on ``device``."""
    from hpcrl.rollout.engine import EngineOptions
    from hpcrl.rollout.transformers_engine import TransformersEngine
    from hpcrl.samples.schema import Group, Trajectory

    eng = TransformersEngine(EngineOptions(model_dir=model_dir, max_new_tokens=6, temperature=1.0, top_p=1.0, device=device,
                                           dtype="bfloat16" if device == "cuda" else "float32"))
    groups = []
    for g in range(4):
        prompt = [3 + g, 7, 9]
        samples = eng.generate_sync(prompt, n, seed=g)
        trajs = [Trajectory(prompt_ids=prompt, response_ids=s.response_ids, response_mask=s.response_ids * 0 + 1,
                            logprobs=s.logprobs, token_versions=s.response_ids * 0, reward=float(j % 2))
                 for j, s in enumerate(samples)]
        groups.append(Group(writer="w000", prompt_index=g, trajectories=trajs, created_s=0.0, finished_s=0.0,
                            reward_baseline=0.5 if with_baseline else None))
    return groups


def one_update(folder: Path, device: str, name: str, overrides: list[str]) -> None:
    from conftest import make_run
    from hpcrl.control.startup import StartupSteps
    from hpcrl.trainer import checkpoint
    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.parts import build_parts

    rd = make_run(folder, "model.path=builtin:tiny-h64", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                  "actor.ppo_micro_batch_size=2", *overrides, name=name.replace("+", "_"))
    cfg = rd.load_config()

    class Beat:
        def update(self, **kw):
            pass

        def write(self):
            pass

    parts, _ = build_parts(cfg, rd, 0, 1, StartupSteps(Beat(), "trainer", 300))
    engine = parts.engine
    assert engine.device.type == device, engine.device
    assert engine.bfloat16_enabled() == (device == "cuda"), "actor.bf16: auto is bf16 on a GPU only"
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    batch = build_batch(groups_on(device, rd.model_dir(cfg.model.path), 4, "remax" in name), parts.layout.pad_id, 0)
    stats = parts.updater.run(batch)
    bad = {k: v for k, v in stats.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"{name}: non-finite metrics {bad}"
    moved = sum(float((p.detach().float() - b).abs().sum()) for p, b in zip(engine.module.parameters(), before))
    assert moved > 0, f"{name}: the update did not change the weights"
    # a checkpoint of it, and a trainer resumed from it that updates again
    checkpoint.save(engine, rd, checkpoint.TrainerState(step=1, param_version=1), keep=1)
    parts.lead.close()
    resumed, state = build_parts(cfg, rd, 0, 1, StartupSteps(Beat(), "trainer", 300))
    assert state is not None and state.step == 1, f"{name}: no checkpoint found on resume"
    for p, q in zip(engine.module.parameters(), resumed.engine.module.parameters()):
        assert torch.equal(p.detach(), q.detach()) and q.device.type == device, f"{name}: resumed weights differ"
    again = resumed.updater.run(batch)
    assert math.isfinite(again["actor/pg_loss"]), f"{name}: the resumed trainer's update is not finite"
    resumed.lead.close()
    print(f"{name} ok (loss terms {sorted(k for k in stats if k.startswith('actor/pg'))})", flush=True)


def main(folder: str, device: str) -> int:
    logging.basicConfig(level=logging.WARNING)
    from hpcrl.trainer.distributed import init_distributed

    init_distributed(timeout_s=300, arrival_s=60, log_interval_s=30)
    # the trainer's group carries host tensors (share.py) and, on a GPU, CUDA tensors
    dist.broadcast(torch.zeros(3, dtype=torch.int64), src=0)
    if device == "cuda":
        dist.broadcast(torch.zeros(3, device="cuda"), src=0)
    for name, overrides in SETTINGS.items():
        one_update(Path(folder), device, name, overrides)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(*sys.argv[1:]))
