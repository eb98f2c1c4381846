"""The weight backend ``weights.transport`` names, imported only when chosen (a lazy factory outside the interface
file). The registry is :data:`hpcrl.config.registries.WEIGHT_TRANSPORTS` (name -> publisher and subscriber classes),
which the config checks names against: a new backend is one file with a publisher and a subscriber behind
:mod:`hpcrl.weights.base` and one line in that registry."""
from __future__ import annotations

from typing import Optional

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.config.registries import WEIGHT_TRANSPORTS, resolve
from hpcrl.run_dir import RunDir
from hpcrl.weights.base import WeightPublisher, WeightSubscriber


def _backend(cfg: WeightsConfig, side: int):
    try:
        classes = WEIGHT_TRANSPORTS[cfg.transport]
    except KeyError:
        raise ValueError(f"weights.transport={cfg.transport!r} has no backend; allowed: {sorted(WEIGHT_TRANSPORTS)} "
                         "(set weights.transport in the run's config)") from None
    return resolve(classes[side])


def make_publisher(cfg: WeightsConfig, run_dir: RunDir, timeouts: Optional[TimeoutsConfig] = None) -> WeightPublisher:
    """The trainer's publisher for the run in ``run_dir`` (``timeouts``: the run's; defaults otherwise)."""
    return _backend(cfg, 0).from_config(cfg, run_dir, timeouts or TimeoutsConfig())


def make_subscriber(cfg: WeightsConfig, run_dir: RunDir, reader: str, timeouts: Optional[TimeoutsConfig] = None,
                    device: str = "cpu") -> WeightSubscriber:
    """A subscriber named ``reader`` (a rollout job's writer name, ``eval``, ...) that follows the versions of the
    run in ``run_dir``; ``device`` is where its engine wants the tensors (``cuda``: it can take NCCL)."""
    return _backend(cfg, 1).from_config(cfg, run_dir, reader, timeouts or TimeoutsConfig(), device)
