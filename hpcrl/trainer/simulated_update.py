"""The simulated update (``trainer.simulated``): one local update's GPU time, slept, not computed.

It stands where :class:`hpcrl.trainer.update.PolicyUpdate` stands (``run(batch) -> metrics``,
``kl_coef``), so the trainer's loop, its reading of samples, admission, publishing and checkpoints
are the real ones; only the arithmetic of the update is replaced by a sleep of ``simulated.update_base_s
+ simulated.update_per_token_s * tokens / simulated.trainer_gpus`` modelled seconds, divided by
``simulated.time_scale``. The policy's weights do not change: every published version holds the tiny
model's weights (real files, real hashes, a real broadcast), which is what the rollout side takes.
"""
from __future__ import annotations

import logging
import time

from hpcrl.logs import metric_names as M
from hpcrl.config.simulated import SimulatedConfig
from hpcrl.trainer.batch import Batch

log = logging.getLogger("hpcrl.trainer.simulated")


class SimulatedUpdate:
    """A local update that sleeps as long as the modelled GPU update would take (module docstring)."""

    def __init__(self, sim: SimulatedConfig):
        self.sim = sim
        self.kl_coef = 0.0
        """No KL controller: nothing is trained (kept for the checkpoint, as PolicyUpdate's)."""
        log.info("simulated trainer: no update is computed; each takes %.3fs + %.2gs/token / %d GPUs (modelled "
                 "seconds), time_scale %g", sim.update_base_s, sim.update_per_token_s, sim.trainer_gpus,
                 sim.time_scale)

    def run(self, batch: Batch) -> dict:
        """Sleep the modelled update time of ``batch``; the batch's own statistics, as a real update logs them."""
        n_tokens = int(batch.n_tokens)
        model_s = self.sim.update_model_s(n_tokens)
        time.sleep(model_s / self.sim.time_scale)
        rewards = batch.rewards.float()
        return {M.REWARD_MEAN: float(rewards.mean()), "reward/std": float(rewards.std()) if len(batch) > 1 else 0.0,
                "response_length/mean": float(batch.mask.sum(1).float().mean()), M.N_TOKENS: n_tokens,
                M.SIMULATED_UPDATE_MODEL_S: model_s}

    def after_publish(self) -> None:
        """Sleep the modelled publish time of the real model (``simulated.publish_s``) after the tiny model's
        version was written, so it counts in the trainer's ``timing_s/param_sync``."""
        time.sleep(self.sim.publish_s / self.sim.time_scale)
