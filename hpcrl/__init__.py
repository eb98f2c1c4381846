"""hpcrl: fully asynchronous RL post-training of LLMs on Slurm clusters, without Ray."""

__version__ = "0.1.0"
"""The package version (``hpcrl --version``; setup.cfg reads it from here)."""


def launch(*args, **kwargs):
    """See :func:`hpcrl.launcher.api.launch` (imported lazily: job processes do not need it)."""
    from hpcrl.launcher.api import launch as _launch

    return _launch(*args, **kwargs)
