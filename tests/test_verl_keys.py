"""A verl user's config works unchanged: verl's keys are read as hpcrl's (hpcrl/config/names.py:
VERL_KEYS), in YAML files and overrides alike, each mapping said once; keys with no meaning here are
accepted with what hpcrl does instead or refused with the reason; units that differ are converted."""
import pytest
import yaml

from conftest import REPO, TINY
from hpcrl.cli import main as cli_main
from hpcrl.config import ConfigError, load_config
from hpcrl.config.verl_keys import VERL_KEYS, VerlKey
from hpcrl.config.verl import CONVERSIONS, Schema, entry_of
from hpcrl.config import RunConfig

VERL_GSM8K = REPO / "configs" / "gsm8k-0.5b-1node-verl.yaml"
HPCRL_GSM8K = REPO / "configs" / "gsm8k-0.5b-1node.yaml"


def test_a_whole_verl_fully_async_yaml_resolves_to_the_hpcrl_keyed_config():
    notes = []
    verl = load_config(VERL_GSM8K, notes=notes)
    assert verl.to_dict() == load_config(HPCRL_GSM8K).to_dict()
    assert "verl actor_rollout_ref.rollout.n -> rollout.n" in notes
    assert sum(n.startswith("verl actor_rollout_ref.rollout.n ") for n in notes) == 1, "each mapping said once"
    assert any(n.startswith("verl actor_rollout_ref.actor.strategy: not used here: the trainer shards with DeepSpeed")
               for n in notes)
    assert any("rollout.max_concurrent_groups=32" in n for n in notes)
    assert any("resources.rollout_jobs=4" in n for n in notes)


def test_the_dry_runs_of_both_files_print_the_same_resolved_config(tmp_path, capsys):
    """Through `hpcrl run --dry-run`, with a model and data that exist (and no GPUs asked for: none here)."""
    import pandas as pd

    from hpcrl.tiny.model import build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    data = tmp_path / "gsm8k.parquet"
    pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "repeat a"}],
                   "reward_model": {"ground_truth": "7"}}]).to_parquet(data)
    common = ["resources.trainer.gpus_per_node=0", "resources.rollout.gpus_per_node=0", "rollout.engine=transformers",
              "rollout.dtype=float32", "actor.bf16=false", f"data.source={data}"]
    out = {}
    for name, path, model_key in (("verl", VERL_GSM8K, "actor_rollout_ref.model.path"), ("hpcrl", HPCRL_GSM8K, "model.path")):
        capsys.readouterr()
        rc = cli_main(["run", str(path), f"{model_key}={model}", *common, "--run-dir", str(tmp_path / name),
                       "--dry-run", "--executor", "local"])
        text = capsys.readouterr()
        assert rc == 0, text.err
        out[name] = text.out.split("# resolved config:")[1]
        if name == "verl":
            assert "# verl trainer.n_gpus_per_node=4: resources.trainer.gpus_per_node=4, tasks_per_node=4" in text.out
    assert yaml.safe_load(out["verl"]) == yaml.safe_load(out["hpcrl"])


def test_overrides_take_verl_keys_and_hydra_plus():
    notes = []
    cfg = load_config(TINY, ["actor_rollout_ref.rollout.n=4", "+trainer.save_freq=5", "++trainer.logger=[console,wandb]",
                             "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.rollout.temperature=0.7",
                             "custom_reward_function.reward_kwargs={method: flexible}",
                             "actor_rollout_ref.actor.clip_ratio_high=0.28"], notes=notes)
    assert (cfg.rollout.n, cfg.trainer.checkpoint_every_updates, cfg.logging.backends) == (4, 5, ["jsonl", "wandb"])
    assert cfg.actor.lr == 3e-4 and cfg.rollout.temperature == cfg.actor.temperature == 0.7
    assert cfg.reward.kwargs == {"method": "flexible"} and cfg.actor.clip_ratio_high == 0.28
    # an override wins over the file, whichever name either uses
    path = REPO / "configs" / "tiny.yaml"
    assert load_config(path, ["actor_rollout_ref.rollout.n=2"]).rollout.n == 2


def test_units_that_differ_are_converted():
    cfg = load_config(TINY, ["rollout.n=8", "actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                             "data.train_batch_size=16", "trainer.total_training_steps=10"])
    assert cfg.actor.ppo_micro_batch_size == 2, "16 sequences per GPU = 2 groups of 8"
    assert cfg.async_training.require_batches == 2 and cfg.groups_per_update == 16
    assert cfg.rollout.total_rollout_steps == 160, "10 updates of 16 groups"
    cfg = load_config(TINY, ["trainer.total_epochs=3", "data.train_files=[/x/train.parquet]",
                             "data.filter_overlong_prompts=true"])
    assert (cfg.data.epochs, cfg.data.source, cfg.data.truncation) == (3, "/x/train.parquet", "filter")


@pytest.mark.parametrize("override, fragment", [
    ("actor_rollout_ref.model.exclude_modules=[lm_head]", "list the ones to adapt"),
    ("reward_model.model.external_lib=my_rm_lib", "loaded by transformers' own classes"),
    ("reward.reward_manager.module.path=my_manager.py", "a reward-loop class of your own does not run here"),
    ("reward_model.rollout.name=sglang", "hf or vllm (reward_model.engine: transformers or vllm)"),
    ("actor_rollout_ref.rollout.name=sglang", "hf or vllm"),
    ("data.train_files=[a.parquet,b.parquet]", "concatenate the files into one"),
    ("data.train_batch_size=6", "multiple of actor.ppo_mini_batch_size=4"),
    ("trainer.logger=[console,mlflow]", "drop mlflow"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "no tensor or pipeline parallelism"),
    ("actor_rollout_ref.rollout.top_k=50", "no top-k"),
    ("data.reward_fn_key=source", "rename your column to data_source"),
    ("~data.seed", "nothing to delete"),
])
def test_keys_that_cannot_be_honoured_are_refused_with_the_reason(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert fragment in str(e.value) and "remove or rename" not in str(e.value), str(e.value)


def test_keys_without_meaning_here_are_accepted_with_what_hpcrl_does_instead():
    notes = []
    load_config(TINY, ["actor_rollout_ref.actor.fsdp_config.reshard_after_forward=true", "ray_kwargs.ray_init.num_cpus=8",
                       "actor_rollout_ref.model.lora_rank=0", "reward_model.enable=false"], notes=notes)
    assert any("fsdp_config.reshard_after_forward: not used here: the trainer shards with DeepSpeed ZeRO" in n
               for n in notes)
    assert any("ray_kwargs.ray_init.num_cpus: not used here: hpcrl runs no Ray" in n for n in notes)


def test_verls_memory_keys_set_the_trainers_layout_and_offload():
    """verl's padding-free, token-budget, checkpointing, sequence-parallel and offload keys are read as hpcrl's; an
    offload ZeRO cannot give with the stage set is refused with the fix."""
    cfg = load_config(TINY, ["actor_rollout_ref.model.use_remove_padding=false",
                             "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                             "actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
                             "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20000",
                             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
                             "actor.zero_stage=3", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                             "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    a = cfg.actor
    assert (a.use_remove_padding, a.gradient_checkpointing, a.use_dynamic_bsz) == (False, True, True)
    assert (a.ppo_max_token_len_per_gpu, a.log_prob_token_budget) == (8192, 20000)
    assert a.offload_param and a.offload_optimizer
    with pytest.raises(ConfigError, match="only with actor.zero_stage: 3.*fix: set actor.zero_stage=3"):
        load_config(TINY, ["actor_rollout_ref.actor.fsdp_config.param_offload=true"])


def test_unknown_keys_are_all_reported_with_the_nearest_hpcrl_or_verl_key():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["data.max_response_lenght=16", "actor_rollout_ref.rollout.temprature=0.5",
                           "async_training.staleness_treshold=0.5"])
    lines = str(e.value).splitlines()
    assert len(lines) == 3, lines
    assert "did you mean data.max_response_length (verl's name, read as rollout.response_length)?" in lines[0]
    assert "did you mean actor_rollout_ref.rollout.temperature (verl's name, read as rollout.temperature)?" in lines[1]
    assert "did you mean async_training.staleness_threshold?" in lines[2]
    assert "remove or rename" not in str(e.value)


def test_a_typo_under_a_verl_section_hpcrl_takes_whole_is_refused_with_the_nearest_key():
    """``optim.*`` has no meaning here but for lr, weight_decay and clip_grad: a misspelt lr was once taken as one of
    the rest ("not used here") and the run trained at the default lr."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["actor_rollout_ref.actor.optim.lrr=1e-5", "critic.optim.betaz=[0.9, 0.95]"])
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("config actor_rollout_ref.actor.optim.lrr: got '1e-5'; allowed: verl's keys of "
                               "actor_rollout_ref.actor.optim: optimizer, optimizer_impl, lr,"), lines[0]
    assert "did you mean actor_rollout_ref.actor.optim.lr (verl's name, read as actor.lr)?" in lines[0]
    assert "did you mean critic.optim.betas?" in lines[1]
    notes = []
    cfg = load_config(TINY, ["actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
                             "actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-8",
                             "actor_rollout_ref.actor.optim.betas=[0.9, 0.95]"], notes=notes)
    assert cfg.actor.lr == 1e-5
    assert any(n.startswith("verl actor_rollout_ref.actor.optim.lr_warmup_steps, ") and "not used here: AdamW" in n
               for n in notes), notes


def test_two_file_keys_setting_one_hpcrl_key_differently_conflict(tmp_path):
    (tmp_path / "c.yaml").write_text("rollout: {n: 4}\nactor_rollout_ref: {rollout: {n: 8}}\n")
    with pytest.raises(ConfigError, match="already set rollout.n to 4"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("rollout: {n: 8}\nactor_rollout_ref: {rollout: {n: 8}}\n")
    assert load_config(tmp_path / "d.yaml").rollout.n == 8


def test_every_table_entry_points_at_an_hpcrl_key_or_says_why_not():
    schema = Schema.of(RunConfig)
    for key, value in VERL_KEYS.items():
        entry = VerlKey(value) if isinstance(value, str) else value
        if entry.target is None:
            assert entry.note, f"{key}: a key with no meaning here must say what hpcrl does instead"
            continue
        target = entry.target[:-2] if entry.target.endswith(".*") else entry.target
        assert schema.knows(target) or target in schema.sections, f"{key} -> {entry.target}: no such hpcrl key"
        assert not schema.knows(key), f"{key} is hpcrl's own key: it must not be in the table"
    assert set(CONVERSIONS) <= set(VERL_KEYS)
    assert entry_of("actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params")[0] == \
        "actor_rollout_ref.actor.fsdp_config.*"
