"""Typed run configuration: the bottom layer every job and the launcher build on.

A config is a YAML file (``configs/*.yaml``) plus dotted overrides; it is checked
whole before anything is created or submitted, then frozen into ``RUN/config.yaml``.

=================  ==============================================================
module             what it holds
=================  ==============================================================
``names``          the names a field may choose from (estimators, ...), renamed and verl keys
``registries``     name -> implementation ("module:attribute") of engines, loops, parsers, weight transports,
                   rewards and policy losses: the config checks names against them, the jobs import from them
``checks``         ConfigError and the check helpers (key, what is allowed, fix)
``sections``       model, data, reward, rollout, agent, async_training, trainer, weights
``actor``          actor: optimizer, PPO loss, and how the trainer fits long responses (token budgets,
                   packing, chunked log-probs, checkpointing, offload, sequence parallelism)
``runtime``        timeouts, logging (what may change on a live run)
``verl``           verl's config keys read as hpcrl's (the table is ``verl_keys.VERL_KEYS``; the reward model's
                   entries: ``verl_reward``)
``verl_units``     verl's values whose units differ, converted (micro-batches, GPUs, epochs)
``algorithm``      algorithm (advantages, KL, rollout correction) and critic
``combinations``   the algorithm rules that span sections (what an estimator or loss needs)
``evaluation``     eval: the evaluation job (which versions, sampling, engine, reward)
``reward_model``   reward_model: a learned reward (kind, placement, inputs, the judge, waits)
``resources``      job sizes and Slurm options per role
``simulated``      simulated: the phase model of a simulated engine and trainer
``knobs``          the async knobs (s, K, R) and their arithmetic: the admission budget B, the lag bound
``run``            RunConfig (all sections, its ``knobs``), load_config, dump_config
=================  ==============================================================

This package imports nothing from the jobs (``tests/test_layers.py``).
"""
from hpcrl.config.actor import ActorConfig
from hpcrl.config.algorithm import (AlgorithmConfig, CriticConfig, KLControlConfig, PolicyLossConfig,
                                    RolloutCorrectionConfig)
from hpcrl.config.checks import ConfigError
from hpcrl.config.evaluation import EvalConfig, EvalRewardConfig
from hpcrl.config.resources import JobResources, ResourcesConfig
from hpcrl.config.run import RunConfig, config_from_dict, dump_config, given_keys, load_config, parse_override
from hpcrl.config.runtime import LoggingConfig, TimeoutsConfig
from hpcrl.config.sections import (AgentConfig, AsyncConfig, DataConfig, ModelConfig, RewardConfig,
                                   RolloutConfig, TrainerConfig, WeightsConfig)

__all__ = [
    "ActorConfig", "AgentConfig", "AlgorithmConfig", "AsyncConfig", "ConfigError", "CriticConfig", "DataConfig", "EvalConfig",
    "EvalRewardConfig", "JobResources",
    "KLControlConfig", "LoggingConfig", "ModelConfig", "PolicyLossConfig", "ResourcesConfig", "RewardConfig", "RolloutConfig",
    "RolloutCorrectionConfig", "RunConfig", "TimeoutsConfig", "TrainerConfig", "WeightsConfig", "config_from_dict",
    "dump_config", "given_keys", "load_config", "parse_override",
]
