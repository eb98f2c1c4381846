"""The run's logs: every column name another job or the analysis reads (``metric_names.py``), the metrics and
staleness logs and the job's logging set-up (``run_logs.py``), the trackers they also go to (``trackers.py``), and
the evaluation's records (``eval_log.py``)."""
