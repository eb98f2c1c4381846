"""What the reward model costs the run, as ratios in one run of this script.

**Generation** (``--part generation``): two short runs of the tiny task launched as a user would
(``hpcrl run --executor local``), the same but for the reward: (a) the rule (``reward.name=toy_copy``), (b) a
discriminative reward model (a random tiny sequence classifier: only its cost matters here) served by a reward job
of its own (``reward_model.placement=job``), every group sent as it finishes generating. Reported: the rollout job's
generation tokens/s, its response tokens over the seconds it had a group in flight (each version row's
``wall_s * (1 - rollouter/idle_ratio)``, the first version's row left out: start-up), and (b) / (a); the target is
>= 0.9 (the engine keeps generating while a group waits for its scores: ``reward_model.scoring_groups``). Default
engine: vLLM's CPU build on ``builtin:tiny-h64`` (``--engine transformers`` for the other). On a cluster the reward
job has an allocation of its own; here every job shares the machine's cores, so by default (``--pin``) each leg's
jobs are pinned alike, as separate allocations would keep them: the rollout job and its engine (vLLM's engine core
inherits the mask) on the first CPU this process may use, the trainer and (in (b)) the reward job on the others
(``HPCRL_PYTHON`` is a script that starts each job under ``taskset``, chosen by the job's name). Without pinning
(``--no-pin``) (b) also pays for the reward job's CPU, which then competes with the engine for the same cores: the
ratio measures CPU contention, not whether scoring blocks generation. Other processes on the machine still share the
rollout job's CPU: read the load average with the figure.

**Scoring** (``--part scoring``): one discriminative model (Qwen2-shaped, ``--hidden``/``--layers``, random) scores the
same responses (``--items`` of them, prompt 8 + response 16..``--tokens`` tokens) (a) by a bare transformers forward, as
a user would write it: the responses in their order, ``--micro-batch`` at a time, padded on the right, the model's
own pooled logits, and the same sorted by length first (the least padding: the strongest bare baseline); (b) by hpcrl's reward service: a :class:`~hpcrl.reward.server.RewardServer` behind a real socket,
``--clients`` client threads (rollout jobs) each sending groups of ``--group`` responses through the authenticated
client, the server batching what waits. Reported: responses/s of each (median of ``--repeats``, after a warm-up) and
(b) / (a) for both baselines, target >= 0.9. On a GPU node: ``--device cuda --hidden 1024 --layers 16``.

Run::

    .venv/bin/python bench/bench_reward.py --quick                 # both parts, short
    .venv/bin/python bench/bench_reward.py --part scoring --hidden 512 --layers 4
    .venv/bin/python bench/bench_reward.py --part generation --engine transformers
    .venv/bin/python bench/bench_reward.py --part generation --quick --no-pin   # the jobs share every core
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_parser, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hpcrl.config.registries import ENGINES  # noqa: E402
from hpcrl.logs import metric_names as M  # noqa: E402
from hpcrl.rundir.fsio import read_jsonl  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402


def build_rm(out: Path, hidden: int, layers: int) -> Path:
    """A random Qwen2 sequence classifier (one label) on the tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hpcrl.tiny.model import build_tokenizer, quiet_progress_bars

    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                      max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                      bos_token_id=None, num_labels=1, architectures=["Qwen2ForSequenceClassification"])
    torch.manual_seed(0)
    with quiet_progress_bars():
        Qwen2ForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---- generation: a rule vs the reward job --------------------------------------------------------------------

def busy_tokens_per_s(rd: RunDir) -> float:
    """Response tokens over the seconds a group was in flight, the first version left out (start-up)."""
    rows = [r for r in read_jsonl(rd.rollout_metrics("w000")) if M.TOKENS in r][1:]
    busy = sum(r[M.WALL_S] * (1.0 - r[M.ROLLOUT_IDLE_RATIO]) for r in rows)
    return sum(r[M.TOKENS] for r in rows) / busy if busy > 0 else float("nan")


def pinning_python(work: Path) -> dict[str, str]:
    """The environment of a launch whose jobs run pinned (module docstring): ``HPCRL_PYTHON`` a script that starts
    the rollout job on the first CPU this process may use and every other job on the rest (submitit's local job
    folder ends in the job's name: ``.../rollout-w000``)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs 2 CPUs, this process may use {cpus}; run with --no-pin")
    script = work / "pinned-python"
    script.write_text(f"""#!/bin/sh
# bench_reward.py: each job of the run on its own CPUs, as its own allocation would keep it
case "$*" in
  */rollout-*) exec taskset -c {cpus[0]} {shlex.quote(sys.executable)} "$@" ;;
  *) exec taskset -c {",".join(map(str, cpus[1:]))} {shlex.quote(sys.executable)} "$@" ;;
esac
""")
    script.chmod(0o755)
    print(f"pinned: the rollout job and its engine on CPU {cpus[0]}, the other jobs on CPU(s) "
          f"{','.join(map(str, cpus[1:]))}", flush=True)
    return dict(os.environ, HPCRL_PYTHON=str(script))


def launch(folder: Path, overrides: list[str], timeout_min: int, env: Optional[dict] = None) -> RunDir:
    cmd = [sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "tiny.yaml"), *overrides,
           "--run-dir", str(folder), "--executor", "local", "--timeout-min", str(timeout_min)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return RunDir(folder)


def part_generation(a, work: Path) -> list[list[str]]:
    steps = 160 if a.quick else 480
    common = [f"rollout.total_rollout_steps={steps}", "eval.every_versions=0", "rollout.max_concurrent_groups=2",
              f"rollout.engine={a.engine}", "rollout.response_length=32", "async_training.staleness_threshold=1.0"]
    if ENGINES[a.engine].cpu_min_head_dim > 32:  # vLLM's CPU attention: builtin:tiny's heads are 32 wide
        common += ["model.path=builtin:tiny-h64", "rollout.gpu_memory_utilization=0.05"]
    rm = build_rm(work / "rm", 128, 2)
    modes = {"(a) rule (toy_copy)": ["reward.name=toy_copy"],
             "(b) reward job (DisRM)": ["reward.name=by_data_source", "reward_model.enable=true",
                                        f"reward_model.path={rm}", "reward_model.placement=job"]}
    rates, env = {}, pinning_python(work) if a.pin else None
    for i, (name, extra) in enumerate(modes.items()):
        t0 = time.monotonic()
        rd = launch(work / f"gen{i}", common + extra, 30, env)
        rates[name] = busy_tokens_per_s(rd)
        print(f"{name}: {rates[name]:.0f} tokens/s while generating ({time.monotonic() - t0:.0f}s in all)",
              flush=True)
    a_rate, b_rate = rates.values()
    return [["generation tokens/s, rule", f"{a_rate:.0f}"], ["generation tokens/s, reward job", f"{b_rate:.0f}"],
            ["reward job / rule (target >= 0.9)", f"{b_rate / a_rate:.2f}"]]


# ---- scoring: the service vs a bare forward -------------------------------------------------------------------

def items_of(count: int, max_tokens: int):
    from hpcrl.reward.wire import ScoreItem

    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        n = int(torch.randint(16, max_tokens + 1, (1,), generator=g))
        prompt = torch.randint(3, 64, (8,), generator=g).tolist()
        resp = torch.randint(3, 64, (n,), generator=g).tolist() + [1]
        out.append(ScoreItem(prompt="p", prompt_ids=prompt, response_ids=resp, response="r"))
    return out


@torch.inference_mode()
def bare_rate(folder: Path, items, micro: int, device: str, by_length: bool) -> float:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).to(device).eval()
    if by_length:  # the least padding a forward can have: what the service's batching does too
        items = sorted(items, key=lambda it: -len(it.prompt_ids) - len(it.response_ids))
    t0 = time.perf_counter()
    for k in range(0, len(items), micro):
        seqs = [it.prompt_ids + it.response_ids for it in items[k:k + micro]]
        longest = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (longest - len(s)) for s in seqs], device=device)
        mask = (ids != 0).long()
        model(input_ids=ids, attention_mask=mask).logits.float().cpu()
    return len(items) / (time.perf_counter() - t0)


def service_rate(folder: Path, items, micro: int, device: str, clients: int, group: int, work: Path) -> float:
    from hpcrl.config.reward_model import RewardModelConfig
    from hpcrl.reward.client import RewardClient
    from hpcrl.reward.models import DiscriminativeRM
    from hpcrl.reward.server import RewardServer
    from hpcrl.reward.wire import RewardService
    from hpcrl.tiny.model import build_tokenizer

    rd = RunDir(work / "svc").create()
    rd.secret.write_text("bench")
    cfg = RewardModelConfig(enable=True, path=str(folder), micro_batch_size=micro)
    model = DiscriminativeRM(folder, build_tokenizer(), cfg, device, "float32")
    server = RewardServer(model, b"bench", "reward-0", "e0")
    rd.reward_service().mkdir(parents=True, exist_ok=True)
    rd.reward_service("reward-0").write_text(json.dumps(RewardService(
        job="reward-0", host="127.0.0.1", port=server.port, epoch="e0", pid=0, kind=model.kind, created_s=0).to_json()))
    groups = [items[k:k + group] for k in range(0, len(items), group)]
    try:
        client = RewardClient(rd, "bench", request_timeout_s=600, wait_s=60, wait_log_s=30)
        todo, lock = list(groups), threading.Lock()

        def work_loop():
            while True:
                with lock:
                    if not todo:
                        return
                    g = todo.pop()
                client.score(g, "bench", lambda: False)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=work_loop) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(items) / (time.perf_counter() - t0)
    finally:
        server.close()


def part_scoring(a, work: Path) -> list[list[str]]:
    folder = build_rm(work / "rm-scoring", a.hidden, a.layers)
    torch.set_num_threads(a.threads)
    items = items_of(a.items, a.tokens)
    bare, bare_sorted, ours = [], [], []
    for rep in range(a.repeats + 1):  # the first of each is a warm-up
        b = bare_rate(folder, items, a.micro_batch, a.device, by_length=False)
        bs = bare_rate(folder, items, a.micro_batch, a.device, by_length=True)
        o = service_rate(folder, items, a.micro_batch, a.device, a.clients, a.group, work / f"rep{rep}")
        if rep:
            bare.append(b)
            bare_sorted.append(bs)
            ours.append(o)
    b, bs, o = statistics.median(bare), statistics.median(bare_sorted), statistics.median(ours)
    return [["responses/s, bare transformers forward (in order)", f"{b:.0f}"],
            ["responses/s, bare forward, sorted by length", f"{bs:.0f}"], ["responses/s, reward service", f"{o:.0f}"],
            ["service / bare in order (target >= 0.9)", f"{o / b:.2f}"],
            ["service / bare sorted by length (target >= 0.9)", f"{o / bs:.2f}"]]


def main() -> None:
    p = bench_parser(__doc__, "shorter runs (both parts in a few minutes)")
    p.add_argument("--part", choices=("both", "generation", "scoring"), default="both")
    p.add_argument("--engine", choices=[e for e, spec in ENGINES.items() if not spec.simulated], default="vllm")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="generation part: the rollout job on a CPU of its own, the other jobs on the rest")
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--items", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128, help="longest response in the scoring part")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the scoring part (both sides)")
    a = p.parse_args()
    if a.quick:
        a.items, a.repeats = min(a.items, 256), min(a.repeats, 2)
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        if a.part in ("both", "scoring"):
            rows += part_scoring(a, Path(tmp))
        if a.part in ("both", "generation"):
            rows += part_generation(a, Path(tmp))
    print(table(["measure", "value"], rows))


if __name__ == "__main__":
    main()
