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
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Optional

from hpcrl.control.records import LatestCheckpoint, read_latest_checkpoint
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.rundir.disk import free_bytes, guarded, make_dirs, size_text, tree_bytes, wait_for_room
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.rundir.paths import RunDir

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
    """Size of the staleness log (``RunDir.staleness``) at this checkpoint."""
    counters: dict = field(default_factory=dict)
    """Cumulative metric counters (stale samples processed, dropped, ...)."""
    kl_coef: Optional[float] = None
    """Reward-KL coefficient beta after the last update (the adaptive controller's state;
    None = not started, take algorithm.kl_ctrl.kl_coef)."""



def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def save(engine, run_dir: RunDir, state: TrainerState, keep: int, adapter_only: bool = False) -> str:
    """Checkpoint ``state`` with the engine's model and optimizer as tag ``step-<step>``, then ``latest.json``, then
    delete all but the newest ``keep``; ``adapter_only`` (a LoRA run): without the frozen base weights (``model.path``
    has them). A full disk is met before DeepSpeed writes anything: with less room free
    than the newest checkpoint took, the oldest one beyond the newest goes first, then the save waits for room
    (``disk.wait_for_room``: timeouts.disk_full_s); each file is written through ``disk.guarded``."""
    tag = tag_for(state.step)
    need = _make_room(run_dir, keep)
    wait_for_room(f"checkpoint {tag}", run_dir.checkpoints, need)
    folder = run_dir.checkpoints / tag
    make_dirs(folder)

    def save_all() -> None:
        engine.save_checkpoint(str(run_dir.checkpoints), tag=tag, client_state={"hpcrl": state.to_json()},
                               save_latest=False, exclude_frozen_parameters=adapter_only)
    if engine.world_size == 1:  # one rank: a failed save (DeepSpeed copies files of its own too) can be done again
        guarded(f"checkpoint {tag}", folder, need, save_all, undo=lambda: shutil.rmtree(folder, ignore_errors=True))
    else:  # several ranks save collectively: only each file's own write waits (SafeCheckpointEngine)
        save_all()
    if engine.global_rank == 0:
        write_json_atomic(run_dir.latest_checkpoint, LatestCheckpoint(tag, state.step).to_json())
        for old in _tags(run_dir)[:-keep]:
            _delete(run_dir, old)
        free, _ = free_bytes(run_dir.checkpoints)
        size = tree_bytes(run_dir.checkpoints / tag)
        if free < size:
            log.warning("only %s free on the run directory's filesystem, less than the next checkpoint needs (%s, "
                        "as %s): free space, or keep fewer (trainer.keep_checkpoints, weights.keep_versions)",
                        size_text(free), size_text(size), tag)
    return tag


def _tags(run_dir: RunDir) -> list[str]:
    """Checkpoint tags on disk, oldest first."""
    if not run_dir.checkpoints.is_dir():
        return []
    return sorted(p.name for p in run_dir.checkpoints.iterdir() if _TAG_RE.match(p.name))


def _make_room(run_dir: RunDir, keep: int) -> int:
    """Bytes the next checkpoint needs (as the newest one took); if less is free and an older checkpoint than the
    newest is kept, delete the oldest first (the newest, which latest.json names, always stays)."""
    tags = _tags(run_dir)
    need = tree_bytes(run_dir.checkpoints / tags[-1]) if tags else 0
    free, _ = free_bytes(run_dir.checkpoints)
    while free < need and len(tags) >= 2 and len(tags) >= keep:
        log.warning("%s free, the next checkpoint needs %s: deleting the oldest checkpoint %s first",
                    size_text(free), size_text(need), tags[0])
        _delete(run_dir, tags.pop(0))
        free, _ = free_bytes(run_dir.checkpoints)
    return need


def _delete(run_dir: RunDir, tag: str) -> None:
    """Remove a checkpoint so that no half of it is ever taken for one: renamed out of the tag pattern first."""
    folder = run_dir.checkpoints / tag
    doomed = RunDir.doomed(folder)
    try:
        os.replace(folder, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def sweep(run_dir: RunDir, latest: Optional[str]) -> list[str]:
    """Rank 0 at start: remove what a trainer killed mid-save or mid-removal left (a tag newer than ``latest``, the
    one ``latest.json`` names, was never completed; a ``.deleting`` folder was being removed), one log line each."""
    removed = []
    for p in sorted(run_dir.checkpoints.iterdir()) if run_dir.checkpoints.is_dir() else []:
        half_removed = RunDir.doomed(p.with_suffix("")) == p
        unfinished = _TAG_RE.match(p.name) and (latest is None or p.name > latest)
        if p.is_dir() and (half_removed or unfinished):
            log.warning("start-up sweep: removing %s, %s", p,
                        "left half-removed" if half_removed else "a save that never completed (not in latest.json)")
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def load_latest(engine, run_dir: RunDir, adapter_only: bool = False) -> Optional[TrainerState]:
    """The newest checkpoint into ``engine``, and our state in it; None if there is none. ``adapter_only`` (a LoRA
    run): the checkpoint has no frozen weights (loaded non-strictly; ``model.path`` has them)."""
    latest = read_latest_checkpoint(run_dir)
    if engine.global_rank == 0:
        sweep(run_dir, latest.tag if latest is not None else None)
    if latest is None:
        return None
    tag = latest.tag
    path, client = engine.load_checkpoint(str(run_dir.checkpoints), tag=tag, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_strict=not adapter_only)
    if path is None:
        raise RuntimeError(f"checkpoint {run_dir.checkpoints / tag} named by {run_dir.latest_checkpoint} "
                           "could not be loaded; remove latest.json to start over, or restore the folder")
    state = TrainerState.from_json(client["hpcrl"], f"the trainer state in checkpoint {tag}")
    log.info("resumed from %s: step %d, version %d, %d groups consumed", tag, state.step, state.param_version,
             state.consumed_groups)
    return state
