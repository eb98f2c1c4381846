"""The tiny default model: a word-level tokenizer and a random-init Qwen2 causal LM,
built locally (no hub access), saved as an ordinary HF folder.

Sizes: vocab 64, hidden 128, 2 layers, head dim 32; ~0.3M parameters. Measured on
the 2-core CI machines: ~6,000 tokens/s with ``generate()`` on one core, and the
toy task learnt in ~300 GRPO updates.
"""
from __future__ import annotations

import string
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
WORDS = ["repeat", "copy", "say", "=", ":", "?", "yes", "no", "the", "an", "and", "is", "of", "to", "in", "it",
         "!", ".", ",", "+", "-", "*", "(", ")", "[", "]"]


def tiny_vocab() -> list[str]:
    """The 64 words of the tiny tokenizer: specials, letters, digits, a few words and signs."""
    vocab = [PAD, EOS, UNK] + list(string.ascii_lowercase) + list(string.digits) + WORDS
    assert len(vocab) == len(set(vocab))
    return vocab[:64]


TINY_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}= {{ m['content'] | list | reject('equalto', ' ') | join(' ') }} . "
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] }} <eos> "
    "{%- else -%}{{ m['content'] }} {% endif -%}"
    "{%- endfor -%}")
"""The tiny tokenizer's chat template, in its 64 words: a user (or system) turn is its text, an
assistant turn its text and ``<eos>``, a tool turn ``= <the result, one character per word> .``
(so ``12`` becomes ``= 1 2 .``). There is no generation prompt, so a one-message prompt is
exactly its text, as without a template."""


def build_tokenizer():
    """The tiny word-level tokenizer (whitespace-split, :func:`tiny_vocab`) with its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(tiny_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    out.chat_template = TINY_CHAT_TEMPLATE
    return out


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the block (on again after, if they were on)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def builtin_head_dim(path: str) -> int:
    """The head dim of a built-in ``model.path`` (``builtin:tiny``: 32, ``builtin:tiny-h64``: 64)."""
    return 64 if path.endswith("-h64") else 32


def tiny_config(head_dim: int = 32, tokenizer=None):
    """The tiny model's Qwen2Config (``head_dim`` 32 or 64)."""
    from transformers import Qwen2Config

    tokenizer = tokenizer or build_tokenizer()
    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=128 // head_dim, num_key_value_heads=64 // head_dim, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)


def build_tiny_model(out_dir: Path | str, seed: int = 0, head_dim: int = 32) -> Path:
    """Write tokenizer + random-init model to ``out_dir`` (an HF folder) and return it.

    ``head_dim`` 32 (4 query heads, 2 KV heads) or 64 (2 and 1, for vLLM's CPU attention, which
    refuses head dim 32): every weight has the same shape and, for one seed, the same values."""
    if head_dim not in (32, 64):
        raise ValueError(f"head_dim {head_dim}: the tiny model has 32 or 64")
    import torch
    from transformers import Qwen2ForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_config(head_dim, tokenizer)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    with quiet_progress_bars():  # transformers' "Writing model shards" bar would land in hpcrl run's output
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def load_tokenizer(model_dir: Path | str):
    """The tokenizer saved in ``model_dir``.

    transformers 5's ``AutoTokenizer`` picks the tokenizer class from the model
    type (Qwen2 -> a byte-level BPE rebuilt from the vocab), which silently
    ignores a generic ``tokenizer.json`` such as the tiny model's word-level one.
    A folder whose tokenizer config names the generic class is loaded as exactly
    that file.
    """
    import json

    cfg_path = Path(model_dir) / "tokenizer_config.json"
    cls = json.loads(cfg_path.read_text()).get("tokenizer_class") if cfg_path.is_file() else None
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast") and (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer  # imports torch and transformers' model registry: ~4 CPU-s more

    return AutoTokenizer.from_pretrained(model_dir)
