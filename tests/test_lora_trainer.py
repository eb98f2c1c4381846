"""The trainer's LoRA on a real DeepSpeed engine (ZeRO 0 and 3, gloo, one rank), built by the trainer's own
``parts._deepspeed``: only the adapter is in the optimizer, the KL reference (the adapter off) is the base model
before and after training, the published adapter is peft's, and a checkpoint holds the adapter and the optimizer
(not the base) and resumes exactly.

Runs in a subprocess: DeepSpeed's process group must not leak into the test process."""
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, os, sys, torch, deepspeed
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
deepspeed.init_distributed(dist_backend="gloo")
from hpcrl.config import load_config
from hpcrl.launcher.prepare import prepare_run_dir
from hpcrl.trainer import checkpoint
from hpcrl.trainer.forward import Pack
from hpcrl.trainer.lora import AdapterOff, adapter_state_dict
from hpcrl.trainer.models import load_reference
from hpcrl.trainer.parts import _deepspeed

out = sys.argv[1]
ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
pack = Pack(ids.reshape(1, -1), torch.arange(12).repeat(4)[None], None,
            torch.cat([torch.arange(r * 12, r * 12 + 11) for r in range(4)]), ids[:, 1:].reshape(-1))

def logp_of(module):
    return module(pack, temperature=1.0, chunk_rows=7)[0]

def base_logp(model):
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).reshape(-1)

def step(engine):
    loss = -logp_of(engine).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()

def build():
    torch.manual_seed(0)
    return _deepspeed(cfg, rd, 0, 1)[0]

for stage in (0, 3):
    cfg = load_config("configs/tiny.yaml", ["actor.lora_rank=8", f"actor.zero_stage={stage}", "actor.lr=0.01",
                                            "eval.every_versions=0"])
    rd = prepare_run_dir(cfg, os.path.join(out, f"run{stage}"), resume=False)
    base = load_reference(rd.base_model)
    engine = build()
    trainable = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]) if stage == 0 else None
    with torch.no_grad():
        ref0 = logp_of(AdapterOff(engine.module))
    losses = [step(engine) for _ in range(3)]
    with torch.no_grad():
        ref1 = logp_of(AdapterOff(engine.module))
        want = base_logp(base)
        trained = logp_of(engine)
    adapter = adapter_state_dict(engine.module, stage == 3, 0)
    state = checkpoint.TrainerState(step=3)
    checkpoint.save(engine, rd, state, keep=2, adapter_only=True)
    after = [step(engine) for _ in range(3)]
    engine2 = build()
    resumed = checkpoint.load_latest(engine2, rd, adapter_only=True)
    again = [step(engine2) for _ in range(3)]
    ckpt = rd.checkpoints / checkpoint.tag_for(3)
    json.dump({"trainable": trainable, "ref_is_base_before": bool(torch.allclose(ref0, want, atol=1e-5)),
               "ref_is_base_after": bool(torch.allclose(ref1, want, atol=1e-5)),
               "adapter_moved": not bool(torch.allclose(trained, want, atol=1e-3)),
               "losses": losses, "after": after, "again": again, "resumed_step": resumed.step,
               "adapter_keys": sorted(adapter), "adapter_numel": sum(t.numel() for t in adapter.values()),
               "ckpt_bytes": sum(p.stat().st_size for p in ckpt.iterdir()),
               "model_bytes": (rd.base_model / "model.safetensors").stat().st_size}, open(os.path.join(out, f"{stage}.json"), "w"))
"""


def test_the_trainer_trains_the_adapter_alone_and_resumes_it_exactly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env={**os.environ, "PORT": str(port), "DS_ACCELERATOR": "cpu",
                                                      "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in (0, 3):
        check_stage(json.loads((tmp_path / f"{stage}.json").read_text()), stage)


def check_stage(got: dict, stage: int) -> None:
    # rank 8 on q(128,128) k,v(128,64) o(128,128) gate,up(128,256) down(256,128), 2 layers
    adapter_numel = 2 * 8 * ((128 + 128) + 2 * (128 + 64) + (128 + 128) + 2 * (128 + 256) + (256 + 128))
    assert got["adapter_numel"] == adapter_numel
    if stage == 0:
        assert got["trainable"] == adapter_numel, "the optimizer holds the adapter alone"
    assert all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in got["adapter_keys"])
    assert got["ref_is_base_before"] and got["ref_is_base_after"], "the reference is the base model, always"
    assert got["adapter_moved"], "three steps at lr 0.01 must move the policy off the base"
    assert got["losses"][-1] < got["losses"][0]
    assert got["resumed_step"] == 3 and got["again"] == got["after"], "the adapter checkpoint resumes exactly"
    # adapter + Adam's two moments (fp32), no base weights: well under the 1.3 MB model alone
    assert got["ckpt_bytes"] < 4 * adapter_numel * 4 < got["model_bytes"], got
