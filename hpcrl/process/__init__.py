"""What a job process needs from its operating system, below every exchange between jobs:
signals (:mod:`termination`: SIGTERM; :mod:`preemption`: USR2), test-only fault points
(:mod:`faults`), threads the process waits for at exit (:mod:`threads`), and a watchdog that
kills an engine's child processes when the job is SIGKILLed (:mod:`reaper`).

Nothing here knows about the run directory: these modules import nothing of hpcrl."""
