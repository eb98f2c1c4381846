"""What ``squeue`` says of some jobs, asked in one call: the one place hpcrl runs ``squeue`` (the launcher follows its
jobs with it, ``launcher/jobs.py``; a rollout writer asks it before it reclaims a gone writer's claims,
``control/reclaim.py``)."""
from __future__ import annotations

import subprocess
from typing import Optional


def squeue_states(job_ids: list[str], timeout_s: float) -> tuple[Optional[dict[str, str]], str]:
    """``squeue -h -j ID,ID,... -o "%i %T"``: ``({job id: state}, "")`` for the jobs the queue lists (a job it
    does not list has ended, or the controller forgot it), or ``(None, error)`` when Slurm could not tell (no
    ``squeue``, no answer within ``timeout_s``, another error). Array tasks are named as Slurm names them
    (``120_3``)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T"], capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"squeue gave no answer in {timeout_s:g} s"
    except OSError as e:  # not installed, not executable
        return None, f"squeue could not run ({e})"
    if out.returncode != 0:
        if "invalid job id" in out.stderr.lower():  # a single id the controller forgot (MinJobAge after its end)
            return {}, ""
        return None, f"squeue exited {out.returncode}: {out.stderr.strip()[-200:]}"
    return {words[0]: words[1] for words in (line.split() for line in out.stdout.splitlines()) if len(words) >= 2}, ""
