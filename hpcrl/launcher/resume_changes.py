"""``hpcrl run --resume``: what may change on a live run, and a run that has already finished.

A run is fixed and resumed with the same command it was started with, plus what changed::

    hpcrl run --resume --run-dir RUN reward.path=~/fixed_reward.py        # or CONFIG with the changes

The new config is compared with the frozen one, key by key. Keys that are safe to change on a live run
are applied and recorded in the frozen ``config.yaml``'s history (a comment block at its top, oldest
first): job sizes and Slurm options, timeouts, logging, the length of the run, checkpoint and weight
retention. The reward may change when the run stopped because the reward failed, the data when it
stopped because the data failed (``control/fatal.json`` says which input failed). Every other change is
refused with the reason (the model, the algorithm, the flow-control knobs, ...), all in one message.
``--dry-run`` goes through the same check, so it and the real resume agree.

A run whose trainer finished is finished: ``--resume`` says so and does nothing, unless it raises the
length of the run (then the trainer continues from its last checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hpcrl.config import ConfigError, RunConfig
from hpcrl.control.fatal import FatalRecord
from hpcrl.control.records import TrainerDone

SAFE = ("resources.", "timeouts.", "logging.", "rollout.total_rollout_steps", "data.epochs",
        "trainer.checkpoint_every_updates", "trainer.keep_checkpoints", "trainer.keep_consumed_shards",
        "weights.keep_versions")
"""Keys (or prefixes) that may change on every resume."""
AFTER_FAILED_INPUT = {
    "reward": ("reward.",),
    "reward_model": ("reward_model.",),
    "data": ("data.source", "data.prompt_key", "data.answer_key", "data.apply_chat_template", "data.max_prompt_length",
             "data.truncation", "algorithm.filter_groups.max_num_gen_batches"),
}
"""Keys that may change when the run stopped because that input failed (``control/fatal.json``). Dynamic
sampling's stop (``trainer/dynamic_sampling.py``: the data no longer yields groups that vary) is a data failure:
its bound may change then too."""

REASONS = (
    ("model.", "this run's checkpoints and weight versions belong to the model it started from; another model "
               "is another run (choose a new --run-dir)"),
    ("reward.", "the groups trained so far were scored by the old reward, so it may change only when the run "
                "stopped because the reward failed; to score differently from now on, start a new run from a "
                "published version (hpcrl export RUN --out DIR, then model.path=DIR)"),
    ("data.", "the prompt order (the prompt indices already committed) is that of the old data, so it may change "
              "only when the run stopped because the data failed to load"),
    ("async_training.", "the admission budget, the lag bound and the groups already committed are counted with the "
                        "old value"),
    ("rollout.n", "the groups already committed have the old group size"),
    ("actor.ppo_mini_batch_size", "the admission budget and the groups already committed are counted with the old "
                                  "R = ppo_mini_batch_size * require_batches"),
    ("", "the checkpointed model, optimizer and sample cursor were made with the old value, and a run that mixes "
         "both cannot be told apart from one that did not; start a new run from a published version "
         "(hpcrl export RUN --out DIR, then model.path=DIR)"),
)
"""Why a key may not change on resume: the first prefix that matches."""


@dataclass
class Change:
    """One key changed on resume."""

    key: str
    old: Any
    new: Any

    def line(self) -> str:
        """``reward.path: '/a.py' -> '/b.py'``."""
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v and not key.endswith(("sbatch_extra", "kwargs")):
            out.update(_leaves(v, key))
        else:
            out[key] = v
    return out


def changes(frozen: RunConfig, new: RunConfig) -> list[Change]:
    """The keys whose value differs, in the config's order."""
    old, now = _leaves(frozen.to_dict()), _leaves(new.to_dict())
    return [Change(k, old.get(k), now.get(k)) for k in now if old.get(k) != now.get(k)]


def _allowed(key: str, fatal: Optional[FatalRecord]) -> bool:
    if any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE):
        return True
    keys = AFTER_FAILED_INPUT.get(fatal.input, ()) if fatal is not None else ()
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in keys)


def check_changes(frozen: RunConfig, new: RunConfig, fatal: Optional[FatalRecord]) -> list[Change]:
    """The changes a resume applies; ConfigError naming every refused one (one line each) with the reason."""
    found = changes(frozen, new)
    refused = [c for c in found if not _allowed(c.key, fatal)]
    if refused:
        why = f" (the run stopped on: {fatal.input or 'an input'}: {fatal.message})" if fatal else ""
        raise ConfigError("\n".join(
            f"config {c.key}: got {c.new!r} on --resume, frozen {c.old!r}; allowed on a live run: "
            f"{', '.join(s.rstrip('.') + ('.*' if s.endswith('.') else '') for s in SAFE)}{why}; fix: keep "
            f"{c.old!r}: {next(r for p, r in REASONS if c.key.startswith(p))}" for c in refused))
    return found


def change_lines(found: list[Change], fatal: Optional[FatalRecord]) -> list[str]:
    """The lines a resume says and adds to the frozen config's history (with the time, by
    :meth:`hpcrl.rundir.paths.RunDir.freeze_config`'s caller)."""
    why = f" (after: {fatal.input or 'input'} failed)" if fatal else ""
    return [f"{c.line()}{why}" for c in found]


def finished_message(done: Optional[TrainerDone], cfg: RunConfig, run_dir: str) -> Optional[str]:
    """The line for ``--resume`` of a finished run (None if the run is not finished, or the new config makes
    it longer: then the trainer goes on from its last checkpoint)."""
    if done is None or cfg.total_updates > done.trainer_step:
        return None
    return (f"run {run_dir} finished: {done.trainer_step} updates, version {done.param_version}, "
            f"{done.consumed_groups} groups; nothing to resume (to train longer: --resume "
            f"rollout.total_rollout_steps=N with N > {cfg.rollout.total_rollout_steps}); next: hpcrl report {run_dir}, "
            f"hpcrl export {run_dir} --out DIR")
