"""One trainer rank of the layout-equality check (tests/test_trainer_layout.py): ``python tests/layout_peer.py
OUT_DIR SETTING...`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set (gloo on CPU, fp32).

For each setting (overrides of the tiny config), the trainer's own parts (``build_parts``: the real DeepSpeed
engine, the reference, the update) run one update of one mini-batch on groups of mixed lengths (and tool tokens)
with the new layouts; the gradient of that mini-batch is read at DeepSpeed's step (all-reduced over the ranks).
The oracle is the padded whole-logits path (tests/padded_reference.py) on a copy of the model taken before the
update, in one micro-batch of the whole mini-batch, through the same loss code. Rank 0 writes
``OUT_DIR/SETTING.json``: the largest differences of the precomputed fields, the loss and the gradients. The
setting ``zero`` runs one update under ZeRO 0, 2 and 3 with offload instead (:func:`zero_stages`).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

BASE = ["model.path=builtin:tiny-h64", "rollout.n=4", "actor.ppo_mini_batch_size=4", "async_training.require_batches=1",
        "actor.bf16=false", "actor.lr=0.001", "actor.grad_clip=0"]
PACKINGS = {
    "rows1": ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size=1"],
    "rows2-padded": ["actor.use_dynamic_bsz=false", "actor.ppo_micro_batch_size=2", "actor.use_remove_padding=false"],
    "tokens40-chunk1": ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40",
                        "actor.log_prob_max_token_len_per_gpu=30", "actor.logprob_chunk_mib=0.0001"],
    "tokens12-skewed": ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=12"],
    "sp2-tokens30": ["actor.ulysses_sequence_parallel_size=2", "resources.trainer.tasks_per_node=2", "actor.use_dynamic_bsz=true",
                     "actor.ppo_max_token_len_per_gpu=30"],
    "sp2-rows1-ckpt": ["actor.ulysses_sequence_parallel_size=2", "resources.trainer.tasks_per_node=2", "actor.ppo_micro_batch_size=1",
                       "actor.gradient_checkpointing=true", "actor.logprob_chunk_mib=0.0001"],
    "tokens400-ckpt": ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=400",
                       "actor.gradient_checkpointing=true", "actor.logprob_chunk_mib=0.01"],
}
ALGOS = {
    "grpo": [],
    "dapo": ["actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28", "actor.loss_agg_mode=token-mean",
             "actor.entropy_coeff=0.01"],
    "seqmean+kl": ["actor.loss_agg_mode=seq-mean-token-mean", "actor.use_kl_loss=true",
                   "async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_is=token"],
    "gae": ["algorithm.adv_estimator=gae", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "otb": ["algorithm.adv_estimator=optimal_token_baseline", "actor.loss_agg_mode=token-sum"],
    "lora+kl": ["actor.lora_rank=4", "actor.use_kl_loss=true", "actor.lora_dropout=0"],
}


def settings() -> dict[str, list[str]]:
    return {f"{a}/{p}": ALGOS[a] + PACKINGS[p] for a in ALGOS for p in PACKINGS}


def mixed_groups(vocab: int, seed: int = 0, skewed: bool = False):
    """Four groups of four with prompts of 2-7 tokens and responses of 1-40 (tool tokens inside some); ``skewed``:
    one response of 120 tokens and the others of 1-7, so that the rank with the long one runs stand-ins."""
    from hpcrl.samples.schema import Group, Trajectory

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        prompt = rng.integers(3, vocab, size=int(rng.integers(2, 8)))
        trajs = []
        for j in range(4):
            n = int(rng.choice([1, 3, 9, 17, 40])) if not skewed else (120 if g == j == 0 else int(rng.integers(1, 8)))
            mask = np.ones(n, np.int8)
            if n > 5:
                mask[2:4] = 0  # a tool's tokens
            trajs.append(Trajectory(prompt_ids=prompt, response_ids=rng.integers(3, vocab, size=n),
                                    response_mask=mask, logprobs=-rng.random(n).astype(np.float32) * 3,
                                    token_versions=np.zeros(n, np.int32), reward=float(rng.random())))
        groups.append(Group(writer="w000", prompt_index=g, trajectories=trajs, created_s=0.0, finished_s=0.0))
    return groups


class _Beat:
    def update(self, **kw):
        pass

    def write(self):
        pass


class _Shim:
    """What PolicyUpdate reads of a DeepSpeed engine, around the oracle's plain module."""

    def __init__(self, module):
        self.module, self.device, self.global_steps = module, torch.device("cpu"), 0


def grads_at_step(engine) -> dict:
    """The gradients DeepSpeed holds when it steps (after its all-reduce), captured by wrapping its step."""
    seen: dict = {}
    real = engine.step

    def step():
        if engine.is_gradient_accumulation_boundary():
            seen.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        return real()

    engine.step = step
    return seen


def oracle(cfg, model, reference, layout, groups):
    """(prepared batch, loss, gradients) by the padded whole-logits path (module docstring)."""
    from padded_reference import padded_run_model

    from hpcrl.trainer import update
    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.losses import agg_counts

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    real, attention = update.run_model, ALL_ATTENTION_FUNCTIONS["sdpa"]
    update.run_model = padded_run_model
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward  # the oracle runs whole, without Ulysses
    try:
        one = copy.deepcopy(cfg)
        one.actor.use_dynamic_bsz = False
        one.actor.ppo_micro_batch_size = one.actor.ppo_mini_batch_size
        one.actor.ulysses_sequence_parallel_size = 1
        upd = update.PolicyUpdate(one, _Shim(model), dataclasses.replace(layout, sp=1), reference=reference)
        batch = build_batch(groups, layout.pad_id, 0)
        upd.prepare(batch)
        loss, _ = upd._micro_loss(batch, agg_counts(batch.loss_mask), agg_counts(batch.adv_mask))
        loss.backward()
    finally:
        update.run_model, ALL_ATTENTION_FUNCTIONS["sdpa"] = real, attention
    return batch, float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def one_setting(out: Path, name: str, overrides: list[str], rank: int, world: int) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from conftest import make_run
    from hpcrl.control.startup import StartupSteps
    from hpcrl.rundir.paths import RunDir
    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.lora import AdapterOff
    from hpcrl.trainer.parts import build_parts

    folder = out / name.replace("/", "_")
    if rank == 0:
        make_run(folder, *BASE, *overrides, name="run")
    dist.barrier()
    rd = RunDir(folder / "run")
    cfg = rd.load_config()
    torch.manual_seed(0)
    parts, _ = build_parts(cfg, rd, rank, world, StartupSteps(_Beat(), "trainer", 300))
    engine = parts.engine
    model = copy.deepcopy(engine.module)
    model.value_head is None or model.value_head.requires_grad_(True)
    reference = (AdapterOff(model) if cfg.lora else parts.reference) if parts.reference is not None else None
    groups = mixed_groups(engine.module.policy.config.vocab_size, skewed=name.endswith("skewed"))
    seen = grads_at_step(engine)
    batch = build_batch(groups, parts.layout.pad_id, 0)
    plan = parts.updater._plan(batch, cfg.actor.ppo_max_token_len_per_gpu)
    stand_ins = sum(1 for rank in plan for micro in rank if not micro)
    stats = parts.updater.run(batch)
    want, loss, grads = oracle(cfg, model, reference, parts.layout, groups)
    fields = {}
    for f in ("prox_logp", "ref_logp", "old_values", "w_token", "advantages", "loss_mask"):
        a, b = getattr(batch, f), getattr(want, f)
        if a is not None or b is not None:
            fields[f] = float((a - b).abs().max())
    diffs = {n: float((seen[n] - g).abs().max()) for n, g in grads.items()}
    scale = max(float(g.abs().max()) for g in grads.values())
    if parts.lead is not None:
        parts.lead.close()
    if rank == 0:
        (out / f"{name.replace('/', '_')}.json").write_text(json.dumps({
            "fields": fields, "grad_max_diff": max(diffs.values()), "grad_scale": scale, "n_grads": len(diffs),
            "missing": sorted(set(grads) - set(seen)), "stand_ins": stand_ins,
            "ulysses": ALL_ATTENTION_FUNCTIONS["sdpa"].__name__ == "uattn_wrapper", "sp": parts.layout.sp, "pg_loss_new": stats["actor/pg_loss"], "loss_oracle": loss}))
    print(f"{name} rank {rank}: grad diff {max(diffs.values()):.2e} (scale {scale:.2e}), fields {fields}", flush=True)


ZERO_STAGES = {0: [], 2: ["actor.offload_optimizer=true"], 3: ["actor.offload_param=true", "actor.offload_optimizer=true"]}
"""The ZeRO check's stages: the same update under ZeRO 0, ZeRO-2 with optimizer offload and ZeRO-3 (the model
partitioned as it loads) with parameter and optimizer offload and the reference as a ZeRO-3 engine of its own."""


ZERO_BUDGET = "actor.ppo_max_token_len_per_gpu=20"
"""The ZeRO check's budget: with it sdpa cuts some of one rank's micro-batches into two packs where the other rank
runs stand-ins of one."""


def zero_stages(out: Path, rank: int, world: int) -> None:
    """The update of ``seqmean+kl/tokens12-skewed`` at :data:`ZERO_BUDGET` (stand-ins, a reference) under each of
    :data:`ZERO_STAGES`:
    rank 0 writes ``zero.json`` with each stage's gradient norm, policy loss and weights' largest difference from
    ZeRO 0's after the step (DeepSpeed holds no whole gradient to compare under ZeRO 2-3), and each rank's count of
    policy and reference forwards (ZeRO-3 gathers parameters in each: every rank must run as many)."""
    from conftest import make_run
    from hpcrl.control.startup import StartupSteps
    from hpcrl.rundir.paths import RunDir
    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.gather import zero3_state_dict
    from hpcrl.trainer import update as update_module
    from hpcrl.trainer.parts import build_parts

    got = {}
    for stage, extra in ZERO_STAGES.items():
        folder = out / f"zero{stage}"
        if rank == 0:
            make_run(folder, *BASE, *ALGOS["seqmean+kl"], *PACKINGS["tokens12-skewed"], ZERO_BUDGET, f"actor.zero_stage={stage}",
                     *extra, name="run")
        dist.barrier()
        rd = RunDir(folder / "run")
        torch.manual_seed(0)
        parts, _ = build_parts(rd.load_config(), rd, rank, world, StartupSteps(_Beat(), "trainer", 300))
        forwards = []  # this rank's forwards of the policy and of the reference, each micro-batch's after a "|"
        for name, m in (("policy", parts.engine.module), ("reference", parts.reference)):
            m.register_forward_pre_hook(lambda *_, name=name: forwards.append(name))
        run_model = update_module.run_model
        update_module.run_model = lambda *a, **kw: (forwards.append("|"), run_model(*a, **kw))[1]
        stats = parts.updater.run(build_batch(mixed_groups(64, skewed=True), parts.layout.pad_id, 0))
        update_module.run_model = run_model
        every = [None] * world
        dist.all_gather_object(every, forwards)
        stats["forwards_per_rank"] = [len(f) for f in every]
        stats["same_forwards"] = all(f == every[0] for f in every)
        module = parts.engine.module
        weights = zero3_state_dict(module, rank, "")[0] if stage == 3 else module.state_dict()
        if stage == 3:  # more updates: once ZeRO-3 has traced a step, the start of a forward checks the trace with
            # a collective, which a rank that asks how many packs the others run after its own never meets
            for seed in (1, 2):
                parts.updater.run(build_batch(mixed_groups(64, seed=seed, skewed=True), parts.layout.pad_id, 0))
        got[stage] = (stats["actor/grad_norm"], stats["actor/pg_loss"], {k: v.detach().float().clone()
                                                                        for k, v in weights.items()},
                      stats["forwards_per_rank"], stats["same_forwards"])
        if parts.lead is not None:
            parts.lead.close()
    if rank == 0:
        base = got[0][2]
        (out / "zero.json").write_text(json.dumps({str(st): {
            "grad_norm": g, "pg_loss": pg, "weights_max_diff": max(float((w[k] - v).abs().max()) for k, v in base.items()),
            "forwards_per_rank": n, "same_forwards": same} for st, (g, pg, w, n, same) in got.items()}))


def main(out: str, *names: str) -> int:
    logging.basicConfig(level=logging.WARNING)
    from hpcrl.trainer.distributed import init_distributed

    init_distributed(timeout_s=300, arrival_s=60, log_interval_s=30)
    rank, world = dist.get_rank(), dist.get_world_size()
    table = settings()
    for name in names or table:
        if name == "zero":
            zero_stages(Path(out), rank, world)
        else:
            one_setting(Path(out), name, table[name], rank, world)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
