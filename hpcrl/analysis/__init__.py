"""Offline analysis of run directories and the live status view.

- :mod:`hpcrl.analysis.load`       read a run directory tolerantly (RunData, RunFormatError)
- :mod:`hpcrl.analysis.tables`     every number of the report, defined from the raw logs
- :mod:`hpcrl.analysis.recommend`  the bottleneck / knob recommendation from the idle ratios
- :mod:`hpcrl.analysis.plots`      one PNG per view of one run; :mod:`~hpcrl.analysis.compare` overlays runs
- :mod:`hpcrl.analysis.report`     ``hpcrl report RUN_DIR ... --out DIR`` (Markdown + HTML)
- :mod:`hpcrl.analysis.status`     ``hpcrl status RUN_DIR`` (plain text, refreshing)

The commands are ``hpcrl report``, ``hpcrl status`` and ``hpcrl summary`` (hpcrl/cli.py);
this package is library code (no printing). Nothing
here imports torch or DeepSpeed: it runs on a login node with pandas and matplotlib.
"""
