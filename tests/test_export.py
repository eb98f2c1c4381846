"""Take the model out: every published version is a complete Hugging Face folder (tokenizer, chat template and
generation config listed and hashed in its manifest, verified by readers like config.json), and
``hpcrl export RUN --out DIR`` writes one that AutoModelForCausalLM, AutoTokenizer and vLLM load as is."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import BackgroundCommand, make_run
from hpcrl.cli import main as cli_main
from hpcrl.config import WeightsConfig
from hpcrl.rundir.paths import RunDir
from hpcrl.tiny.model import build_tokenizer, quiet_progress_bars
from hpcrl.trainer.parts import model_files
from hpcrl.weights import WeightVersionBad, make_publisher, make_subscriber


def llama_model(folder):
    """The tiny model's shapes and tokenizer as a Llama (head dim 64, so vLLM's CPU build serves it).
    transformers' AutoTokenizer takes a qwen2 folder's tokenizer class from the model type (Qwen2's BPE),
    which the tiny word-level tokenizer is not; a llama folder keeps the tokenizer it ships."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with quiet_progress_bars():
        LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def publish_trained(tmp_path, base):
    """A run whose trainer published version 0 of ``base`` and version 1 with changed weights."""
    from transformers import AutoModelForCausalLM

    rd = make_run(tmp_path, f"model.path={base}")
    model = AutoModelForCausalLM.from_pretrained(base)
    pub = make_publisher(WeightsConfig(), rd)
    config_json = model.config.to_json_string()
    pub.publish(0, model.state_dict(), config_json, 0, 0, model_files(base))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    pub.publish(1, model.state_dict(), config_json, 10, 40, model_files(base))
    return rd, model


def test_every_version_carries_the_tokenizer_listed_hashed_and_verified(tmp_path):
    base = llama_model(tmp_path / "base")
    rd, _ = publish_trained(tmp_path, base)
    manifest = json.loads(rd.weight_manifest(1).read_text())
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= \
        set(manifest["files"]), sorted(manifest["files"])
    sub = make_subscriber(WeightsConfig(), rd, "w000")
    with sub.take(1):
        pass
    (rd.weight_version_dir(1) / "tokenizer.json").write_text("{}")  # damaged: the reader refuses and marks it
    with pytest.raises(WeightVersionBad, match="tokenizer.json"):
        sub.take(1)
    assert rd.weight_bad_marker(1).exists()


def test_export_loads_in_transformers_with_its_chat_template(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = llama_model(tmp_path / "base")
    rd, trained = publish_trained(tmp_path, base)
    out = tmp_path / "exported"
    assert cli_main(["export", str(rd.root), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "exported weight version 1 (trainer step 10)" in said and "note: AutoTokenizer" not in said, said
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, p in trained.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], p)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 64 and tok("repeat c")["input_ids"] == [39, 5]
    assert tok.apply_chat_template([{"role": "user", "content": "repeat c"}], tokenize=False) == "repeat c "
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    # --version N, a used --out, an unknown version: one line each
    assert cli_main(["export", str(rd.root), "--version", "0", "--out", str(tmp_path / "v0")]) == 0
    assert cli_main(["export", str(rd.root), "--out", str(out)]) == 2
    assert cli_main(["export", str(rd.root), "--version", "7", "--out", str(tmp_path / "v7")]) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "weight version 7 is not in" in err


def test_the_builtin_tiny_model_exports_and_generates_as_the_run_does_with_the_loader_export_names(tmp_path, capsys):
    """transformers picks Qwen2's BPE for any qwen2 folder under AutoTokenizer: the exported tiny model wrote
    'aaaaaaaa' where the run's tokenizer gives 'c c c c c c c c'. Export makes AutoTokenizer load the run's
    tokenizer (auto_map) and its last line names the loader; generating with exactly that loader gives the run's
    ids and text."""
    import re

    import transformers
    from transformers import AutoModelForCausalLM

    from hpcrl.tiny.model import load_tokenizer

    rd = make_run(tmp_path)
    base = RunDir(rd.root).base_model
    model = AutoModelForCausalLM.from_pretrained(base)
    make_publisher(WeightsConfig(), rd).publish(0, model.state_dict(), model.config.to_json_string(), 0, 0,
                                                model_files(base))
    assert transformers.AutoTokenizer.from_pretrained(base)("repeat c")["input_ids"] != [39, 5], \
        "transformers no longer picks another tokenizer for the tiny model: this test no longer shows the fix"
    out = tmp_path / "out"
    assert cli_main(["export", str(rd.root), "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    loader = re.search(r"and (\w+)\.from_pretrained\('[^']+'\) \(the run's tokenizer\)", last)
    assert loader and loader.group(1) == "AutoTokenizer", last
    run_tok, tok = load_tokenizer(base), getattr(transformers, loader.group(1)).from_pretrained(out)
    ids = tok("repeat c", return_tensors="pt")["input_ids"]
    assert ids.tolist() == run_tok("repeat c", return_tensors="pt")["input_ids"].tolist() == [[39, 5]]
    response = AutoModelForCausalLM.from_pretrained(out).generate(ids, max_new_tokens=8, do_sample=False)[0, 2:]
    got, want = tok.decode(response, skip_special_tokens=True), run_tok.decode(response, skip_special_tokens=True)
    assert got == want and got.split() and tok.chat_template == run_tok.chat_template, (got, want)


VLLM_LOAD = """
import sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", gpu_memory_utilization=0.1, max_model_len=64, enforce_eager=True)
    tok = llm.get_tokenizer()
    out = llm.generate(["repeat c"], SamplingParams(max_tokens=4, temperature=0.0))
    print("IDS", tok("repeat c")["input_ids"], "TOKENS", len(out[0].outputs[0].token_ids), flush=True)
"""


def exported_and_loaded_by_vllm(folder: Path) -> list[str]:
    """A trained run's last version exported as it is (``hpcrl export``), and the command that loads the export
    with vLLM's own ``LLM`` class in a process of its own."""
    base = llama_model(folder / "base")
    rd, _ = publish_trained(folder, base)
    out = folder / "exported"
    assert cli_main(["export", str(rd.root), "--out", str(out)]) == 0
    (folder / "load.py").write_text(VLLM_LOAD)
    return ["env", "VLLM_USE_FLASHINFER_SAMPLER=0", sys.executable, str(folder / "load.py"), str(out)]


HAS_VLLM = importlib.util.find_spec("vllm") is not None
BACKGROUND_RUNS = {"export:vllm": BackgroundCommand(exported_and_loaded_by_vllm)} if HAS_VLLM else {}
"""vLLM's load of the export, in the background when the session starts (conftest.BackgroundRuns)."""


def background_keys(item) -> tuple[str, ...]:
    """The background run a test item reads (none without vLLM: the test is skipped)."""
    return ("export:vllm",) if item.originalname == "test_vllm_loads_the_export_as_is" and HAS_VLLM else ()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (./install.sh --test)")
def test_vllm_loads_the_export_as_is(background_runs):
    proc = background_runs.launched("export:vllm", timeout_s=900)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "IDS [39, 5] TOKENS 4" in proc.stdout, proc.stdout[-2000:]
