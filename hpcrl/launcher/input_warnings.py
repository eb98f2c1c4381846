"""What the inputs allow but is almost surely a mistake, found with the input checks before anything is submitted
(:mod:`hpcrl.launcher.inputs`). Each is one line ``warning: ...`` saying what was found, why it matters and the fix;
``hpcrl run`` and ``--dry-run`` print them last, and none stops the run.

- **The model cannot read the data**: more than :data:`UNKNOWN_TOKEN_SHARE` of the prompt tokens are its
  tokenizer's unknown token (the tiny model's 64 words against GSM8K's prompts).
- **The model cannot write a right answer**: the reward probe's right answer (``#### 72``), encoded and decoded
  by the model's tokenizer as the rollout job decodes, scores less (``####`` and ``72`` become ``<unk>``: no
  response can ever earn a reward).
- **A reward scores a data source it was not written for**: a built-in ``reward.name`` (or ``eval.reward.name``)
  on rows whose ``data_source`` has another rule (``gsm8k`` on ``builtin:toy_heldout``, a toy_copy task).
- **The evaluation measures another task**: the held-out rows' tasks (their data sources' rules) share none with
  the training data's (GSM8K training, the toy held-out set of ``configs/tiny.yaml``).
"""
from __future__ import annotations

from typing import Optional

from hpcrl.config import RewardConfig, RunConfig
from hpcrl.config.names import BUILTIN_MODELS, BY_DATA_SOURCE
from hpcrl.config.registries import REWARDS
from hpcrl.rollout.reward_fn import RewardProbe
from hpcrl.rollout.rewards import scorer_for

WARNING = "warning: "
"""How every warning line begins (``hpcrl run`` prints them last, on stderr)."""
UNKNOWN_TOKEN_SHARE = 0.05
"""A larger share of the prompt tokens that are the tokenizer's unknown token is warned about (a byte-level
tokenizer has none; the toy tasks under ``builtin:tiny`` have none)."""


def _tokenizer_fix(cfg: RunConfig) -> str:
    fix = ("fix: a model whose tokenizer covers the data (model.path: a Hugging Face folder of a model trained on "
           "such text, e.g. Qwen2.5-0.5B-Instruct)")
    if cfg.model.path in BUILTIN_MODELS:
        fix += f"; {cfg.model.path} knows only the 64 words of the toy tasks"
    return fix


def unknown_tokens(cfg: RunConfig, tokenizer, rows: list[dict], where: str) -> list[str]:
    """The warning for prompts (rows with ``prompt_ids``) the model's tokenizer mostly does not know."""
    unk = getattr(tokenizer, "unk_token_id", None)
    total = sum(len(r["prompt_ids"]) for r in rows)
    if unk is None or not total:
        return []
    unknown = sum(list(r["prompt_ids"]).count(unk) for r in rows)
    if unknown / total <= UNKNOWN_TOKEN_SHARE:
        return []
    return [f"{WARNING}{where}: {unknown / total:.0%} of the prompt tokens ({unknown} of {total}) are unknown to the "
            f"model's tokenizer ({tokenizer.unk_token}): the model cannot read them; {_tokenizer_fix(cfg)}"]


def unwritable_answers(cfg: RunConfig, probe: RewardProbe, key: str) -> list[str]:
    """The warning for data sources whose right answer the model's tokenizer cannot write."""
    if not probe.unwritable:
        return []
    return [f"{WARNING}{key}: the model cannot write a right answer ({'; '.join(probe.unwritable[:3])} by its "
            f"tokenizer, which the reward scores lower), so no response can earn the full reward; "
            f"{_tokenizer_fix(cfg)}"]


def _rule(source: str) -> Optional[str]:
    try:
        return scorer_for(source)
    except ValueError:
        return None


def rule_mismatch(reward: RewardConfig, rows: list[dict], key: str, where: str) -> list[str]:
    """A built-in rule named in ``key`` scoring rows whose data source has another rule (one warning per source)."""
    if reward.path is not None or reward.name == BY_DATA_SOURCE:
        return []
    out = []
    for source in dict.fromkeys(r["data_source"] for r in rows):
        theirs = _rule(source)
        if theirs is not None and REWARDS[theirs] != REWARDS[reward.name]:  # two names of one rule agree
            out.append(f"{WARNING}{key}={reward.name} scores {where}'s data_source {source!r}, whose rule is {theirs}: "
                       f"it was not written for these rows and will score them wrong; fix: {key}={theirs}, or "
                       f"{key}={BY_DATA_SOURCE} (each row's rule)")
    return out


def _task(source: str) -> str:
    """A data source's task: the rule that scores it (``builtin:toy`` and ``builtin:toy_heldout`` are one), else its
    name."""
    return _rule(source) or source


def another_task(train_rows: list[dict], heldout_rows: list[dict]) -> list[str]:
    """The warning for held-out rows whose tasks share none with the training data's (only where a task is known:
    two sources of your own may well be one task under two names)."""
    train = dict.fromkeys(r["data_source"] for r in train_rows)
    held = dict.fromkeys(r["data_source"] for r in heldout_rows)
    if not train or {_task(s) for s in train} & {_task(s) for s in held}:
        return []
    if not any(_rule(s) for s in (*train, *held)):
        return []
    return [f"{WARNING}data.val_files: the held-out rows (data_source {', '.join(held)}) are none of the training "
            f"data's tasks ({', '.join(train)}): the evaluation measures another task, scored by the evaluation's "
            "reward; fix: point data.val_files at held-out rows of the training task (e.g. its test split), or "
            "eval.every_versions=0 for no evaluation"]
