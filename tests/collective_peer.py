"""One trainer rank under ``srun``: find the world the trainer's way (``init_distributed``: master from the node
list, interface from the route, the check-in), then all-reduce in a loop; prints one line per rank.

    srun -N2 -n2 --kill-on-bad-exit=1 python tests/collective_peer.py [--die-rank R] [--die-after-s S]

With ``--die-rank`` that rank SIGKILLs itself after ``--die-after-s`` seconds, in the middle of the loop.
"""
import argparse
import logging
import os
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpcrl.trainer.distributed import init_distributed  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--die-rank", type=int, default=-1)
p.add_argument("--die-after-s", type=float, default=3.0)
p.add_argument("--loop-s", type=float, default=300.0)
a = p.parse_args()
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {socket.gethostname()} %(name)s: %(message)s")
init_distributed(600.0, 60.0, 5.0)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {rank} of {world} on {socket.gethostname()}: master {os.environ['MASTER_ADDR']}, "
      f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '')}, all_reduce {t.item():.0f}", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < a.loop_s:
    if rank == a.die_rank and time.monotonic() - t0 > a.die_after_s:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1 << 16))
print(f"rank {rank}: loop done", flush=True)
