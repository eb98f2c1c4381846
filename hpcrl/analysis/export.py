"""``hpcrl export RUN [--version last|N] --out DIR``: take the trained model out of a run.

Every full weight version is a complete Hugging Face folder (``weights/vNNNNNN/``: ``model.safetensors``,
``config.json``, the model's tokenizer and chat template, its generation config; each listed and hashed in the
version's manifest). Export copies one version's files to ``DIR`` and checks every copied byte against the
manifest, so a version deleted or damaged while it was copied (retention on a live run) is an error, not a
broken folder. A delta version (``weights.delta``: ``model.delta`` instead of ``model.safetensors``) is rebuilt
against its base and verified tensor by tensor as a rollout job does, and written as ``model.safetensors``.
``DIR`` then loads as it is in ``AutoModelForCausalLM.from_pretrained(DIR)``,
``AutoTokenizer.from_pretrained(DIR)`` (which export checks against the run's tokenizer, and makes agree where it
would pick another class from the model type: :mod:`hpcrl.analysis.export_tokenizer`) and vLLM (``LLM(model=DIR)``).

A LoRA run's version (``actor.lora_rank``) is an adapter: export writes its adapter folder (peft's layout, with
the base's tokenizer), or with ``--merge`` the base model with the adapter merged (``export_adapter.py``).

A version published by an older hpcrl has no tokenizer files: they are taken from the run's model folder (the
tokenizer does not change during training), and a ``generation_config.json`` is written from ``config.json``
when there is none. Nothing in the run directory is changed.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpcrl.analysis.export_tokenizer import AUTO_TOKENIZER, make_auto_tokenizer_load_it
from hpcrl.analysis.export_adapter import BaseModelChanged, export_adapter
from hpcrl.rundir.fsio import fsync_path, read_json
from hpcrl.rundir.paths import WEIGHT_ADAPTER_CONFIG, WEIGHT_DELTA, WEIGHT_MODEL_CONFIG, WEIGHT_MODEL_FILES, WEIGHT_TENSORS, RunDir
from hpcrl.weights.delta_versions import DeltaReader
from hpcrl.weights.manifest import WeightManifest
from hpcrl.weights.file_hash import DamagedFile, check_file
from hpcrl.weights.safetensors_io import save_hashed

GENERATION_CONFIG = "generation_config.json"


class ExportError(ValueError):
    """The run, the version or the output folder is not what export needs (one line: what and the fix)."""


@dataclass
class Exported:
    """What an export wrote."""

    version: int
    trainer_step: int
    folder: Path
    files: list[str]
    notes: list[str]
    tokenizer_loader: str = AUTO_TOKENIZER
    """The transformers class whose ``from_pretrained(folder)`` loads the run's tokenizer (export_tokenizer.py)."""


def _versions(rd: RunDir) -> list[int]:
    if not rd.weights.is_dir():
        return []
    found = [rd.parse_weight_version(p.name) for p in rd.weights.iterdir()]
    return sorted(v for v in found if v is not None and rd.weight_manifest(v).is_file()
                  and not rd.weight_bad_marker(v).exists())


def _manifest(rd: RunDir, version: int) -> WeightManifest:
    d = read_json(rd.weight_manifest(version))
    if d is None:
        raise ExportError(f"weight version {version} is not in {rd.weights} (deleted by retention?); "
                          f"versions there: {_versions(rd) or 'none'}")
    return WeightManifest.from_json(d, str(rd.weight_manifest(version)))


def export(run_dir, out: os.PathLike | str, version: Optional[int] = None, merge: bool = False) -> Exported:
    """Copy weight version ``version`` (None: the newest intact one) of ``run_dir`` to ``out`` (module docstring); a
    LoRA run's version is written as its adapter folder, or with ``merge`` as the base model with the adapter merged
    (``export_adapter.py``)."""
    rd, out = RunDir(run_dir), Path(out).expanduser().resolve()
    if not rd.config_path.is_file():
        raise ExportError(f"{rd.root} is not an hpcrl run directory (no config.yaml)")
    versions = _versions(rd)
    if not versions:
        raise ExportError(f"no intact weight version in {rd.weights} yet (the trainer publishes version 0 at start)")
    version = versions[-1] if version is None else version
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new folder")
    manifest = _manifest(rd, version)
    if merge and manifest.adapter is None:
        raise ExportError(f"weight version {version} holds full weights: --merge is for a LoRA run's adapter versions "
                          "(actor.lora_rank); export it without --merge")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    notes: list[str] = []
    try:
        if manifest.adapter is not None:
            notes += export_adapter(rd, version, manifest, tmp, merge)
        else:
            for name, entry in manifest.files.items():
                if name == WEIGHT_DELTA:
                    continue
                dst = tmp / name
                shutil.copyfile(rd.weight_file(version, name), dst)
                check_file(dst, entry.size_bytes, entry.hash_algorithm, entry.hash_hex)
            if manifest.base is not None:
                _rebuild(rd, version, manifest, tmp, notes)
            _complete(rd, tmp, manifest, notes)
        loader = make_auto_tokenizer_load_it(tmp, notes)
    except BaseModelChanged as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(str(e)) from None
    except (FileNotFoundError, DamagedFile) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"weight version {version} changed while it was copied ({e}): it was deleted or damaged; "
                          f"export again (--version {versions[-1]} is the newest)") from None
    for p in tmp.iterdir():
        fsync_path(p)
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
    return Exported(version, manifest.trainer_step, out, sorted(p.name for p in out.iterdir()), notes, loader)


def _rebuild(rd: RunDir, version: int, manifest: WeightManifest, folder: Path, notes: list[str]) -> None:
    """A delta version's tensors, rebuilt against its base and verified, as ``folder/model.safetensors``
    (tied aliases stored once, as in a full version)."""
    rebuilt = DeltaReader(rd, keep_bases=False, threads=os.cpu_count() or 1).read(version, manifest)
    stored = {k: v for k, v in rebuilt.state.items() if k not in manifest.aliases}
    save_hashed(stored, folder / WEIGHT_TENSORS, {"format": "pt", "param_version": str(version)})
    notes.append(f"weight version {version} is a delta against full version {manifest.base.version}: rebuilt and "
                 f"verified tensor by tensor, written as {WEIGHT_TENSORS}")


def _complete(rd: RunDir, folder: Path, manifest: WeightManifest, notes: list[str]) -> None:
    """Tokenizer files from the run's model folder for a version that lacks them; a generation config."""
    if not any(name in manifest.files for name in WEIGHT_MODEL_FILES if name != GENERATION_CONFIG):
        base = rd.model_dir(rd.load_config().model.path)
        taken = [n for n in WEIGHT_MODEL_FILES if (base / n).is_file() and not (folder / n).exists()]
        for name in taken:
            shutil.copyfile(base / name, folder / name)
        notes.append(f"this version carries no tokenizer (an older hpcrl published it): {', '.join(taken) or 'none'} "
                     f"copied from the run's model folder {base}")
    if not (folder / GENERATION_CONFIG).exists():
        cfg = json.loads((folder / WEIGHT_MODEL_CONFIG).read_text())
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        (folder / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
        notes.append(f"{GENERATION_CONFIG} written from {WEIGHT_MODEL_CONFIG} ({', '.join(gen) or 'no token ids'})")


def export_main(run_dir: str, out: str, version: str = "last", merge: bool = False) -> int:
    """``hpcrl export``: 0, or 2 with one line on stderr."""
    import sys

    try:
        v = None if version == "last" else int(version)
        done = export(run_dir, out, v, merge)
    except ValueError as e:  # ExportError, or --version that is not a number
        print(f"hpcrl export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported weight version {done.version} (trainer step {done.trainer_step}) of {RunDir(run_dir).root} "
          f"to {done.folder}: {', '.join(done.files)}")
    for note in done.notes:
        print(f"note: {note}")
    if (done.folder / WEIGHT_ADAPTER_CONFIG).is_file():
        print(f"load it with PeftModel.from_pretrained(base, '{done.folder}') or AutoModelForCausalLM.from_pretrained("
              f"'{done.folder}') (peft installed) and {done.tokenizer_loader}.from_pretrained('{done.folder}'), or "
              f"vLLM: LLM(model=BASE, enable_lora=True) and LoRARequest('adapter', 1, '{done.folder}')")
        return 0
    print(f"load it with AutoModelForCausalLM.from_pretrained('{done.folder}') and "
          f"{done.tokenizer_loader}.from_pretrained('{done.folder}') (the run's tokenizer), or vLLM: "
          f"LLM(model='{done.folder}')")
    return 0
