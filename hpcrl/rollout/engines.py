"""The engine registry: ``rollout.engine`` -> its backend, imported only when chosen (vLLM is an
optional dependency). A new backend is one file behind :class:`~hpcrl.rollout.engine.Engine` and
one line here (and its name in :data:`hpcrl.config.names.ENGINES`)."""
from __future__ import annotations

import logging
from typing import Callable

from hpcrl.rollout.engine import Engine, EngineOptions, EngineRunner

log = logging.getLogger(__name__)


def _transformers(opts: EngineOptions) -> Engine:
    from hpcrl.rollout.transformers_engine import TransformersEngine
    return TransformersEngine(opts)


def _vllm(opts: EngineOptions) -> Engine:
    from hpcrl.rollout.vllm_engine import VLLMEngine
    return VLLMEngine(opts)


def _simulated(opts: EngineOptions) -> Engine:
    from hpcrl.rollout.simulated_engine import SimulatedEngine
    return SimulatedEngine(opts)


ENGINES: dict[str, Callable[[EngineOptions], Engine]] = {"transformers": _transformers, "vllm": _vllm,
                                                         "simulated": _simulated}
"""Engine builder by ``rollout.engine`` (the allowed names: :data:`hpcrl.config.names.ENGINES`).
The backend module is imported only when chosen: vLLM is an optional dependency."""


def make_engine(name: str, opts: EngineOptions, runner: EngineRunner, timeout_s: float) -> Engine:
    """The engine ``rollout.engine`` names, built on the runner's loop (vLLM's AsyncLLM binds to
    the loop it is created on) within ``timeout_s``; each start is logged with its duration."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout.engine {name!r}; allowed: {', '.join(ENGINES)}")
    log.info("starting the %s engine on %s (%s) for %s; waiting up to %.0fs", name, opts.device, opts.dtype,
             opts.model_dir, timeout_s)

    async def build():
        return ENGINES[name](opts)

    return runner.call(build, timeout_s, f"starting the {name} engine for {opts.model_dir}")
