"""Benchmark of the ZeRO-3 gather of a publish: per layer (``hpcrl.trainer.gather``, what the trainer
does) against DeepSpeed's ``_zero3_consolidated_16bit_state_dict`` (module by module), on the same
engine in the same run.

Two trainer ranks on this machine (DeepSpeed ZeRO-3, gloo on CPU; ``tests/zero3_peer.py`` is each
rank), a Qwen2-shaped fp32 model; medians of ``--repeats``. Rank 0's result is checked bit for bit
against the model's weights and DeepSpeed's. No NCCL figure: that needs GPUs.

Run::

    .venv/bin/python bench/bench_zero3_gather.py --quick    # 4 layers, hidden 512
    .venv/bin/python bench/bench_zero3_gather.py            # 16 layers, hidden 1024 (~0.9 GB fp32)
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = bench_parser(__doc__, "4 layers, hidden 512, 3 repeats")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.repeats = 4, 512, 3
    out = Path(tempfile.mkdtemp(dir=a.dir, prefix="bench_zero3_")) / "zero3.json"
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "zero3_peer.py"), str(out), "--layers",
                               str(a.layers), "--hidden", str(a.hidden), "--repeats", str(a.repeats)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), LOCAL_RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO) for r in range(2)]
    if any(p.wait(timeout=1800) != 0 for p in procs):
        print("a rank failed; run tests/zero3_peer.py by hand to see why", file=sys.stderr)
        return 1
    r = json.loads(out.read_text())
    if not (r["equal_to_model"] and r["equal_to_deepspeed"]):
        print(f"gathered weights differ: {r}", file=sys.stderr)
        return 1
    gb = r["bytes"] / 1e9
    print(f"{gb * 1e3:.0f} MB fp32 policy, {a.layers} layers, 2 ZeRO-3 ranks (gloo, this machine), median of "
          f"{a.repeats}; gathers per layer: {r['gathers']}")
    print(table(["gather", "ms", "GB/s"], [[k, f"{r[k + '_s'] * 1e3:.0f}", f"{gb / r[k + '_s']:.2f}"]
                                           for k in ("per_layer", "deepspeed")]))
    print(f"per layer / deepspeed time: {r['per_layer_s'] / r['deepspeed_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
