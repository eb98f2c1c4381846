#!/usr/bin/env bash
# Launch a whole hpcrl run with plain sbatch: one trainer job + one rollout job array
# (+ the evaluation job, sbatch/eval.sbatch, when the config has eval.every_versions > 0).
#
#   sbatch/submit.sh [--dry-run] CONFIG RUN_DIR [key=value ...]
#
# `hpcrl sbatch-lines` checks the config (nothing is submitted if it is wrong),
# prepares RUN_DIR (frozen config, tiny model, setup files) and prints one sbatch
# command per job, with the sizes and Slurm options of the config. --dry-run
# prints them without preparing or submitting anything.
# Follow the run with `tail -f RUN_DIR/logs/jobs/trainer.log` (or `hpcrl status`).
set -euo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
CONFIG="${1:?usage: $0 [--dry-run] CONFIG RUN_DIR [key=value ...]}"
RUN_DIR="${2:?usage: $0 [--dry-run] CONFIG RUN_DIR [key=value ...]}"
shift 2
HERE="$(cd "$(dirname "$0")" && pwd)"
# The python that has hpcrl installed: HPCRL_PYTHON, else the repository's .venv (install.sh), else python3.
if [ -n "${HPCRL_PYTHON:-}" ]; then PYTHON="$HPCRL_PYTHON"
elif [ -x "$HERE/../.venv/bin/python" ]; then PYTHON="$HERE/../.venv/bin/python"
else PYTHON="$(command -v python3)"; fi
if ! err="$("$PYTHON" -c 'import hpcrl.cli, h5py, submitit' 2>&1)"; then
  echo "submit.sh: $PYTHON cannot import hpcrl ($(echo "$err" | tail -n 1)); run ./install.sh and" \
       "'source .venv/bin/activate', or set HPCRL_PYTHON=/path/to/.venv/bin/python" >&2
  exit 1
fi

if [ "$DRY" = 1 ]; then
  exec "$PYTHON" -m hpcrl sbatch-lines "$CONFIG" "$@" --run-dir "$RUN_DIR" --scripts "$HERE" --dry-run
fi
mapfile -t LINES < <("$PYTHON" -m hpcrl sbatch-lines "$CONFIG" "$@" --run-dir "$RUN_DIR" --scripts "$HERE")
if [ "${#LINES[@]}" -eq 0 ]; then echo "submit.sh: nothing to submit (see the error above)" >&2; exit 1; fi
for line in "${LINES[@]}"; do
  case "$line" in sbatch\ *) ;; *) echo "$line" >&2; continue;; esac  # only sbatch lines are run; a stray one is shown
  echo "+ $line" >&2
  job_id="$(eval "$line")"
  echo "$job_id"
done
