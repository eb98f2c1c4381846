"""Weight exchange between the trainer and rollout jobs: one interface
(:class:`hpcrl.weights.base.WeightTransport`), one file per backend, chosen by
``weights.transport`` through :func:`make_transport`."""
from __future__ import annotations

from typing import Optional

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.run_dir import RunDir
from hpcrl.weights.base import WeightTransport, WeightVersionBad, WeightVersionGone
from hpcrl.weights.broadcast import AutoTransport, BroadcastTransport
from hpcrl.weights.filesystem import FilesystemTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {t.name: t for t in (FilesystemTransport, BroadcastTransport,
                                                                    AutoTransport)}
"""``weights.transport`` name -> backend (names: ``hpcrl.config.names.WEIGHT_TRANSPORTS``)."""


def make_transport(cfg: WeightsConfig, run_dir: RunDir, timeouts: Optional[TimeoutsConfig] = None) -> WeightTransport:
    """The backend ``cfg.transport`` names, for the run in ``run_dir`` (``timeouts``: the run's, for the
    broadcast's deadlines; defaults otherwise)."""
    try:
        cls = TRANSPORTS[cfg.transport]
    except KeyError:
        raise ValueError(f"weights.transport={cfg.transport!r} has no backend; allowed: {sorted(TRANSPORTS)} "
                         "(set weights.transport in the run's config)") from None
    return cls.from_config(cfg, run_dir, timeouts)


__all__ = ["TRANSPORTS", "WeightTransport", "WeightVersionBad", "WeightVersionGone", "make_transport"]
