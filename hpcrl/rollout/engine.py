"""Generation engines. The rollout loop needs only :class:`Engine` and :class:`EngineRunner`.

One file per backend behind this interface, each declared in ``config/registries.py:ENGINES`` by a spec of what
it is and supports: ``transformers_engine.py`` (CPU or GPU, any HF causal LM, the numerical reference),
``vllm_engine.py`` (vLLM's ``AsyncLLM`` in the rollout process: no HTTP server, no Ray) and
``simulated_engine.py`` (no model: sleeps as a GPU would take); ``engines.py`` builds the one ``rollout.engine``
names. The interface is async: vLLM batches the requests that are
in flight together, and :meth:`Engine.abort_all` stops them within about one decoding step,
handing back what each had generated (what partial rollout needs).

The rollout loop is thread-based (one pool thread per group in flight); it reaches the engine
through :class:`EngineRunner`, which owns one asyncio event loop in a daemon thread and waits
for every call with a deadline, so no engine call can hang the job.
"""
from __future__ import annotations

import abc
import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

import numpy as np

if TYPE_CHECKING:  # the launcher imports this interface to check agent loops, without torch
    from hpcrl.weights.base import WeightVersion

log = logging.getLogger(__name__)

FINISH_STOP = "stop"
"""The response ended with EOS (or another stop token)."""
FINISH_LENGTH = "length"
"""The response was cut at ``rollout.response_length`` tokens."""
FINISH_ABORT = "abort"
"""Generation was stopped by :meth:`Engine.abort_all`; the tokens so far are kept."""


@dataclass
class Sample:
    """One generated response."""

    response_ids: np.ndarray
    """Sampled tokens, up to and including EOS if one was sampled."""
    logprobs: np.ndarray
    """Log-prob of each sampled token under the sampling distribution (after temperature, top-p)."""
    finish_reason: str = FINISH_STOP
    """:data:`FINISH_STOP`, :data:`FINISH_LENGTH` or :data:`FINISH_ABORT`."""


@dataclass
class EngineOptions:
    """What every engine reads (``rollout.*``'s sampling fields resolved for this job); a backend takes its own
    fields from the run's config in :meth:`Engine.build`."""

    model_dir: Path
    max_new_tokens: int
    temperature: float
    """0 = greedy decoding (the most likely token; the evaluation's default)."""
    top_p: float
    device: str
    """``cpu`` or ``cuda`` (``rollout.device: auto`` already resolved)."""
    dtype: str
    """``float32``, ``bfloat16`` or ``float16``."""
    seed: int = 0
    top_k: int = -1
    """Sample among the k most likely tokens; -1 or 0 = all."""
    lora_rank: int = 0
    """The largest LoRA rank the engine serves (``actor.lora_rank``): its weight versions are adapters applied to
    the base in ``model_dir``; 0: full-weight versions only."""


class Engine(abc.ABC):
    """What the rollout loop needs from a generation engine (one file per backend, and its
    :class:`~hpcrl.config.registries.EngineSpec` in the registry). Every coroutine runs on the
    :class:`EngineRunner`'s event loop."""

    @classmethod
    def build(cls, opts: EngineOptions, cfg: Any) -> "Engine":
        """The engine a job starts: ``opts`` (the fields every engine reads) and, from ``cfg`` (the
        :class:`~hpcrl.config.RunConfig`), whatever options of its own the backend has; the default has none."""
        return cls(opts)

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], n: int, seed: int,
                       max_new_tokens: Optional[int] = None, greedy: bool = False) -> list[Sample]:
        """``n`` independent responses to one prompt, each at most ``max_new_tokens`` long (None:
        ``rollout.response_length``; a resumed partial response gets what is left of its budget);
        ``seed`` makes them reproducible where the backend allows. Aborted requests return
        their partial tokens (:data:`FINISH_ABORT`). ``greedy``: decode at temperature 0 whatever
        ``rollout.temperature`` says (remax's baseline response, one per group; log-probs untempered)."""

    @abc.abstractmethod
    async def abort_all(self) -> None:
        """Stop every :meth:`generate` in flight within about one decoding step; each returns the
        tokens and log-probs generated so far. New requests are served again afterwards."""

    @abc.abstractmethod
    async def load_weights(self, version: WeightVersion) -> str:
        """Adopt ``version`` (no generation is running): its verified tensors (valid only during the
        call), its pinned folder for engines that load files, its shared-memory buffer for engines whose
        workers map one; a LoRA adapter version (``version.adapter``) is applied to the engine's base model instead.
        Returns how the weights reached the engine (``state_dict``, ``folder``, ``shared_memory``, ``adapter``).
        Raises if the engine could not take them."""

    @property
    def receive_device(self) -> str:
        """Where this engine wants a version's tensors handed to it: ``cpu``, or ``cuda`` for an engine that
        holds its weights on the GPU in this process (then a broadcast may come by NCCL)."""
        return "cpu"

    def close(self) -> None:
        """Release the engine (processes, memory). Safe to call twice."""


class EngineRunner:
    """One asyncio event loop in a daemon thread, shared by the rollout job's threads.

    :meth:`call` runs a coroutine there and waits for it with a deadline; on timeout the
    coroutine is cancelled and TimeoutError names what was waited for.
    """

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
        """Run ``make()`` on the loop; its result, or TimeoutError after ``timeout_s`` naming ``what``."""
        async def run():
            return await make()

        fut = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(f"engine: {what} took longer than {timeout_s:.0f}s") from None

    def close(self) -> None:
        """Stop the loop (calls still running are abandoned)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
