"""Weights between jobs, by role: a publisher (trainer) and a subscriber (every reader), one file per
backend (:mod:`hpcrl.weights.base` is the interface, :mod:`hpcrl.weights.registry` builds one)."""
from hpcrl.weights.base import (Published, WeightPublisher, WeightSubscriber, WeightVersion, WeightVersionBad,
                                WeightVersionGone)
from hpcrl.weights.registry import make_publisher, make_subscriber

__all__ = ["Published", "WeightPublisher", "WeightSubscriber", "WeightVersion", "WeightVersionBad",
           "WeightVersionGone", "make_publisher", "make_subscriber"]
