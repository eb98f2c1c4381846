"""An exported folder's tokenizer under ``AutoTokenizer``: the run's own, or a plain word on which loader is.

transformers 5's ``AutoTokenizer`` takes the tokenizer class from the model type for some types and ignores the
folder's ``tokenizer_class``: a qwen2 folder gets Qwen2's byte-level BPE rebuilt from the vocabulary, which the
built-in tiny model's word-level ``tokenizer.json`` is not (it encoded ``repeat c`` as 7 ids instead of 2, and the
exported model wrote ``aaaaaaaa`` where the run's tokenizer gives ``c c c c c c c c``). An ``auto_map`` entry in
``tokenizer_config.json`` takes the folder out of that rule: without ``trust_remote_code`` transformers then loads
``tokenizer.json`` as it is (``TokenizersBackend``), and with it the class in :data:`MODULE_FILE`, which does the
same. Export adds both only where ``AutoTokenizer`` differs from the run's tokenizer, then checks again; the loader
that reproduces the run is what export prints.
"""
from __future__ import annotations

import json
from pathlib import Path

AUTO_TOKENIZER = "AutoTokenizer"
EXPLICIT = "PreTrainedTokenizerFast"
"""The class hpcrl's jobs load a generic ``tokenizer.json`` with (:func:`hpcrl.tiny.model.load_tokenizer`)."""
MODULE_FILE = "tokenization_hpcrl.py"
CLASS_NAME = "HpcrlTokenizer"
MODULE_TEXT = f'''"""The tokenizer of an hpcrl run, for AutoTokenizer (written by hpcrl export): tokenizer.json as it is.

AutoTokenizer would otherwise take the tokenizer class from the model type and rebuild another tokenizer from this
folder's vocabulary (tokenizer_config.json's auto_map points here)."""
from transformers import PreTrainedTokenizerFast


class {CLASS_NAME}(PreTrainedTokenizerFast):
    """The folder's tokenizer.json, loaded as it is."""
'''
SAMPLES = ("repeat a b c ( 3 * 4 ) .", "Natalia sold 48 clips in April. #### 72")
"""Texts both loaders must encode to the same ids (and decode back alike)."""


def same_tokenizer(a, b) -> bool:
    """``a`` and ``b`` encode :data:`SAMPLES` to the same ids and decode them to the same text."""
    for text in SAMPLES:
        ids = a(text)["input_ids"]
        if ids != b(text)["input_ids"] or a.decode(ids, skip_special_tokens=True) != b.decode(ids, skip_special_tokens=True):
            return False
    return True


def _auto_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def make_auto_tokenizer_load_it(folder: Path, notes: list[str]) -> str:
    """Make ``AutoTokenizer.from_pretrained(folder)`` load the run's tokenizer where it does not (module docstring);
    return the loader that reproduces the run: :data:`AUTO_TOKENIZER`, or :data:`EXPLICIT` (with a note why)."""
    from hpcrl.tiny.model import load_tokenizer

    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return AUTO_TOKENIZER  # no tokenizer of the run's own to reproduce: whatever AutoTokenizer finds
    ours = load_tokenizer(folder)
    theirs = _auto_tokenizer(folder)
    if same_tokenizer(ours, theirs):
        return AUTO_TOKENIZER
    picked = type(theirs).__name__
    original = config_path.read_text()
    config = json.loads(original)
    config["auto_map"] = {AUTO_TOKENIZER: [None, f"{MODULE_FILE[:-3]}.{CLASS_NAME}"]}
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (folder / MODULE_FILE).write_text(MODULE_TEXT)
    try:
        fixed = same_tokenizer(ours, _auto_tokenizer(folder))
    except Exception:  # noqa: BLE001 - a transformers that wants trust_remote_code here: the explicit loader
        fixed = False
    if fixed:
        notes.append(f"AutoTokenizer picks {picked} for this model type, which encodes differently from the run's "
                     f"tokenizer: tokenizer_config.json's auto_map (and {MODULE_FILE}) make it load the run's "
                     "tokenizer.json as it is")
        return AUTO_TOKENIZER
    config_path.write_text(original)
    (folder / MODULE_FILE).unlink()
    notes.append(f"AutoTokenizer.from_pretrained loads a {picked} for this model type, which encodes differently "
                 f"from the run's tokenizer: load the tokenizer with {EXPLICIT}.from_pretrained (what hpcrl's jobs do)")
    return EXPLICIT
