"""The records the jobs coordinate through (heartbeats, pins, trainer_done, fatal, stop, drain, scale), the shared
admission budget and prompt claims, the fleet's history, and every job's one life cycle (``job.py``)."""
