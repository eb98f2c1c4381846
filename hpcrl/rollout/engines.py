"""Starting the engine ``rollout.engine`` names. The registry is :data:`hpcrl.config.registries.ENGINES` (name ->
the engine's spec: its class, what it needs and supports), which the config checks names against; a backend's
module is imported only when chosen (vLLM is an optional dependency). A new backend is one file behind
:class:`~hpcrl.rollout.engine.Engine` and one entry in that registry."""
from __future__ import annotations

import logging

from hpcrl.config import RunConfig
from hpcrl.config.registries import ENGINES, resolve
from hpcrl.rollout.engine import Engine, EngineOptions, EngineRunner

log = logging.getLogger(__name__)


def make_engine(name: str, opts: EngineOptions, cfg: RunConfig, runner: EngineRunner, timeout_s: float) -> Engine:
    """The engine ``name`` (``rollout.engine``, ``eval.engine``), built by its class from ``opts`` and the run's
    config on the runner's loop (vLLM's AsyncLLM binds to the loop it is created on) within ``timeout_s``; each
    start is logged with its duration."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout.engine {name!r}; allowed: {', '.join(ENGINES)}")
    log.info("starting the %s engine on %s (%s) for %s; waiting up to %.0fs", name, opts.device, opts.dtype,
             opts.model_dir, timeout_s)

    async def build():
        return resolve(ENGINES[name].cls).build(opts, cfg)

    return runner.call(build, timeout_s, f"starting the {name} engine for {opts.model_dir}")
