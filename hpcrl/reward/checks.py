"""The reward model's inputs, checked on the login node before anything is submitted, and the built-in tiny reward
models built into the run directory at launch (``builtin:tiny-rm``, ``builtin:tiny-judge``).

Checked (each a ConfigError in one line, in the launch's one pass; ``launcher/inputs.py`` calls it): the folder of
``reward_model.path`` holds ``config.json`` whose architecture says the kind (or ``reward_model.kind`` does) and a
tokenizer; the score parser of a judge loads; ``reward.path``'s function can be called with what it names of
``rm_score`` and ``reward_model``. The model itself is loaded by the reward job (a model that does not load there
stops the run with ``control/fatal.json``).
"""
from __future__ import annotations

from pathlib import Path

from hpcrl.config import RunConfig
from hpcrl.config.checks import bad
from hpcrl.config.names import BUILTIN_REWARD_MODELS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_reward_model(cfg: RunConfig) -> list[str]:
    """The checks of the module docstring; the line saying what the reward is."""
    from hpcrl.reward.models import GENERATIVE, RewardModelLoadError, configured_kind
    from hpcrl.reward.parsers import ParserLoadError, load_parser
    from hpcrl.rollout.reward_fn import RewardLoadError, load_reward

    rm = cfg.reward_model
    if rm.builtin:
        kind = configured_kind(rm)
        where = f"{rm.path} (built into the run directory at launch)"
    else:
        folder = Path(rm.path).expanduser()
        fix = "point reward_model.path at a local HF folder written by save_pretrained() (model and tokenizer)"
        if not (folder / "config.json").is_file():
            raise bad("reward_model.path", rm.path, "a local HF model folder with config.json", fix)
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise bad("reward_model.path", rm.path, f"a folder with a tokenizer ({' or '.join(TOKENIZER_FILES)})", fix)
        try:
            kind = configured_kind(rm)
        except RewardModelLoadError as e:
            raise bad("reward_model.kind", rm.kind, "discriminative or generative", str(e)) from None
        where = str(folder)
    if kind == GENERATIVE:
        try:
            load_parser(rm.score_parser)
        except ParserLoadError as e:
            raise bad("reward_model.score_parser", rm.score_parser, "a built-in parser or FILE.py:FUNCTION",
                      str(e)) from None
    try:
        fn = load_reward(cfg.reward, with_model=True)
    except RewardLoadError as e:
        raise bad("reward.path", cfg.reward.path, "a function that can be called as verl calls it (it may also "
                  "take rm_score and reward_model)", str(e)) from None
    placement = (f"{cfg.resources.reward_jobs} reward job(s) of their own" if rm.placement == "job"
                 else "each rollout job")
    what = ("the model's score" if cfg.reward.path is None else
            f"{fn.signature} from {cfg.reward.path}, called with {', '.join(fn.passed)}")
    return [f"reward model: {kind} {where} in {placement}; the reward is {what}"]


def build_builtin_reward_model(cfg: RunConfig, folder: Path) -> None:
    """Build ``builtin:tiny-rm`` (trained on the run's prompts to predict their data source's built-in rule) or
    ``builtin:tiny-judge`` into ``folder``; ConfigError when the prompts have no built-in rule to learn."""
    from hpcrl.rollout.data import encode_rows
    from hpcrl.rollout.dataset import load_rows
    from hpcrl.rollout.rewards import builtin_rule, scorer_for
    from hpcrl.tiny.model import build_tokenizer
    from hpcrl.tiny.reward_model import build_tiny_judge, build_tiny_rm

    rm = cfg.reward_model
    assert rm.path in BUILTIN_REWARD_MODELS, rm.path
    if rm.path == "builtin:tiny-judge":
        build_tiny_judge(folder, seed=cfg.model.seed)
        return
    tokenizer = build_tokenizer()
    rows, _, _ = encode_rows(tokenizer, cfg.data, load_rows(cfg.data, cfg.rollout.response_length))
    try:
        rules = {s: builtin_rule(scorer_for(s)) for s in {r["data_source"] for r in rows}}
    except ValueError as e:
        raise bad("reward_model.path", rm.path, "a folder of yours for these prompts (builtin:tiny-rm learns the "
                  "built-in rule of each row's data_source)", str(e)) from None
    if any(getattr(rule, "wants_extra_info", False) for rule in rules.values()) or len(rules) != 1:
        raise bad("reward_model.path", rm.path, "a folder of yours: builtin:tiny-rm learns one data source's rule "
                  "of the response text alone", f"the prompts' data sources are {', '.join(sorted(rules))}")
    build_tiny_rm(folder, [(r["prompt_ids"], r["answer"]) for r in rows], cfg.rollout.response_length,
                  next(iter(rules.values())), seed=cfg.model.seed)
