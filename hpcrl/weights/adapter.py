"""LoRA adapter versions (``actor.lora_rank``): which files a version holds, the adapter's config, and the base
model the adapter belongs to.

An adapter version is a folder in peft's own layout, so ``PeftModel.from_pretrained(base, folder)`` and vLLM's
``LoRARequest(..., folder)`` read it as it is::

    weights/v000007/ adapter_model.safetensors  the adapter's tensors under peft's saved names
                                                (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)
                     adapter_config.json        peft's LoraConfig (rank, alpha, target modules, the base's path)
                     manifest.json              last, as for full versions: sizes and hashes of both files, and
                                                ``adapter`` naming the base (its path and the hash of its weights)

Written, verified, pinned, retained and broadcast exactly as full versions are (``publisher.py``,
``subscriber.py``, ``broadcast.py``): only the two file names differ (:func:`version_files`). The base is named by the hash of its
weight files (:func:`base_model_hash`), computed once at launch into the frozen config (``model.base_hash``) and
checked by every job before it applies an adapter to the folder it loaded (:func:`verify_base`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from hpcrl.rundir.paths import WEIGHT_ADAPTER_CONFIG, WEIGHT_ADAPTER_TENSORS, WEIGHT_MODEL_CONFIG, WEIGHT_TENSORS
from hpcrl.weights.manifest import AdapterBase, FileEntry
from hpcrl.weights.file_hash import CHUNK_BYTES, HASH_ALGORITHM, HASHES, DamagedFile, check_file

BASE_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
"""The files of a model folder that hold its weights (what the base hash covers)."""


class BaseModelChanged(ValueError):
    """The base model's weight files are not those the run's adapters were trained on."""


def version_files(adapter: Optional[AdapterBase]) -> tuple[str, str]:
    """(tensors file, config file) of a version: peft's names for an adapter, the HF model's otherwise."""
    return (WEIGHT_ADAPTER_TENSORS, WEIGHT_ADAPTER_CONFIG) if adapter is not None else (WEIGHT_TENSORS,
                                                                                        WEIGHT_MODEL_CONFIG)


def base_model_hash(folder: os.PathLike | str) -> str:
    """``xxh3_128:<hex>`` over the model folder's weight files (:data:`BASE_WEIGHT_PATTERNS`), each file's name,
    size and bytes in name order; ValueError if the folder has none."""
    folder = Path(folder)
    files = sorted({p for pattern in BASE_WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    if not files:
        raise ValueError(f"{folder} holds no weight files ({' or '.join(BASE_WEIGHT_PATTERNS)})")
    h = HASHES[HASH_ALGORITHM]()
    for path in files:
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(64 * CHUNK_BYTES):
                h.update(chunk)
    return f"{HASH_ALGORITHM}:{h.hexdigest()}"


def verify_base(folder: os.PathLike | str, expected: Optional[str]) -> None:
    """BaseModelChanged (one line: both hashes, the fix) if the weights in ``folder`` do not hash to ``expected``
    (``model.base_hash``; None: a run that is not LoRA, nothing to check)."""
    if expected is None:
        return
    found = base_model_hash(folder)
    if found != expected:
        raise BaseModelChanged(f"the base model's weights in {folder} hash to {found}, but this run's adapters were "
                               f"trained on {expected} (model.base_hash in the run's config): an adapter applied to "
                               "another base means nothing; restore the folder the run started from, or start a new "
                               "run on this one")


def read_adapter_config(path: Path, entry: FileEntry) -> dict:
    """peft's adapter config in ``path``, verified against its manifest ``entry``; DamagedFile if the bytes differ
    or it is not a LoRA config."""
    check_file(path, entry.size_bytes, entry.hash_algorithm, entry.hash_hex)
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise DamagedFile(f"{path.name}: not JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA" or not isinstance(config.get("r"), int):
        raise DamagedFile(f"{path.name}: not a peft LoRA config (peft_type {config.get('peft_type')!r})"
                          if isinstance(config, dict) else f"{path.name}: not a JSON object")
    return config
