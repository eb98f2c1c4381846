"""The run directory's ground floor: every path and job name of a run (``paths.py``), how a file another job
reads is written and read (``fsio.py``), writes that survive a full or failing disk (``disk.py``), and the base of
every record that crosses a job boundary (``json_record.py``)."""
