"""A peer of the weight broadcast, as a real process (tests/test_broadcast.py).

``--role trainer``: publish v0, wait until a rollout job joined, publish v1 (perturbed weights);
run with ``HPCRL_FAULT_POINT=broadcast_bucket:N:kill`` it dies in the middle of v1's broadcast.
Otherwise (rollout):

``python tests/broadcast_peer.py RUN OUT --versions 0,1 [--transport broadcast] [--bucket-mib X]
[--connect-s S] [--broadcast-s S]``: takes each version (waiting for its manifest) into the tiny
model through a subscriber, then writes the path each version took and the model's greedy
tokens on fixed prompts to OUT (JSON). A refused or failed join exits 3 with the error on stderr.
"""
import argparse
import json
import sys
import time

import torch

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.control.records import HeartbeatThread
from hpcrl.rundir.paths import RunDir
from hpcrl.weights import make_publisher, make_subscriber
from hpcrl.weights.group import BroadcastFailed

PROMPTS = [[3, 4, 5], [10, 11], [20, 21, 22, 23]]
"""Token ids of the prompts both sides generate from (greedy)."""


def greedy(model) -> list[list[int]]:
    """Greedy continuations of PROMPTS (8 new tokens each)."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                               pad_token_id=0)[0].tolist() for p in PROMPTS]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--versions", default="0,1")
    p.add_argument("--transport", default="broadcast")
    p.add_argument("--bucket-mib", type=float, default=0.05)
    p.add_argument("--connect-s", type=float, default=5.0)
    p.add_argument("--broadcast-s", type=float, default=20.0)
    p.add_argument("--role", default="rollout")
    a = p.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="peer %(asctime)s %(name)s: %(message)s")
    from transformers import AutoModelForCausalLM

    rd = RunDir(a.run_dir)
    model = AutoModelForCausalLM.from_pretrained(rd.base_model, dtype=torch.float32).eval()
    cfg = WeightsConfig(transport=a.transport, bucket_mib=a.bucket_mib)
    timeouts = TimeoutsConfig(broadcast_connect_s=a.connect_s, broadcast_s=a.broadcast_s)
    if a.role == "trainer":
        HeartbeatThread(rd, RunDir.trainer_job(), "trainer", 0.5).start()  # readers join a live trainer only
        wt = make_publisher(cfg, rd, timeouts)
        wt.publish(0, model.state_dict(), model.config.to_json_string(), 0, 0)
        while wt.waiting_members() < 1:
            time.sleep(0.02)
        with torch.no_grad():
            for prm in model.parameters():
                prm.add_(0.5)
        wt.publish(1, model.state_dict(), model.config.to_json_string(), 1, 4)
        return 0
    wt = make_subscriber(cfg, rd, "w000", timeouts)
    paths = {}
    for v in map(int, a.versions.split(",")):
        deadline = time.monotonic() + 60
        while not rd.weight_manifest(v).exists():
            if time.monotonic() > deadline:
                print(f"peer: version {v} never appeared", file=sys.stderr)
                return 2
            time.sleep(0.02)
        try:
            with wt.take(v) as wv:
                model.load_state_dict(wv.tensors)
        except BroadcastFailed as e:
            print(f"peer: {e}", file=sys.stderr)
            return 3
        paths[v] = wv.metrics(apply_s=0.0)
    with open(a.out, "w") as f:
        json.dump({"paths": paths, "tokens": greedy(model)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
