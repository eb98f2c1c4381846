"""Trainer checkpoints: model + optimizer + sample cursor + log offsets, together.

``checkpoints/step-00000040/`` is written by DeepSpeed through
:class:`SafeCheckpointEngine` (safetensors + JSON, never pickle); our state rides
in DeepSpeed's ``client_state``. Only after DeepSpeed returns is
``checkpoints/latest.json`` replaced (tmp -> fsync -> rename): a trainer killed
mid-save resumes from the previous complete checkpoint. Older tags are deleted
only after the new ``latest.json`` is durable.
"""
from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass, field
from typing import Optional

from hpcrl.control.records import LatestCheckpoint, read_latest_checkpoint
from hpcrl.fsio import write_json_atomic
from hpcrl.json_record import JsonRecord
from hpcrl.run_dir import RunDir

log = logging.getLogger(__name__)

_TAG_RE = re.compile(r"^step-(\d{8})$")


@dataclass
class TrainerState(JsonRecord):
    """What the trainer must know to continue exactly (saved in every checkpoint)."""

    step: int = 0
    """Local updates done."""
    param_version: int = 0
    """Newest published weight version."""
    consumed_groups: int = 0
    """Groups consumed (trained, dropped or skipped as corrupt)."""
    cursor: dict = field(default_factory=dict)
    """SampleReader cursor: {writer: {"line", "row"}}."""
    metrics_bytes: int = 0
    """Size of logs/metrics.jsonl at this checkpoint (rolled back to on resume)."""
    staleness_bytes: int = 0
    """Size of logs/staleness.jsonl at this checkpoint."""
    counters: dict = field(default_factory=dict)
    """Cumulative metric counters (stale samples processed, dropped, ...)."""
    kl_coef: Optional[float] = None
    """Reward-KL coefficient beta after the last update (the adaptive controller's state;
    None = not started, take algorithm.kl_ctrl.kl_coef)."""



def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def save(engine, run_dir: RunDir, state: TrainerState, keep: int) -> str:
    tag = tag_for(state.step)
    engine.save_checkpoint(str(run_dir.checkpoints), tag=tag, client_state={"hpcrl": state.to_json()},
                           save_latest=False)
    if engine.global_rank == 0:
        write_json_atomic(run_dir.latest_checkpoint, LatestCheckpoint(tag, state.step).to_json())
        tags = sorted(p.name for p in run_dir.checkpoints.iterdir() if _TAG_RE.match(p.name))
        for old in tags[:-keep]:
            shutil.rmtree(run_dir.checkpoints / old, ignore_errors=True)
    return tag


def load_latest(engine, run_dir: RunDir) -> Optional[TrainerState]:
    latest = read_latest_checkpoint(run_dir)
    if latest is None:
        return None
    tag = latest.tag
    path, client = engine.load_checkpoint(str(run_dir.checkpoints), tag=tag, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"checkpoint {run_dir.checkpoints / tag} named by {run_dir.latest_checkpoint} "
                           "could not be loaded; remove latest.json to start over, or restore the folder")
    state = TrainerState.from_json(client["hpcrl"], f"the trainer state in checkpoint {tag}")
    log.info("resumed from %s: step %d, version %d, %d groups consumed", tag, state.step, state.param_version,
             state.consumed_groups)
    return state
