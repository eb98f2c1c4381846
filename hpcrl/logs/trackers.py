"""Experiment trackers: the trainer's metrics rows also go to TensorBoard and W&B.

``logging.backends`` picks them; ``jsonl`` (``logs/metrics.jsonl``) is always written and
stays the source of truth for ``hpcrl report``/``status``. Each tracker gets the same row
under the same names (verl's where they exist), with ``step`` as the x axis, through its own
library: ``torch.utils.tensorboard.SummaryWriter`` (event files in ``logs/tensorboard/``)
and ``wandb`` (``logs/wandb/``; ``logging.wandb_mode=offline`` needs no network, upload
later with ``wandb sync RUN/logs/wandb/offline-run-*``). Only trainer rank 0 writes.

The evaluation job (``role="eval"``) writes its validation metrics the same way, at the trainer step of
the version it evaluated, into folders of its own (one writer per folder): ``logs/tensorboard/eval/`` (a
TensorBoard run named ``eval`` beside the trainer's under ``--logdir RUN/logs/tensorboard``) and a W&B run
``<name>-eval`` in the trainer run's group, under ``logs/eval/wandb/`` (W&B allows one writer per run, and
the trainer's may be long gone when the last version is evaluated).

A tracker that fails to start is a warning, never a stopped run: the JSONL log has it all.
"""
from __future__ import annotations

import hashlib
import logging
import math
from typing import Optional

from hpcrl.config import RunConfig
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)


def _numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v))}


class Trackers:
    """The trackers of ``logging.backends`` other than jsonl; :meth:`log` sends one metrics row to each."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, role: str = "trainer"):
        """``role``: ``trainer`` or ``eval`` (module docstring)."""
        self._tb = None
        self._wandb = None
        backends = set(cfg.logging.backends)
        trainer = role == "trainer"
        own = "" if trainer else f"-{role}"
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir.tensorboard if trainer else run_dir.eval_tensorboard))
        if "wandb" in backends:
            import wandb

            run_id = hashlib.sha256(str(run_dir.root).encode()).hexdigest()[:12] + own  # a resumed run continues it
            folder = run_dir.wandb_init_dir if trainer else run_dir.eval_wandb_init_dir
            folder.mkdir(parents=True, exist_ok=True)
            name = cfg.logging.experiment_name or run_dir.root.name
            self._wandb = wandb.init(project=cfg.logging.project, name=name + own, group=name, job_type=role,
                                     id=run_id, resume="allow", dir=str(folder),
                                     mode=cfg.logging.wandb_mode, config=cfg.to_dict(),
                                     settings=wandb.Settings(console="off", silent=True))

    def log(self, row: dict) -> None:
        """One metrics row (numbers only), at x = its ``step``."""
        step = int(row.get("step", 0))
        values = _numbers(row)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """Flush and close every tracker."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def open_trackers(cfg: RunConfig, run_dir: RunDir, role: str = "trainer") -> Optional[Trackers]:
    """The run's trackers for ``role`` (``trainer``, ``eval``), or None when logging.backends asks only for jsonl
    (or none could start)."""
    if not set(cfg.logging.backends) - {"jsonl"}:
        return None
    try:
        return Trackers(cfg, run_dir, role)
    except Exception as e:  # noqa: BLE001 - a missing package or a W&B login must not stop training
        log.warning("logging.backends %s could not start (%s: %s); metrics go to %s only",
                    cfg.logging.backends, type(e).__name__, e, run_dir.metrics)
        return None
