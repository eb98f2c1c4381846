"""The login node's part: check every input in one pass, prepare the run directory, submit the jobs (submitit or
sbatch), follow and resubmit them, resize the rollout fleet, and what ``hpcrl run`` prints."""
