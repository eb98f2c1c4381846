"""The tiny task end to end for ``bench/gpu_check.sh``: trainer + one rollout job on this node
(``--executor local``), ``rollout.engine=vllm`` with weights by broadcast, then the exactly-once audit.

    python bench/gpu_check_e2e.py RUN_DIR OUT.json [--min-reward R] [key=value ...]

Writes the figures (wall seconds, updates, reward of the first and last fifth, how many versions reached
vLLM by broadcast, the audit's counts) to OUT.json; exits 1 if the run failed, the audit found a problem or,
with ``--min-reward``, the mean reward of the last fifth of the updates is below R (the task was not learnt).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcrl.analysis.exactly_once import audit  # noqa: E402
from hpcrl.rundir.fsio import read_jsonl  # noqa: E402
from hpcrl.logs.run_logs import read_metrics  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

OVERRIDES = ["model.path=builtin:tiny-h64", "rollout.engine=vllm", "weights.transport=broadcast",
             "rollout.total_rollout_steps=160", "eval.every_versions=0"]
"""160 groups: 40 updates of the tiny task (a few minutes on 2 CPU cores, seconds on a GPU); a later
``rollout.total_rollout_steps=N`` among the arguments sets another length (gpu_check.sh's GPU_CHECK_E2E_UPDATES)."""


def main(argv: list[str]) -> int:
    run, out, extra = Path(argv[0]), Path(argv[1]), argv[2:]
    min_reward = None
    if extra[:1] == ["--min-reward"]:
        min_reward, extra = float(extra[1]), extra[2:]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "tiny.yaml"), *OVERRIDES,
                           *extra, "--run-dir", str(run), "--executor", "local", "--timeout-min", "25"],
                          capture_output=True, text=True, cwd=REPO)
    wall_s = time.monotonic() - t0
    figures: dict = {"wall_s": round(wall_s, 1), "rc": proc.returncode, "overrides": OVERRIDES + extra}
    if proc.returncode != 0:
        figures["output_tail"] = (proc.stdout + proc.stderr).splitlines()[-20:]
        out.write_text(json.dumps(figures, indent=1) + "\n")
        print("\n".join(figures["output_tail"]), file=sys.stderr)
        return 1
    rd = RunDir(run)
    reward = read_metrics(rd)["reward/mean"].to_numpy()
    fifth = max(len(reward) // 5, 1)
    paths = [r["weights/path"] for r in read_jsonl(rd.rollout_metrics(RunDir.writer_name(0)))]
    a = audit(rd, rd.load_config().knobs.group_bound)
    figures.update(updates=len(reward), reward_first_fifth=float(reward[:fifth].mean()),
                   reward_last_fifth=float(reward[-fifth:].mean()), versions_loaded=len(paths),
                   versions_by_broadcast=paths.count("broadcast"), consumed_groups=a.consumed_groups,
                   exactly_once_problems=a.problems())
    learnt = min_reward is None or figures["reward_last_fifth"] >= min_reward
    figures.update(min_reward=min_reward, learnt=learnt)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures), file=sys.stderr)
    if not learnt:
        print(f"gpu_check_e2e: the reward of the last fifth is {figures['reward_last_fifth']:.3f}, below "
              f"{min_reward}: the tiny task was not learnt in {len(reward)} updates", file=sys.stderr)
    return 1 if a.problems() or a.consumed_groups == 0 or not learnt else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
