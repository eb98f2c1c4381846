"""``hpcrl export`` of a LoRA run's version (``actor.lora_rank``): the adapter folder, or (``--merge``) the base model
with the adapter merged into its weights.

- **adapter** (default): ``adapter_model.safetensors`` and ``adapter_config.json`` as published (peft's layout; its
  ``base_model_name_or_path`` is the run's base model folder), every byte checked against the version's manifest,
  and the base's tokenizer files, so that ``PeftModel.from_pretrained(base, DIR)``, transformers'
  ``AutoModelForCausalLM.from_pretrained(DIR)`` (peft installed: it loads the base named in the config) and vLLM's
  ``LoRARequest(name, id, DIR)`` on the base read it as it is.
- **merged** (``--merge``): the base model (``model.path``, its weights checked against the hash the run trained on)
  with the adapter applied by peft and merged (``merge_and_unload``), saved as an ordinary Hugging Face folder in the
  base's dtype with its tokenizer and generation config: it loads in ``AutoModelForCausalLM`` and vLLM like any model.

The caller (``export.py``) writes into a temporary folder and renames it when everything is in place.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from hpcrl.rundir.paths import WEIGHT_MODEL_FILES, RunDir
from hpcrl.weights.adapter import BaseModelChanged, verify_base
from hpcrl.weights.manifest import WeightManifest
from hpcrl.weights.file_hash import check_file


def copy_adapter(rd: RunDir, version: int, manifest: WeightManifest, folder: Path) -> None:
    """The adapter's files, checked against the manifest (FileNotFoundError / DamagedFile if changed meanwhile)."""
    for name, entry in manifest.files.items():
        dst = folder / name
        shutil.copyfile(rd.weight_file(version, name), dst)
        check_file(dst, entry.size_bytes, entry.hash_algorithm, entry.hash_hex)


def base_files(base: Path, folder: Path) -> list[str]:
    """The base model's tokenizer and generation files copied into ``folder``; their names."""
    taken = [n for n in WEIGHT_MODEL_FILES if (base / n).is_file() and not (folder / n).exists()]
    for name in taken:
        shutil.copyfile(base / name, folder / name)
    return taken


def merge(adapter_dir: Path, base: Path, expected_hash: str, out: Path) -> None:
    """The base with the adapter in ``adapter_dir`` merged, saved to ``out`` (an empty folder); BaseModelChanged if
    the base's weights are not those the adapter was trained on."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpcrl.tiny.model import quiet_progress_bars

    verify_base(base, expected_hash)
    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        dtype = next(model.parameters()).dtype
        merged = PeftModel.from_pretrained(model, adapter_dir, torch_device="cpu").merge_and_unload()
        merged.to(dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32)
        merged.save_pretrained(out)
    base_files(base, out)


def export_adapter(rd: RunDir, version: int, manifest: WeightManifest, tmp: Path, merged: bool) -> list[str]:
    """Fill ``tmp`` with version ``version``'s adapter folder, or the merged model (module docstring); notes."""
    base = Path(manifest.adapter.path)
    if not merged:
        copy_adapter(rd, version, manifest, tmp)
        taken = base_files(base, tmp)
        return [f"a LoRA adapter of {base} (rank and targets in adapter_config.json); tokenizer files copied from "
                f"there: {', '.join(taken) or 'none'}; --merge writes the merged model instead"]
    adapter_dir = tmp.with_name(tmp.name + ".adapter")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    adapter_dir.mkdir(parents=True)
    try:
        copy_adapter(rd, version, manifest, adapter_dir)
        merge(adapter_dir, base, manifest.adapter.hash, tmp)
    finally:
        shutil.rmtree(adapter_dir, ignore_errors=True)
    return [f"the adapter merged into {base} (checked: its weights hash to {manifest.adapter.hash})"]


__all__ = ["BaseModelChanged", "export_adapter"]
