"""hpcrl: fully asynchronous RL post-training of LLMs on Slurm clusters, without Ray."""


def launch(*args, **kwargs):
    """See :func:`hpcrl.launch.api.launch` (imported lazily: job processes do not need it)."""
    from hpcrl.launch.api import launch as _launch

    return _launch(*args, **kwargs)
