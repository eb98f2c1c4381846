"""Weights between jobs, by role: the store's publisher (trainer) and subscriber (every reader), with the run's
transport as their fast path (:mod:`hpcrl.weights.transport` is its interface, one file per transport;
:mod:`hpcrl.weights.registry` builds them).

These names are imported on first use: the launcher reads the torch-free modules of this package (adapter,
manifest, file_hash) on a login node, where importing torch, which publishers and subscribers need, costs seconds."""
from __future__ import annotations

import importlib

_MODULE_OF = {"Published": "base", "WeightPublisher": "publisher", "WeightSubscriber": "subscriber",
              "WeightVersion": "base",
              "WeightVersionBad": "base", "WeightVersionGone": "base", "make_publisher": "registry",
              "make_subscriber": "registry"}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
