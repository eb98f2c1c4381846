"""``simulated``: the phase model of a simulated run (``rollout.engine=simulated``, ``trainer.simulated``).

A simulated run goes through the real control plane (shards, admission, weight versions, checkpoints)
while the GPU work is replaced by sleeps whose lengths come from this section: a continuous-batching
decode model for the engine (hpcrl/rollout/simulated_engine.py) and a per-token update model for the
trainer (hpcrl/trainer/simulated_update.py). Every time here is in *modelled* seconds (what the GPU
would take); the jobs sleep ``modelled / time_scale`` wall seconds. ``hpcrl plan`` reads the same
numbers. A simulated trainer is refused with a real model (it trains on nothing real); the simulated engine with
a real model and the real trainer is the **sizing probe** (``RunConfig.is_sizing_probe``): random responses of the
model's vocabulary at these lengths, so that the trainer's memory and seconds per token on the real model are
measured before an allocation is spent (``hpcrl plan --probe RUN`` reads them; docs/long-responses.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from hpcrl.config import names, registries
from hpcrl.config.checks import check_float, check_int, fail, reported

LENGTH_DISTRIBUTIONS = ("geometric", "lognormal")
"""``simulated.lengths`` besides ``empirical:RUN`` (the response lengths of a real run's staleness log)."""
EMPIRICAL_PREFIX = "empirical:"


@dataclass
class SimulatedConfig:
    """``simulated``: modelled GPU times of a simulated run (module docstring)."""

    time_scale: float = 1.0
    """Modelled seconds per wall second: 100 runs a 300 s GPU step in 3 s. Every sleep of the simulated engine
    and trainer is divided by it; the logs hold wall seconds (multiply by time_scale for GPU seconds)."""
    decode_base_s: float = 0.02
    """Engine: fixed part of one decoding step (one token for every running sequence)."""
    decode_per_seq_s: float = 0.0001
    """Engine: added to a decoding step per running sequence (at most ``rollout.max_num_seqs`` run)."""
    prefill_per_token_s: float = 0.00002
    """Engine: prefill time per prompt token of a sequence entering the batch (a continuation re-reads
    its prompt and the tokens so far)."""
    kv_cache_tokens: int = 0
    """Engine: KV-cache capacity in tokens (0: no limit). A running sequence holds its prompt and the tokens it
    has so far; a waiting one enters only if the next decoding step still fits, and when a step would not fit
    the newest running sequence is preempted (vLLM's recompute: it waits at the head of the queue and pays
    its prefill again). A real engine's capacity is in vLLM's start-up log ("GPU KV cache size: N tokens")."""
    weight_load_s: float = 1.0
    """Engine: the non-overlappable weight switch: a rollout job loading a new version sleeps this long
    (after the real files or broadcast arrived)."""
    lengths: str = "lognormal"
    """Response lengths (tokens, EOS included), capped by ``rollout.response_length``: ``geometric`` (mean
    ``length_mean``), ``lognormal`` (mean ``length_mean``, log-space sigma ``length_sigma``: a long tail),
    or ``empirical:RUN`` (drawn from the ``n_tokens`` of a real run directory's staleness log,
    ``logs/staleness.jsonl.gz``)."""
    length_mean: float = 256.0
    """Mean response length in tokens before the cap (geometric, lognormal)."""
    length_sigma: float = 1.0
    """lognormal: sigma of log(length); 1.0 puts ~5 % of responses above 4x the median."""
    update_base_s: float = 1.0
    """Trainer (``trainer.simulated``): fixed part of one local update."""
    update_per_token_s: float = 0.0005
    """Trainer: time per trained token on ONE trainer GPU; divided by ``trainer_gpus``."""
    trainer_gpus: int = 1
    """Trainer: GPUs the modelled trainer has (the per-token time is divided by it)."""
    publish_s: float = 0.0
    """Trainer: modelled seconds to gather and write one weight version of the real model (the tiny model's
    version is written for real as well; this is slept on top, inside ``timing_s/param_sync``)."""

    # ---- the phase model (the simulated engine and trainer sleep it, hpcrl plan predicts with it)
    def decode_step_s(self, running: int) -> float:
        """Modelled seconds of one decoding step with ``running`` sequences in the batch."""
        return self.decode_base_s + self.decode_per_seq_s * running

    def kv_admits(self, usage_tokens: int, running: int, context_tokens: int) -> bool:
        """A sequence with ``context_tokens`` (prompt + tokens so far) may join ``running`` sequences holding
        ``usage_tokens`` of KV cache: the next decoding step, one token each, still fits."""
        return self.kv_cache_tokens <= 0 or usage_tokens + context_tokens + running + 1 <= self.kv_cache_tokens

    def kv_steps_left(self, usage_tokens: int, running: int) -> Optional[int]:
        """Decoding steps ``running`` sequences holding ``usage_tokens`` can take before the cache is full (None:
        no limit); at 0 the newest running sequence is preempted."""
        if self.kv_cache_tokens <= 0 or running == 0:
            return None
        return max(0, (self.kv_cache_tokens - usage_tokens) // running)

    def update_model_s(self, n_tokens: int) -> float:
        """Modelled seconds of one local update over ``n_tokens`` trained tokens."""
        return self.update_base_s + self.update_per_token_s * n_tokens / self.trainer_gpus

    def draw_lengths(self, rng: np.random.Generator, count: int, empirical: Optional[np.ndarray] = None) -> np.ndarray:
        """``count`` response lengths (>= 1 token, before any cap); ``empirical``: ``hpcrl.logs.run_logs.read_lengths``."""
        if empirical is not None:
            return rng.choice(empirical, size=count).astype(np.int64)
        if self.lengths == "geometric":
            return rng.geometric(1.0 / self.length_mean, size=count).astype(np.int64)
        mu = math.log(self.length_mean) - self.length_sigma ** 2 / 2  # so that the mean is length_mean
        return np.maximum(1, np.rint(rng.lognormal(mu, self.length_sigma, size=count))).astype(np.int64)

    def validate(self) -> None:
        """Raise ConfigError (the key, what is allowed, the fix) for a value out of range."""
        check_float("simulated.time_scale", self.time_scale, 0.0, lo_open=True)
        for key in ("decode_base_s", "decode_per_seq_s", "prefill_per_token_s", "weight_load_s",
                    "update_base_s", "update_per_token_s", "publish_s"):
            check_float(f"simulated.{key}", getattr(self, key), 0.0)
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            fail("simulated.decode_base_s", self.decode_base_s, "decode_base_s + decode_per_seq_s > 0",
                 "a decoding step must take time, e.g. simulated.decode_base_s=0.02")
        if not (self.lengths in LENGTH_DISTRIBUTIONS
                or (self.lengths.startswith(EMPIRICAL_PREFIX) and len(self.lengths) > len(EMPIRICAL_PREFIX))):
            fail("simulated.lengths", self.lengths, f"{', '.join(LENGTH_DISTRIBUTIONS)} or empirical:RUN_DIR")
        check_float("simulated.length_mean", self.length_mean, 1.0)
        check_float("simulated.length_sigma", self.length_sigma, 0.0)
        check_int("simulated.trainer_gpus", self.trainer_gpus, 1)
        check_int("simulated.kv_cache_tokens", self.kv_cache_tokens, 0)


def empirical_run(spec: str) -> Optional[Path]:
    """The run directory of ``simulated.lengths=empirical:RUN``; None for a named distribution."""
    return Path(spec[len(EMPIRICAL_PREFIX):]).expanduser() if spec.startswith(EMPIRICAL_PREFIX) else None


def check_simulated_combination(cfg) -> None:
    """A simulated part never meets a real one by accident (``cfg`` a RunConfig): a simulated trainer needs a built-in
    tiny model and the simulated engine; the simulated engine with a real model feeds the real trainer (the sizing
    probe: its responses are random tokens of the model's vocabulary, its trainer's memory and seconds real), and
    nothing evaluates it."""
    engine_sim = registries.simulated_engine(cfg.rollout.engine)
    if cfg.trainer.simulated and cfg.model.path not in names.BUILTIN_MODELS:
        fail("model.path", cfg.model.path, f"{' or '.join(names.BUILTIN_MODELS)} with trainer.simulated=true (a "
             "simulated trainer models GPU time and trains on nothing real; with a real model, trainer.simulated="
             "false and rollout.engine=simulated make the sizing probe: docs/long-responses.md)",
             "set model.path=builtin:tiny, or trainer.simulated=false")
    if cfg.trainer.simulated and not engine_sim:
        fail("trainer.simulated", True, f"false with rollout.engine={cfg.rollout.engine} (a simulated trainer "
             "would discard real samples)", "set rollout.engine=simulated, or trainer.simulated=false")
    kv, longest = cfg.simulated.kv_cache_tokens, cfg.rollout.response_length + (cfg.data.max_prompt_length or 1)
    if 0 < kv < longest + 1:
        fail("simulated.kv_cache_tokens", kv, f"0 (no limit) or at least rollout.response_length + "
             f"data.max_prompt_length + 1 = {longest + 1} (one whole sequence must fit, as vLLM refuses a "
             "max_model_len its cache cannot hold)", f"set simulated.kv_cache_tokens={longest + 1} or more")
    eval_sim = registries.simulated_engine(cfg.eval.engine)
    if eval_sim and not engine_sim:
        real = ", ".join(n for n in registries.ENGINES if not registries.simulated_engine(n))
        fail("eval.engine", cfg.eval.engine, f"{real} or null with a real rollout engine",
             "set eval.engine=null (the rollout engine)")
    if (engine_sim or eval_sim) and cfg.eval.enabled and not reported("eval.engine"):
        fail("eval.every_versions", cfg.eval.every_versions, "0 with rollout.engine=simulated (there is "
             "nothing real to evaluate)", "set eval.every_versions=0")
