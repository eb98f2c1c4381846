"""Everything a trainer rank builds once, before its loop: :class:`TrainerParts`, and on rank 0 also
:class:`LeadParts` (the run directory's readers and writers: only rank 0 reads samples, writes logs
and publishes weights).

Built in one place (:func:`build_parts`), in this order: the policy (and value head) under DeepSpeed,
the frozen reference if a KL term needs it, the newest checkpoint if there is one (every rank), then
on rank 0 the resume of the run directory (versions published after the checkpoint withdrawn, logs
cut back to it) and its readers and writers from the checkpoint's cursor, and last the update whose
KL controller continues from the checkpoint (``trainer.simulated``: the simulated update, which only sleeps). Nothing is attached to the job later.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hpcrl.config import RunConfig
from hpcrl.config.registries import estimator_spec
from hpcrl.control.fatal import fatal_inputs
from hpcrl.control.startup import StartupSteps
from hpcrl.logs.run_logs import MetricsLog, StalenessLog, truncate_to
from hpcrl.rundir.paths import WEIGHT_MODEL_FILES, RunDir
from hpcrl.samples.reader import SampleReader
from hpcrl.samples.skips import SkipLog
from hpcrl.logs.trackers import open_trackers
from hpcrl.trainer import build, checkpoint, sequence_parallel
from hpcrl.trainer.forward import Layout
from hpcrl.trainer.lora import AdapterOff, adapter_config_json, wrap_policy
from hpcrl.trainer.models import PolicyWithValueHead
from hpcrl.trainer.simulated_update import SimulatedUpdate
from hpcrl.trainer.update import PolicyUpdate
from hpcrl.weights import WeightPublisher, make_publisher
from hpcrl.weights.adapter import base_model_hash, verify_base
from hpcrl.weights.manifest import AdapterBase

log = logging.getLogger("hpcrl.trainer")


@dataclass
class LeadParts:
    """Rank 0's parts: the run directory's readers and writers."""

    weights: WeightPublisher
    reader: SampleReader
    """Committed groups, from the checkpoint's cursor on."""
    metrics: MetricsLog
    """``logs/metrics.jsonl`` (and the trackers): one row per update."""
    staleness: StalenessLog
    """``logs/staleness.jsonl``: one row per consumed trajectory."""

    def close(self) -> None:
        """Stop the publisher's threads (bounded)."""
        self.weights.close()


@dataclass
class TrainerParts:
    """What one trainer rank holds for its whole life (module docstring)."""

    engine: Any
    """The DeepSpeed engine around the policy (and value head)."""
    reference: Optional[torch.nn.Module]
    """The frozen initial policy, when a KL term needs it (a LoRA run: the policy with its adapter off)."""
    model_config_json: str
    """The policy's ``config.json``, written with every published version (a LoRA run: peft's
    ``adapter_config.json``)."""
    model_files: dict[str, bytes]
    """The model folder's tokenizer, chat template and generation config (:data:`WEIGHT_MODEL_FILES` it has),
    written with every published version so that each is a complete Hugging Face folder (none in a LoRA run: a
    version is the adapter alone)."""
    layout: Layout
    """How micro-batches reach the model: packing, attention kernel, pad id, log-prob chunk
    (``hpcrl/trainer/forward.py``)."""
    updater: PolicyUpdate | SimulatedUpdate
    """The update's arithmetic (``trainer.simulated``: a sleep of the modelled time, nothing computed)."""
    adapter_base: Optional[AdapterBase]
    """A LoRA run: the base every published adapter version names (its path and weight hash); None: full weights."""
    lead: Optional[LeadParts]
    """Rank 0 only; None on the other ranks."""

    def close(self) -> None:
        """Release what has threads of its own (rank 0's publisher)."""
        if self.lead is not None:
            self.lead.close()


def _deepspeed(cfg: RunConfig, run_dir: RunDir, rank: int, world: int):
    """The policy (and value head) under DeepSpeed (hpcrl/trainer/build.py); its config.json, pad id and the layout
    of its micro-batches."""
    import deepspeed

    from hpcrl.trainer.safe_checkpoint import SafeCheckpointEngine

    actor, cuda = cfg.actor, torch.cuda.is_available()
    config = build.ds_config(actor, cuda)
    attn = build.attention_kernel(actor, cuda)
    path = run_dir.model_dir(cfg.model.path)
    with fatal_inputs(run_dir, RunDir.trainer_job(rank), f"loading the model {path}", "model"):
        verify_base(path, cfg.model.base_hash)  # LoRA: the adapters belong to this base
        policy = build.load_causal_lm(path, build.training_dtype(actor, cuda), attn,
                                       config if actor.zero_stage == 3 else None)
    config_json = policy.config.to_json_string()
    layout = build.layout_of(actor, policy.config, attn, world)
    mpu = sequence_parallel.register(policy, attn, actor.ulysses_sequence_parallel_size)
    if actor.gradient_checkpointing:
        build.checkpoint_layers(policy)
    if cfg.lora:  # only the adapter is trained (hpcrl/trainer/lora.py)
        policy = wrap_policy(policy, actor, cfg.model.seed)
        config_json = adapter_config_json(policy, str(path))
    model = PolicyWithValueHead(policy, value_head=estimator_spec(cfg.algorithm.adv_estimator).values)
    model.train()  # transformers loads in eval mode, where it skips the layers' checkpointing (and LoRA's dropout)
    groups = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": actor.lr}]
    if model.value_head is not None:
        groups.append({"params": list(model.value_head.parameters()), "lr": cfg.critic.lr})
    optimizer = torch.optim.AdamW(groups, lr=actor.lr, weight_decay=actor.weight_decay)
    ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    ds.checkpoint_engine = SafeCheckpointEngine()
    log.info("trainer model: %s, attention %s, %s micro-batches%s%s, ZeRO %d%s", build.training_dtype(actor, cuda),
             attn, f"{actor.ppo_max_token_len_per_gpu}-token" if actor.use_dynamic_bsz else
             f"{actor.ppo_micro_batch_size}-group", " packed" if actor.use_remove_padding else " padded",
             ", checkpointed layers" if actor.gradient_checkpointing else "", actor.zero_stage,
             "".join(f", {k} offloaded" for k, on in (("parameters", actor.offload_param),
                                                      ("optimizer", actor.offload_optimizer)) if on)
             + (f", sequences over {layout.sp} ranks (Ulysses)" if layout.sp > 1 else ""))
    return ds, config_json, layout


def _lead(cfg: RunConfig, run_dir: RunDir, resumed: Optional[checkpoint.TrainerState]) -> LeadParts:
    """Rank 0: bring the run directory back to the checkpoint (or to a fresh start), then open its readers
    and writers there."""
    weights = make_publisher(cfg.weights, run_dir, cfg.timeouts)
    if resumed is None:
        # A fresh start: anything published by an earlier attempt that died before its first checkpoint
        # belongs to a model we no longer have.
        weights.withdraw_after(-1)
        truncate_to(run_dir.metrics, 0)
        truncate_to(run_dir.staleness, 0)
    else:
        weights.withdraw_after(resumed.param_version)
        truncate_to(run_dir.metrics, resumed.metrics_bytes)
        truncate_to(run_dir.staleness, resumed.staleness_bytes)
    weights.start()  # a resumed trainer announces its broadcast now, not at its first publish
    cursor = resumed.cursor if resumed is not None else {}
    return LeadParts(weights=weights, reader=SampleReader(run_dir, cursor=cursor, skip_log=SkipLog(run_dir)),
                     metrics=MetricsLog(run_dir.metrics, trackers=open_trackers(cfg, run_dir)),
                     staleness=StalenessLog(run_dir))


def build_parts(cfg: RunConfig, run_dir: RunDir, rank: int, world: int, steps: StartupSteps
                ) -> tuple[TrainerParts, Optional[checkpoint.TrainerState]]:
    """Every part of trainer rank ``rank`` of ``world``, each slow part a start-up step of ``steps``, and the
    checkpointed state it resumes from (None: a fresh start)."""
    torch.manual_seed(cfg.model.seed)
    torch.set_num_threads(cfg.trainer.torch_threads)
    with steps.step(f"loading the model {cfg.model.path} and initialising DeepSpeed"):
        ds, config_json, layout = _deepspeed(cfg, run_dir, rank, world)
        reference = _reference(cfg, run_dir, ds) if cfg.needs_reference else None
    with steps.step("loading the newest checkpoint"):
        resumed = checkpoint.load_latest(ds, run_dir, adapter_only=cfg.lora)
    with steps.step("bringing the run directory to the checkpoint"):
        lead = _lead(cfg, run_dir, resumed) if rank == 0 else None
    kl_coef = resumed.kl_coef if resumed is not None else None
    updater = (SimulatedUpdate(cfg.simulated) if cfg.trainer.simulated
               else PolicyUpdate(cfg, ds, layout, reference, kl_coef, rank=rank, world=world))
    files = {} if cfg.lora else model_files(run_dir.model_dir(cfg.model.path))  # an adapter version: the adapter only
    return TrainerParts(ds, reference, config_json, files, layout, updater,
                        _adapter_base(cfg, run_dir) if rank == 0 else None, lead), resumed


def _adapter_base(cfg: RunConfig, run_dir: RunDir) -> Optional[AdapterBase]:
    """The base a LoRA run's versions name: ``model.base_hash`` (the launcher writes it), else hashed here."""
    if not cfg.lora:
        return None
    path = run_dir.model_dir(cfg.model.path)
    if cfg.model.base_hash is None:
        log.warning("model.base_hash is not in the run's config (a run not started by the launcher): hashing %s", path)
    return AdapterBase(path=str(path), hash=cfg.model.base_hash or base_model_hash(path))


def _reference(cfg: RunConfig, run_dir: RunDir, policy_engine) -> torch.nn.Module:
    """The KL reference, run like the policy (no value head): the base model in the training dtype, under ZeRO-3 a
    partitioned engine of its own; in a LoRA run the trainer's own model with the adapter off (no copy)."""
    if cfg.lora:
        return AdapterOff(policy_engine.module)
    cuda = torch.cuda.is_available()
    base = build.load_causal_lm(run_dir.model_dir(cfg.model.path), build.training_dtype(cfg.actor, cuda),
                                 build.attention_kernel(cfg.actor, cuda),
                                 build.ds_config(cfg.actor, cuda) if cfg.actor.zero_stage == 3 else None)
    return build.frozen_engine(PolicyWithValueHead(base.to(policy_engine.device), value_head=False), cfg.actor, cuda)


def model_files(folder) -> dict[str, bytes]:
    """The files of :data:`WEIGHT_MODEL_FILES` that the model folder has, by name (read once, at start)."""
    return {name: (folder / name).read_bytes() for name in WEIGHT_MODEL_FILES if (folder / name).is_file()}
