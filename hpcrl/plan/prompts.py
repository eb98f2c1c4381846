"""The prompt lengths ``hpcrl plan`` simulates with: the config's data through its tokenizer, as a rollout job
prepares them (``rollout/data.py``: chat template, ``data.max_prompt_length`` and its truncation policy), or one
number given with ``--prompt-tokens``."""
from __future__ import annotations

from typing import Optional, Union

from hpcrl.config import ConfigError, RunConfig


def prompt_lengths(cfg: RunConfig, prompt_tokens: Optional[int]) -> tuple[Union[int, list[int]], str]:
    """Per data row, the prompt's tokens (or ``prompt_tokens`` for all); and a line saying which. ValueError that
    names ``--prompt-tokens`` when the data or the tokenizer cannot be read here."""
    if prompt_tokens is not None:
        if prompt_tokens < 1:
            raise ValueError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
        return prompt_tokens, f"prompts {prompt_tokens} tokens (--prompt-tokens)"
    from hpcrl.rollout.data import encode_rows, load_model_tokenizer
    from hpcrl.rollout.dataset import load_rows

    try:
        tokenizer = load_model_tokenizer(cfg)
        rows, _, _ = encode_rows(tokenizer, cfg.data, load_rows(cfg.data, cfg.rollout.response_length))
    except (ConfigError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the prompt lengths come from data.source={cfg.data.source} through the tokenizer of "
                         f"model.path={cfg.model.path}, which could not be read here ({first}); pass "
                         "--prompt-tokens N (the prompts' mean length in tokens)") from None
    lengths = [len(r["prompt_ids"]) for r in rows]
    return lengths, (f"prompts from data.source ({len(lengths)} rows, mean {sum(lengths) / len(lengths):.0f} "
                     f"tokens, longest {max(lengths)})")
