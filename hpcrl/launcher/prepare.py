"""Everything that happens on the login node before a job is submitted.

The config is validated (by :func:`hpcrl.config.load_config`), the model, data
and reward are checked (:mod:`hpcrl.launcher.inputs`), the run directory is created, ``builtin:tiny`` is built into ``RUN/base_model``
(a built-in reward model into ``RUN/reward_model``: ``builtin:tiny-rm`` trained there, in under a minute), the
config is frozen into ``RUN/config.yaml`` (a LoRA run's with the hash of its base model's weights) and the
broadcast secret is written (mode 0600). Nothing is submitted if any of this fails.
"""
from __future__ import annotations

import errno
import os
import secrets
import time
from pathlib import Path

from hpcrl.config import ConfigError, RunConfig
from hpcrl.config.names import BUILTIN_MODELS
from hpcrl.control.fatal import clear_fatal
from hpcrl.control.records import clear_stop, read_trainer_done
from hpcrl.launcher.inputs import check_inputs
from hpcrl.launcher.resume_changes import changes
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.adapter import BaseModelChanged, base_model_hash, verify_base


def prepare_run_dir(cfg: RunConfig, run_dir: Path, resume: bool, inputs_checked: bool = False,
                    changes: tuple[str, ...] = ()) -> RunDir:
    """Create (or, with ``resume``, re-open) the run directory of ``cfg``; ConfigError before
    anything is created if the directory holds another run or an input is wrong
    (:func:`hpcrl.launcher.inputs.check_inputs`, skipped when the caller already ran it).

    On resume the caller has checked what changed (:mod:`hpcrl.launcher.resume_changes`): the config is frozen again
    with ``changes`` added to its history; the recorded fatal error and stop request are forgotten (the user
    fixed what stopped the run, or will see it again at once); a finished run that the new config makes
    longer loses its ``trainer_done.json``, so the trainer goes on from its last checkpoint."""
    rd = RunDir(run_dir)
    if rd.config_path.exists():
        if not resume:
            raise ConfigError(f"run directory {rd.root} already holds a run; pass --resume to continue it "
                              "or choose another --run-dir")
        if changes:
            when = time.strftime("%Y-%m-%d %H:%M:%S")
            rd.freeze_config(cfg, tuple(f"{when} --resume {c}" for c in changes))
        _check_base(cfg, rd)
        clear_fatal(rd)
        clear_stop(rd)
        done = read_trainer_done(rd)
        if done is not None and cfg.total_updates > done.trainer_step:
            rd.trainer_done.unlink()
        return rd
    if resume:
        raise ConfigError(f"--resume: {rd.root} holds no run (no config.yaml)")
    if not inputs_checked:
        check_inputs(cfg)
    rd.create()
    if cfg.model.path in BUILTIN_MODELS and not rd.base_model.exists():
        from hpcrl.tiny.model import build_tiny_model, builtin_head_dim

        build_tiny_model(rd.base_model, seed=cfg.model.seed, head_dim=builtin_head_dim(cfg.model.path))
    rm_folder = rd.reward_model_dir(cfg.reward_model.path or "")
    if cfg.reward_model.enable and cfg.reward_model.builtin and not rm_folder.exists():
        from hpcrl.reward.checks import build_builtin_reward_model

        build_builtin_reward_model(cfg, rm_folder)
    _check_base(cfg, rd)
    secret = rd.secret
    if not secret.exists():
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    rd.freeze_config(cfg)
    return rd


def check_run_dir(rd: RunDir) -> None:
    """``--run-dir`` can hold the run: a folder this process can write in, or a path it can create one at (a
    folder is made and removed under the nearest existing parent: permissions, a read-only or immutable folder,
    a full quota show here, not as a bare ``[Errno 1]`` when the run is prepared). ConfigError in one line."""
    root = Path(rd.root)
    fix = "fix: choose a --run-dir in a folder you can write on the shared filesystem (a new one, or a run's to --resume)"
    place = root
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        what = "is a file" if place == root else f"is under {place}, a file"
        raise ConfigError(f"--run-dir {root} {what}, not a folder; {fix}")
    probe = place / f".hpcrl-write-test-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        where = "write in it" if place == root else f"create it in {place}"
        raise ConfigError(f"--run-dir {root}: this process cannot {where} ({e.strerror}, errno {e.errno}: "
                          f"{'owner or mode' if e.errno == errno.EACCES else 'a read-only, immutable or full folder'}"
                          f"); {fix}") from None


def occupied_message(rd: RunDir, cfg: RunConfig) -> str:
    """The line for a run directory that already holds a run, without ``--resume``: whether the run there is of this
    config, else the keys that differ."""
    head = f"run directory {rd.root} already holds a run"
    try:
        differ = changes(rd.load_config(), cfg)
    except (OSError, ValueError):
        differ = None
    if differ is None:
        return f"{head} ({rd.config_path} does not load); choose another --run-dir"
    if not differ:
        return f"{head} of this same config; pass --resume to continue it, or choose another --run-dir"
    shown = ", ".join(c.line() for c in differ[:4]) + (f" (+{len(differ) - 4} more)" if len(differ) > 4 else "")
    return (f"{head} of another config ({len(differ)} keys differ: {shown}); pass --resume to continue that run "
            "(only what may change on a live run may differ: docs/launching.md), or choose another --run-dir")


def _check_base(cfg: RunConfig, rd: RunDir) -> None:
    """A LoRA run names its base model by the hash of its weights (``model.base_hash``): written into the config here
    at launch, checked against the folder on resume (and when the user gave one); ConfigError if they differ."""
    if not cfg.lora:
        return
    folder = rd.model_dir(cfg.model.path)
    if cfg.model.base_hash is None:
        cfg.model.base_hash = base_model_hash(folder)
        return
    try:
        verify_base(folder, cfg.model.base_hash)
    except BaseModelChanged as e:
        raise ConfigError(f"config model.base_hash: {e}") from None
