"""Gradient clipping as the trainer configures it: a real DeepSpeed engine (ZeRO 0 and 2, gloo)
clips the global norm before the step, and the logged norm is the one before clipping.

Runs in a subprocess: DeepSpeed's process group must not leak into the test process."""
import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import os, torch, deepspeed
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
deepspeed.init_distributed(dist_backend="gloo")
from hpcrl.trainer.update import step_with_grad_norm
for stage in (0, 2):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    w0 = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    loss = engine(torch.tensor([[3.0, 4.0, 0.0, 0.0]])).sum()  # d loss / d w = (3, 4, 0, 0): norm 5
    engine.backward(loss)
    norm = step_with_grad_norm(engine, -1.0)
    moved = float((w0 - engine.module.weight.detach()).norm())
    print(f"stage {stage} norm {norm:.6f} moved {moved:.6f}")
    assert abs(norm - 5.0) < 1e-5, norm
    assert abs(moved - 0.5) < 1e-5, moved  # SGD lr 1 with the gradient clipped to norm 0.5
"""


def test_grad_norm_is_logged_before_clipping_and_the_step_uses_the_clipped_gradient():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**__import__("os").environ, "PORT": str(port), "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "stage 0 norm 5.000000 moved 0.500000" in out.stdout and "stage 2 norm 5.000000" in out.stdout
