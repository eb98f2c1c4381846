"""verl's units read as hpcrl's: the conversions of :mod:`hpcrl.config.verl` (its step 3).

Where a verl key's value does not mean the same number in hpcrl (verl's micro-batches count sequences,
hpcrl's groups; ``data.train_batch_size`` is a multiple of the mini-batch; GPUs per node are ranks;
rollout GPUs are rollout jobs of one vLLM replica each), the value is converted once every key of the
config is read, and the conversion says what it made. Each takes the value, the translation so far
(``t.get(key)``: an hpcrl key's value or its default; ``t.deferred``: the other deferred keys;
``t.note_of(key)``: the table's note) and the key as the user wrote it.
"""
from __future__ import annotations

from typing import Any, Callable

from hpcrl.config import registries
from hpcrl.config.checks import bad

Made = tuple[list[tuple[str, Any]], str]
"""(hpcrl key, value) pairs a conversion makes, and the note saying so."""


def _train_files(value: Any, t, key: str) -> Made:
    files = value if isinstance(value, list) else [value]
    if len(files) != 1 or not isinstance(files[0], str):
        raise bad(key, value, "one .parquet or .jsonl file (hpcrl reads one file)", "concatenate the files into one")
    return [("data.source", files[0])], f"data.source={files[0]!r}"


def _filter_overlong(value: Any, t, key: str) -> Made:
    if value:
        return [("data.truncation", "filter")], "data.truncation=filter (over-long prompts are dropped and counted)"
    return [], f"data.truncation={t.get('data.truncation')!r} decides what happens to over-long prompts"


def _train_batch_size(value: Any, t, key: str) -> Made:
    if not value:
        return [], (f"R = actor.ppo_mini_batch_size * async_training.require_batches = "
                    f"{t.get('actor.ppo_mini_batch_size') * t.get('async_training.require_batches')} groups per update")
    mini = t.get("actor.ppo_mini_batch_size")
    if not isinstance(value, int) or value % mini:
        raise bad(key, value, f"0 or a multiple of actor.ppo_mini_batch_size={mini} (hpcrl's update is "
                  "ppo_mini_batch_size * async_training.require_batches groups)",
                  "set data.train_batch_size=0 (verl's fully_async) and async_training.require_batches")
    return [("async_training.require_batches", value // mini)], \
        f"async_training.require_batches={value // mini} (R = {mini} x {value // mini} = {value} groups per update)"


def _reward_fn_key(value: Any, t, key: str) -> Made:
    if value != "data_source":
        raise bad(key, value, "data_source (the column hpcrl hands to the reward)",
                  "rename your column to data_source")
    return [], "the reward's data_source is the row's data_source column"


def _trainer_gpus(value: Any, t, key: str) -> Made:
    ranks = max(int(value or 0), 1)
    return [("resources.trainer.gpus_per_node", int(value or 0)), ("resources.trainer.tasks_per_node", ranks)], \
        f"resources.trainer.gpus_per_node={value}, tasks_per_node={ranks} (one DeepSpeed rank per GPU)"


def _save_freq(value: Any, t, key: str) -> Made:
    if not isinstance(value, int) or value <= 0:
        return [], (f"no 'never' here (a resume needs checkpoints): trainer.checkpoint_every_updates stays "
                    f"{t.get('trainer.checkpoint_every_updates')}")
    return [("trainer.checkpoint_every_updates", value)], f"trainer.checkpoint_every_updates={value}"


_LOGGERS = {"console": None, "wandb": "wandb", "tensorboard": "tensorboard"}


def _logger(value: Any, t, key: str) -> Made:
    names = value if isinstance(value, list) else [value]
    unknown = [n for n in names if n not in _LOGGERS]
    if unknown:
        raise bad(key, value, "console, tensorboard, wandb (logs/metrics.jsonl is always written)",
                  f"drop {', '.join(map(str, unknown))}: read logs/metrics.jsonl (or TensorBoard's event files) into it")
    backends = ["jsonl"] + [_LOGGERS[n] for n in names if _LOGGERS[n]]
    return [("logging.backends", backends)], f"logging.backends={backends} (console is hpcrl run's own output)"


def _total_training_steps(value: Any, t, key: str) -> Made:
    if not value:
        return [], "rollout.total_rollout_steps decides"
    r = t.get("actor.ppo_mini_batch_size") * t.get("async_training.require_batches")
    return [("rollout.total_rollout_steps", int(value) * r)], \
        f"rollout.total_rollout_steps={int(value) * r} ({value} updates of R = {r} groups)"


def _deferred_value(t, key: str, default: Any) -> Any:
    for _, k, v, _ in t.deferred:
        if k == key:
            return v
    return default


def _rollout_gpus(value: Any, t, key: str) -> Made:
    nodes = _deferred_value(t, "rollout.nnodes", 1) or 1
    per_node = _deferred_value(t, "rollout.n_gpus_per_node", 8)
    gpus = int(nodes) * int(per_node or 0)
    if not gpus:
        return [("resources.rollout_jobs", int(nodes)), ("resources.rollout.gpus_per_node", 0)], \
            f"resources.rollout_jobs={nodes} CPU rollout jobs"
    replica = t.get("rollout.tensor_parallel_size") * t.get("rollout.data_parallel_size")
    if gpus % replica:
        raise bad("rollout.n_gpus_per_node", per_node, f"rollout GPUs ({nodes} x {per_node}) a multiple of "
                  f"tensor_model_parallel_size * data_parallel_size = {replica}")
    return [("resources.rollout_jobs", gpus // replica), ("resources.rollout.gpus_per_node", replica)], \
        (f"{nodes} x {per_node} rollout GPUs -> resources.rollout_jobs={gpus // replica} rollout jobs of "
         f"resources.rollout.gpus_per_node={replica} (one per vLLM replica)")


def _engine(value: Any, t, key: str) -> Made:
    """verl's ``rollout.name`` -> the engine whose spec has that :attr:`~hpcrl.config.registries.EngineSpec.verl_name`
    (hpcrl's own names go in ``rollout.engine``)."""
    ours = {s.verl_name: name for name, s in registries.ENGINES.items() if s.verl_name}
    if value not in ours:
        raise bad(key, value, " or ".join(ours) + " (rollout.engine: " + " or ".join(ours.values()) + ")",
                  f"use {' or '.join(ours)}")
    return [("rollout.engine", ours[value])], f"rollout.engine={ours[value]}"


def _temperature(value: Any, t, key: str) -> Made:
    return [("rollout.temperature", value), ("actor.temperature", value)], \
        f"rollout.temperature = actor.temperature = {value} (the trainer's log-probs use it too, as verl's do)"


def _top_k(value: Any, t, key: str) -> Made:
    if value not in (None, -1, 0):
        raise bad(key, value, "-1 (off): no top-k sampling here", "use actor_rollout_ref.rollout.top_p")
    return [], "no top-k (off)"


def _micro_groups(sequences: int, t) -> int:
    n, world = t.get("rollout.n"), t.get("resources.trainer.nodes") * t.get("resources.trainer.tasks_per_node")
    share = max(t.get("actor.ppo_mini_batch_size") // world, 1)
    want = max(int(sequences) // n, 1)
    return max(d for d in range(1, share + 1) if share % d == 0 and d <= want)


def _micro_per_gpu(value: Any, t, key: str) -> Made:
    if not value:
        return [], f"actor.ppo_micro_batch_size stays {t.get('actor.ppo_micro_batch_size')} groups"
    g = _micro_groups(value, t)
    return [("actor.ppo_micro_batch_size", g)], \
        f"actor.ppo_micro_batch_size={g} groups of rollout.n={t.get('rollout.n')} per rank"


def _micro_global(value: Any, t, key: str) -> Made:
    if not value:
        return [], f"actor.ppo_micro_batch_size stays {t.get('actor.ppo_micro_batch_size')} groups"
    world = t.get("resources.trainer.nodes") * t.get("resources.trainer.tasks_per_node")
    g = _micro_groups(max(int(value) // world, 1), t)
    return [("actor.ppo_micro_batch_size", g)], \
        f"actor.ppo_micro_batch_size={g} groups of rollout.n={t.get('rollout.n')} per rank ({world} ranks)"


def _concurrent_samples(value: Any, t, key: str) -> Made:
    g = max(int(value or 0) // t.get("rollout.n"), 1)
    return [("rollout.max_concurrent_groups", g)], f"rollout.max_concurrent_groups={g} groups per rollout job"


def _reward_manager(value: Any, t, key: str) -> Made:
    if value not in (None, "naive", "dapo"):
        raise bad(key, value, "naive or dapo (hpcrl calls the reward once per response; dapo adds the overlong "
                  "buffer of reward.overlong_buffer)", "use the naive manager with your function in "
                  "custom_reward_function.path")
    dapo = "; dapo: the overlong penalty when reward.overlong_buffer.enable" if value == "dapo" else ""
    if "reward.name" in t.values:
        return [], f"reward.name stays {t.get('reward.name')!r}{dapo}"
    return [("reward.name", "by_data_source")], f"reward.name=by_data_source unless reward.path is set{dapo}"


def _agent_loop(value: Any, t, key: str) -> Made:
    loops = {"single_turn_agent": "single_turn", "tool_agent": "tool_agent"}
    if value not in loops:
        raise bad(key, value, ", ".join(loops), "write your loop as an hpcrl agent loop (ARCHITECTURE.md)")
    return [("agent.default", loops[value])], f"agent.default={loops[value]}"


def _one(value: Any, t, key: str) -> Made:
    if value not in (None, 1, -1):
        raise bad(key, value, "1", f"not offered here: {t.note_of(key)}")
    return [], "1: nothing to do"


def _lora_rank(value: Any, t, key: str) -> Made:
    if value in (None, 0):
        return [], "0: full fine-tuning (actor.lora_rank stays null)"
    return [("actor.lora_rank", value)], f"actor.lora_rank={value!r} (a LoRA adapter is trained)"


def _standalone_memory(value: Any, t, key: str) -> Made:
    if value is None:
        return [], f"rollout.gpu_memory_utilization stays {t.get('rollout.gpu_memory_utilization')}"
    return [("rollout.gpu_memory_utilization", value)], f"rollout.gpu_memory_utilization={value}"


def _rm_resource_pool(value: Any, t, key: str) -> Made:
    if value is None:
        return [], f"reward_model.placement stays {t.get('reward_model.placement')}"
    placement = "job" if value else "rollout"
    what = "reward jobs of their own (resources.reward_jobs)" if value else "the model in each rollout job"
    return [("reward_model.placement", placement)], f"reward_model.placement={placement}: {what}"


def _rm_nodes(value: Any, t, key: str) -> Made:
    if not value:
        return [], f"resources.reward_jobs stays {t.get('resources.reward_jobs')}"
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad(key, value, "a number of nodes >= 0 (one reward job each)")
    return [("resources.reward_jobs", value)], f"resources.reward_jobs={value} (one reward job per node)"


def _rm_engine(value: Any, t, key: str) -> Made:
    if value in (None, "???"):
        return [], f"reward_model.engine stays {t.get('reward_model.engine')}"
    ours = {s.verl_name: name for name, s in registries.ENGINES.items() if s.verl_name and not s.simulated}
    if value not in ours:  # verl's names, as for actor_rollout_ref.rollout.name (_engine)
        raise bad(key, value, " or ".join(ours) + " (reward_model.engine: " + " or ".join(ours.values()) + ")",
                  "set reward_model.engine=auto (vLLM where the reward job sees a GPU, transformers elsewhere)")
    return [("reward_model.engine", ours[value])], f"reward_model.engine={ours[value]}"


PAIRED = (_rollout_gpus,)
"""Conversions that read several keys at once: run once for all of them."""
LATE = (_train_batch_size, _micro_per_gpu, _micro_global, _total_training_steps, _concurrent_samples)
"""Conversions that read what others make (R, the trainer's ranks, rollout.n): run last, in this order."""


def conversion(table_key: str) -> Callable[[Any, Any, str], Made]:
    """The conversion of a table key (megatron.*'s parallel sizes, not listed: 1 or refused)."""
    return CONVERSIONS.get(table_key, _one)

CONVERSIONS: dict[str, Callable[[Any, Any, str], Made]] = {
    "data.train_files": _train_files,
    "data.filter_overlong_prompts": _filter_overlong,
    "data.train_batch_size": _train_batch_size,
    "data.reward_fn_key": _reward_fn_key,
    "trainer.n_gpus_per_node": _trainer_gpus,
    "trainer.save_freq": _save_freq,
    "trainer.logger": _logger,
    "trainer.total_training_steps": _total_training_steps,
    "rollout.nnodes": _rollout_gpus,
    "rollout.n_gpus_per_node": _rollout_gpus,
    "actor_rollout_ref.rollout.name": _engine,
    "actor_rollout_ref.rollout.temperature": _temperature,
    "actor_rollout_ref.rollout.top_k": _top_k,
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": _standalone_memory,
    "actor_rollout_ref.model.lora_rank": _lora_rank,
    "actor_rollout_ref.model.lora.rank": _lora_rank,
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": _one,
    "actor_rollout_ref.rollout.expert_parallel_size": _one,
    "actor_rollout_ref.rollout.agent.default_agent_loop": _agent_loop,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": _micro_per_gpu,
    "actor_rollout_ref.actor.ppo_micro_batch_size": _micro_global,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _one,
    "critic.ulysses_sequence_parallel_size": _one,
    "async_training.concurrent_samples_per_replica": _concurrent_samples,
    "reward_model.reward_manager": _reward_manager,
    "reward.reward_manager.name": _reward_manager,
    "reward_model.enable_resource_pool": _rm_resource_pool,
    "reward.reward_model.enable_resource_pool": _rm_resource_pool,
    "reward_model.nnodes": _rm_nodes,
    "reward.reward_model.nnodes": _rm_nodes,
    "reward_model.rollout.name": _rm_engine,
    "reward.reward_model.rollout.name": _rm_engine,
}
"""Table keys (:data:`~hpcrl.config.verl_keys.VERL_KEYS`) whose value is converted, not copied."""
