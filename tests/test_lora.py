"""LoRA (``actor.lora_rank``), the fast parts: its config and verl's keys, the launch checks, adapter weight versions
(peft's layout, hashed, verified, marked bad when damaged), the base model's hash, the transformers engine applying
an adapter exactly as peft does, and ``hpcrl export`` of an adapter (its folder, and merged). The trainer's side and
the learning runs are in ``test_lora_runs.py``."""
import importlib.util
import json
import subprocess

import pytest
import torch

from hpcrl.config import ConfigError, load_config
from hpcrl.config.lora import DEFAULT_TARGET_MODULES
from hpcrl.launcher.lora_check import check_lora
from hpcrl.rollout.engine import EngineOptions
from hpcrl.rollout.transformers_engine import TransformersEngine
from hpcrl.rundir.paths import WEIGHT_ADAPTER_CONFIG, WEIGHT_ADAPTER_TENSORS, RunDir
from hpcrl.tiny.model import build_tiny_model
from hpcrl.weights import WeightVersion, WeightVersionBad, make_publisher, make_subscriber
from hpcrl.weights.adapter import BaseModelChanged, base_model_hash, verify_base
from hpcrl.weights.manifest import AdapterBase
from conftest import REPO, TINY, python

PROMPTS = [[30, 5], [31, 7, 8, 9]]


def cfg_of(*overrides):
    return load_config(TINY, list(overrides))


# ---- config


@pytest.mark.parametrize("rank", [0, -1])
def test_a_rank_that_is_not_a_positive_integer_is_refused_in_one_line(rank):
    with pytest.raises(ConfigError) as e:
        cfg_of(f"actor.lora_rank={rank}")
    assert str(e.value).startswith("config actor.lora_rank:") and "\n" not in str(e.value)
    assert "null (full fine-tuning" in str(e.value) and "actor.lora_rank=8" in str(e.value)


def test_defaults_are_full_fine_tuning_and_the_attention_and_mlp_projections():
    cfg = cfg_of()
    assert cfg.actor.lora_rank is None and not cfg.lora
    assert cfg.actor.lora_target_modules == list(DEFAULT_TARGET_MODULES)
    assert cfg_of("actor.lora_rank=8").lora


def test_verl_keys_are_read_and_verl_rank_zero_means_full_fine_tuning():
    cfg = cfg_of("actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                 "actor_rollout_ref.model.target_modules=all-linear")
    assert (cfg.actor.lora_rank, cfg.actor.lora_alpha, cfg.actor.lora_target_modules) == (16, 32.0, "all-linear")
    assert cfg_of("actor_rollout_ref.model.lora_rank=0").actor.lora_rank is None
    with pytest.raises(ConfigError, match="actor.lora_target_modules"):
        cfg_of("actor_rollout_ref.model.exclude_modules=[lm_head]")


@pytest.mark.parametrize("override, key", [
    ("actor.lora_dropout=1.0", "actor.lora_dropout"), ("actor.lora_alpha=0", "actor.lora_alpha"),
    ("actor.lora_target_modules=[]", "actor.lora_target_modules"),
    ("actor.lora_target_modules=attention", "actor.lora_target_modules"),
    ("trainer.simulated=true", "trainer.simulated")])
def test_bad_lora_values_and_options_lora_cannot_go_with_are_refused(override, key):
    extra = ["rollout.engine=simulated", "eval.every_versions=0"] if "simulated" in override else []
    with pytest.raises(ConfigError) as e:
        cfg_of("actor.lora_rank=8", override, *extra)
    assert str(e.value).startswith(f"config {key}:"), str(e.value)


def test_vllm_serves_ranks_up_to_512_rounded_up_to_its_allowed_ranks():
    from hpcrl.config.registries import ENGINES
    from hpcrl.rollout.vllm_engine import VLLM_MAX_LORA_RANKS, vllm_max_lora_rank

    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    assert ENGINES["vllm"].max_lora_rank == VLLM_MAX_LORA_RANKS[-1]  # the spec says what the engine starts with
    with pytest.raises(ConfigError, match="at most 512 with rollout.engine=vllm"):
        cfg_of("actor.lora_rank=1024", "rollout.engine=vllm")


# ---- launch checks


def test_the_launch_check_names_a_target_module_the_model_lacks_and_counts_the_adapter():
    with pytest.raises(ConfigError) as e:
        check_lora(cfg_of("actor.lora_rank=8", "actor.lora_target_modules=[q_proj,c_attn]"))
    msg = str(e.value)
    assert msg.startswith("config actor.lora_target_modules: got ['c_attn']") and "q_proj" in msg and "\n" not in msg
    line, = check_lora(cfg_of("actor.lora_rank=8"))
    # 2 layers x r * (in + out) of q(128,128) k(128,64) v(128,64) o(128,128) gate/up(128,256) down(256,128)
    per_layer = 8 * ((128 + 128) + 2 * (128 + 64) + (128 + 128) + 2 * (128 + 256) + (256 + 128))
    assert f"{2 * per_layer:,} trainable parameters" in line and "14 layers" in line
    assert check_lora(cfg_of()) == []


def test_vllm_is_refused_an_adapter_on_the_output_layer_in_one_line_with_the_other_problems():
    with pytest.raises(ConfigError) as e:
        check_lora(cfg_of("actor.lora_rank=8", "model.path=builtin:tiny-h64", "rollout.engine=vllm",
                          "actor.lora_target_modules=[q_proj,lm_head,c_attn]"))
    missing, vllm = str(e.value).splitlines()
    assert missing.startswith("config actor.lora_target_modules: got ['c_attn']")
    assert vllm.startswith("config actor.lora_target_modules: got ['lm_head']") and "rollout.engine=transformers" in vllm


# ---- adapter weight versions


def adapter_tensors(seed: int, scale: float = 0.5) -> tuple[dict, dict, torch.nn.Module]:
    """A peft adapter of the tiny model (lora_B random, so it changes the outputs): its saved tensors, its config, and
    the peft model holding it."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from hpcrl.trainer.models import load_reference
    model = load_reference(BASE)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(DEFAULT_TARGET_MODULES)))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale)
    config = peft_model.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    return dict(get_peft_model_state_dict(peft_model)), config, peft_model.eval()


BASE = None


@pytest.fixture(scope="module", autouse=True)
def base_model(tmp_path_factory):
    global BASE
    BASE = build_tiny_model(tmp_path_factory.mktemp("lora") / "base", seed=0)
    return BASE


def publish_adapter(rd: RunDir, version: int, tensors: dict, config: dict):
    pub = make_publisher(cfg_of().weights, rd)
    return pub.publish(version, tensors, json.dumps(config), trainer_step=version, consumed_groups=0,
                       adapter=AdapterBase(path=str(BASE), hash=base_model_hash(BASE)))


def test_an_adapter_version_is_peft_s_layout_hashed_and_taken_verified(tmp_path):
    rd = RunDir(tmp_path).create()
    tensors, config, _ = adapter_tensors(1)
    published = publish_adapter(rd, 0, tensors, config)
    folder = rd.weight_version_dir(0)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                        "manifest.json"]
    assert published.manifest.adapter.hash == base_model_hash(BASE)
    # the adapter only: 2 layers x 7 projections x rank 4 x (in + out) floats, a twentieth of the tiny model
    assert published.manifest.total_bytes < (BASE / "model.safetensors").stat().st_size / 15
    with make_subscriber(cfg_of().weights, rd, "w000").take(0) as wv:
        assert wv.adapter["r"] == 4 and wv.adapter["peft_type"] == "LORA"
        assert set(wv.tensors) == set(tensors)
        assert all(torch.equal(wv.tensors[k], tensors[k]) for k in tensors)
    from peft import PeftModel

    from hpcrl.trainer.models import load_reference
    PeftModel.from_pretrained(load_reference(BASE), folder)  # peft reads the folder as it is


def test_a_damaged_adapter_config_marks_the_version_bad(tmp_path):
    rd = RunDir(tmp_path).create()
    tensors, config, _ = adapter_tensors(1)
    publish_adapter(rd, 0, tensors, config)
    path = rd.weight_file(0, WEIGHT_ADAPTER_CONFIG)
    path.write_text(path.read_text().replace('"r": 4', '"r": 5'))
    sub = make_subscriber(cfg_of().weights, rd, "w000")
    with pytest.raises(WeightVersionBad, match=WEIGHT_ADAPTER_CONFIG):
        sub.take(0)
    assert sub.is_bad(0) and rd.weight_bad_marker(0).exists()
    assert WEIGHT_ADAPTER_TENSORS in rd.weight_manifest(0).read_text()


def test_the_base_hash_changes_with_any_weight_byte(tmp_path):
    base = build_tiny_model(tmp_path / "b", seed=0)
    h = base_model_hash(base)
    assert h.startswith("xxh3_128:") and base_model_hash(build_tiny_model(tmp_path / "c", seed=0)) == h
    verify_base(base, h)
    verify_base(base, None)  # not a LoRA run
    path = base / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BaseModelChanged, match="restore the folder"):
        verify_base(base, h)


# ---- the transformers engine


def engine(lora_rank: int) -> TransformersEngine:
    return TransformersEngine(EngineOptions(BASE, max_new_tokens=8, temperature=1.0, top_p=1.0, device="cpu",
                                            dtype="float32", lora_rank=lora_rank))


def test_the_transformers_engine_applies_each_adapter_version_as_peft_does():
    import asyncio

    eng = engine(8)
    ids = torch.tensor([PROMPTS[1]])
    for seed in (1, 2):  # the second version replaces the first
        tensors, config, peft_model = adapter_tensors(seed)
        assert asyncio.run(eng.load_weights(WeightVersion.in_memory(seed, tensors, adapter=config))) == "adapter"
        with torch.no_grad():  # what the engine samples from is the peft model's distribution
            assert torch.allclose(eng.model(input_ids=ids).logits, peft_model(input_ids=ids).logits, atol=1e-5)
    with peft_model.disable_adapter(), torch.no_grad():
        base_logits = peft_model(input_ids=ids).logits
    assert not torch.allclose(eng.model(input_ids=ids).logits, base_logits, atol=1e-3), "the adapter must matter"


def test_an_engine_refuses_the_other_kind_of_version():
    import asyncio

    tensors, config, _ = adapter_tensors(1)
    with pytest.raises(ValueError, match="started for full weights"):
        asyncio.run(engine(0).load_weights(WeightVersion.in_memory(1, tensors, adapter=config)))
    with pytest.raises(ValueError, match="holds full weights"):
        asyncio.run(engine(8).load_weights(WeightVersion.in_memory(1, {})))
    with pytest.raises(ValueError, match="serves ranks up to 2"):
        asyncio.run(engine(2).load_weights(WeightVersion.in_memory(1, tensors, adapter=config)))


def test_the_broadcast_sends_the_adapter_alone(tmp_path):
    """weights.transport=broadcast (sender and receiver in this process): an adapter version arrives by broadcast with
    the adapter's bytes only and peft's verified config."""
    from hpcrl.config import TimeoutsConfig, WeightsConfig
    from hpcrl.control.records import HeartbeatThread

    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s")
    beat = HeartbeatThread(rd, RunDir.trainer_job(), "trainer", 0.5).start()  # a reader joins a live trainer only
    timeouts = TimeoutsConfig(broadcast_connect_s=2.0, broadcast_s=5.0, wait_weights_s=4.0)
    cfg = WeightsConfig(transport="broadcast", bucket_mib=0.01)
    pub, sub = make_publisher(cfg, rd, timeouts), make_subscriber(cfg, rd, "w000", timeouts)
    base = AdapterBase(path=str(BASE), hash=base_model_hash(BASE))
    try:
        for v in (0, 1):
            tensors, config, _ = adapter_tensors(v)
            published = pub.publish(v, tensors, json.dumps(config), v, 4 * v, adapter=base)
            with sub.take(v) as wv:
                if v == 1:  # a member from the publish after it joined
                    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
                    assert published.path == wv.path == "broadcast"
                    assert published.sent_bytes == wv.nbytes == adapter_bytes
                    assert wv.adapter == json.loads(rd.weight_file(1, WEIGHT_ADAPTER_CONFIG).read_text())
                    assert all(torch.equal(wv.tensors[k], tensors[k]) for k in tensors)
    finally:
        pub.close(), sub.close(), beat.stop("done")


def test_a_resume_on_a_changed_base_model_is_refused_before_anything_is_submitted(tmp_path):
    from hpcrl.launcher.prepare import prepare_run_dir

    cfg = cfg_of("actor.lora_rank=8", "eval.every_versions=0")
    rd = prepare_run_dir(cfg, tmp_path / "run", resume=False)
    frozen = rd.load_config()
    assert frozen.model.base_hash == base_model_hash(rd.base_model), "the launcher names the base by its hash"
    prepare_run_dir(frozen, rd.root, resume=True)  # the same base: fine
    path = rd.base_model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-4] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="config model.base_hash: the base model's weights in .* hash to"):
        prepare_run_dir(frozen, rd.root, resume=True)


def test_export_writes_the_adapter_folder_or_the_merged_model_and_both_load_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from hpcrl.analysis.export import ExportError, export
    from hpcrl.launcher.prepare import prepare_run_dir

    rd = prepare_run_dir(cfg_of("actor.lora_rank=4", "eval.every_versions=0"), tmp_path / "run", resume=False)
    global BASE
    saved, BASE = BASE, rd.base_model  # the run's own base
    try:
        tensors, config, peft_model = adapter_tensors(3)
        publish_adapter(rd, 0, tensors, config)
    finally:
        BASE = saved
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
    adapter = export(rd.root, tmp_path / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(adapter.files)
    merged = export(rd.root, tmp_path / "merged", merge=True)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(merged.files)
    assert not any(name.startswith("adapter_") for name in merged.files)
    for folder in (adapter.folder, merged.folder):  # transformers loads the adapter's base itself (peft installed)
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=ids).logits
        assert torch.allclose(got, want, atol=1e-5), folder
    full = prepare_run_dir(cfg_of("eval.every_versions=0"), tmp_path / "full", resume=False)
    model = AutoModelForCausalLM.from_pretrained(full.base_model, dtype=torch.float32)
    make_publisher(cfg_of().weights, full).publish(0, dict(model.state_dict()), model.config.to_json_string(), 0, 0)
    with pytest.raises(ExportError, match="holds full weights: --merge is for a LoRA run"):
        export(full.root, tmp_path / "nope", merge=True)


CHECK_IN_A_FRESH_PROCESS = """
import json, os, sys
from hpcrl.config import load_config
from hpcrl.launcher.lora_check import check_lora
before = dict(os.environ)
cfg = load_config(sys.argv[1], ["actor.lora_rank=8", "model.path=builtin:tiny-h64", "rollout.engine=vllm",
                                "rollout.device=cpu"])
lines = check_lora(cfg)
assert "vllm" in sys.modules, "the check imported vLLM"
print(json.dumps({"lines": lines, "changed": sorted(k for k in before.keys() | os.environ.keys()
                                                  if before.get(k) != os.environ.get(k))}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_launch_check_that_imports_vllm_leaves_the_jobs_environment_as_it_was(tmp_path):
    """(Not in test_lora_vllm.py: while its module's engine is up, the test process has vLLM's variables.) Importing
    vLLM sets LD_LIBRARY_PATH (with an empty entry: the working directory), TORCHINDUCTOR_COMPILE_THREADS
    and more in the importing process's environment; the launcher's LoRA check imports it, and every job the launcher
    then submitted inherited them. In a fresh process (vLLM not yet imported) the environment is unchanged after it."""
    (tmp_path / "check.py").write_text(CHECK_IN_A_FRESH_PROCESS)
    res = subprocess.run([python(), str(tmp_path / "check.py"), str(TINY)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["lines"][0].startswith("LoRA: rank 8") and out["changed"] == [], out
