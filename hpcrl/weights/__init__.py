"""Weight exchange between the trainer and rollout jobs: one interface
(:class:`hpcrl.weights.base.WeightTransport`), one file per backend, chosen by
``weights.transport`` through :func:`make_transport`."""
from __future__ import annotations

from hpcrl.config import WeightsConfig
from hpcrl.run_dir import RunDir
from hpcrl.weights.base import WeightTransport, WeightVersionBad, WeightVersionGone
from hpcrl.weights.filesystem import FilesystemTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {FilesystemTransport.name: FilesystemTransport}
"""``weights.transport`` name -> backend (names: ``hpcrl.config.names.WEIGHT_TRANSPORTS``)."""


def make_transport(cfg: WeightsConfig, run_dir: RunDir) -> WeightTransport:
    """The backend ``cfg.transport`` names, for the run in ``run_dir``."""
    try:
        cls = TRANSPORTS[cfg.transport]
    except KeyError:
        raise ValueError(f"weights.transport={cfg.transport!r} has no backend; allowed: {sorted(TRANSPORTS)} "
                         "(set weights.transport in the run's config)") from None
    return cls.from_config(cfg, run_dir)


__all__ = ["TRANSPORTS", "WeightTransport", "WeightVersionBad", "WeightVersionGone", "make_transport"]
