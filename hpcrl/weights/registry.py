"""The weight store with the transport ``weights.transport`` names, its sender or receiver imported only when chosen
(a lazy factory outside the interface file). The registry is :data:`hpcrl.config.registries.WEIGHT_TRANSPORTS` (name
-> the transport's sender and receiver classes, none for files alone), which the config checks names against: a new
transport is one file with a sender and a receiver behind :mod:`hpcrl.weights.transport` and one entry in that
registry; it inherits the store's commit, retention, withdrawal, bad markers, pins and deltas."""
from __future__ import annotations

from typing import Optional

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.config.registries import WEIGHT_TRANSPORTS, TransportSpec, resolve
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.publisher import WeightPublisher, delta_writer
from hpcrl.weights.subscriber import WeightSubscriber


def _spec(cfg: WeightsConfig) -> TransportSpec:
    try:
        return WEIGHT_TRANSPORTS[cfg.transport]
    except KeyError:
        raise ValueError(f"weights.transport={cfg.transport!r} has no backend; allowed: {sorted(WEIGHT_TRANSPORTS)} "
                         "(set weights.transport in the run's config)") from None


def make_publisher(cfg: WeightsConfig, run_dir: RunDir, timeouts: Optional[TimeoutsConfig] = None) -> WeightPublisher:
    """The trainer's publisher for the run in ``run_dir`` (``timeouts``: the run's; defaults otherwise)."""
    spec = _spec(cfg)
    sender = resolve(spec.sender).from_config(cfg, run_dir, timeouts or TimeoutsConfig()) if spec.sender else None
    return WeightPublisher(run_dir, cfg.keep_versions, deltas=delta_writer(cfg), sender=sender)


def make_subscriber(cfg: WeightsConfig, run_dir: RunDir, reader: str, timeouts: Optional[TimeoutsConfig] = None,
                    device: str = "cpu") -> WeightSubscriber:
    """A subscriber named ``reader`` (a rollout job's writer name, ``eval``, ...) that follows the versions of the
    run in ``run_dir``; ``device`` is where its engine wants the tensors (``cuda``: a transport may deliver there)."""
    spec = _spec(cfg)
    receiver = resolve(spec.receiver).from_config(cfg, run_dir, reader, timeouts or TimeoutsConfig(), device) \
        if spec.receiver else None
    return WeightSubscriber(run_dir, reader, keep_bases=cfg.delta, receiver=receiver)
