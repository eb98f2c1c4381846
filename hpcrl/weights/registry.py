"""The weight backends by ``weights.transport``, each imported only when chosen (a lazy factory outside
the interface file). A new backend is one file with a publisher and a subscriber behind
:mod:`hpcrl.weights.base`, one line here, and its name in :data:`hpcrl.config.names.WEIGHT_TRANSPORTS`."""
from __future__ import annotations

import importlib
from typing import Optional

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.run_dir import RunDir
from hpcrl.weights.base import WeightPublisher, WeightSubscriber

BACKENDS: dict[str, tuple[str, str, str]] = {
    "filesystem": ("hpcrl.weights.filesystem", "FilesystemPublisher", "FilesystemSubscriber"),
    "broadcast": ("hpcrl.weights.broadcast", "BroadcastPublisher", "BroadcastSubscriber"),
    "auto": ("hpcrl.weights.broadcast", "BroadcastPublisher", "BroadcastSubscriber"),
}
"""``weights.transport`` -> (module, publisher class, subscriber class). ``broadcast`` and ``auto`` share a
backend: ``broadcast`` fails where the broadcast cannot form, ``auto`` falls back to files."""


def _backend(cfg: WeightsConfig, side: int):
    try:
        module, *classes = BACKENDS[cfg.transport]
    except KeyError:
        raise ValueError(f"weights.transport={cfg.transport!r} has no backend; allowed: {sorted(BACKENDS)} "
                         "(set weights.transport in the run's config)") from None
    return getattr(importlib.import_module(module), classes[side])


def make_publisher(cfg: WeightsConfig, run_dir: RunDir, timeouts: Optional[TimeoutsConfig] = None) -> WeightPublisher:
    """The trainer's publisher for the run in ``run_dir`` (``timeouts``: the run's; defaults otherwise)."""
    return _backend(cfg, 0).from_config(cfg, run_dir, timeouts or TimeoutsConfig())


def make_subscriber(cfg: WeightsConfig, run_dir: RunDir, reader: str, timeouts: Optional[TimeoutsConfig] = None,
                    device: str = "cpu") -> WeightSubscriber:
    """A subscriber named ``reader`` (a rollout job's writer name, ``eval``, ...) that follows the versions of the
    run in ``run_dir``; ``device`` is where its engine wants the tensors (``cuda``: it can take NCCL)."""
    return _backend(cfg, 1).from_config(cfg, run_dir, reader, timeouts or TimeoutsConfig(), device)
