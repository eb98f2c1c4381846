"""Weight exchange through the shared filesystem (always available).

Publish (trainer rank 0)::

    weights/v000007.tmp/ <- config.json + model.safetensors, each fsync'd
    rename -> weights/v000007/, fsync weights/
    weights/v000007/manifest.json (tmp -> fsync -> replace): the version now exists

Load (rollout): poll for the newest version with a manifest (no inotify on
Lustre), announce it in ``control/loading/<writer>.json``, re-check it still
exists, read it, verify sizes, then announce it as loaded.

Retention (trainer): keep the newest ``keep_versions``; an older version is
deleted only if no live rollout job (fresh heartbeat) has announced it is
loading it (AReaL #710). A dead job's announcement does not pin anything.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from typing import Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from hpcrl.control.records import LoadingAnnouncement, live_jobs
from hpcrl.fsio import file_sha256, fsync_path, read_json, write_json_atomic
from hpcrl.run_dir import RunDir
from hpcrl.weights.manifest import TensorEntry, WeightManifest

log = logging.getLogger(__name__)

_VERSION_RE = re.compile(r"^v(\d{6})$")
WEIGHTS_FILE = "model.safetensors"


def _dedupe_tied(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses shared storage (tied embeddings): store each storage once."""
    seen: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for k, v in state_dict.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else None
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        tensors[k] = v.detach().to("cpu").contiguous()
    return tensors, aliases


def publish_version(run_dir: RunDir, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                    trainer_step: int, consumed_groups: int, checksum: bool = True) -> WeightManifest:
    final = run_dir.weight_version_dir(version)
    if (final / "manifest.json").exists():
        raise FileExistsError(f"weight version {version} already published at {final}")
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if final.exists():  # renamed by a trainer killed before its manifest: never visible, rewrite it
        shutil.rmtree(final)
    tmp.mkdir(parents=True)
    tensors, aliases = _dedupe_tied(state_dict)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "param_version": str(version)})
    (tmp / "config.json").write_text(model_config_json)
    files = {}
    for name in (WEIGHTS_FILE, "config.json"):
        fsync_path(tmp / name)
        files[name] = {"size_bytes": (tmp / name).stat().st_size,
                       "sha256": file_sha256(tmp / name) if checksum else ""}
    fsync_path(tmp)
    os.rename(tmp, final)
    fsync_path(final.parent)
    manifest = WeightManifest(
        param_version=version, trainer_step=trainer_step, consumed_groups=consumed_groups, files=files,
        tensors=[TensorEntry(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in tensors.items()],
        total_bytes=sum(f["size_bytes"] for f in files.values()), published_s=time.time(), aliases=aliases)
    write_json_atomic(final / "manifest.json", manifest.to_json())  # the commit point
    return manifest


def published_versions(run_dir: RunDir) -> list[int]:
    if not run_dir.weights.is_dir():
        return []
    out = []
    for p in run_dir.weights.iterdir():
        m = _VERSION_RE.match(p.name)
        if m and (p / "manifest.json").is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def newest_version(run_dir: RunDir) -> Optional[int]:
    versions = published_versions(run_dir)
    return versions[-1] if versions else None


def read_manifest(run_dir: RunDir, version: int) -> Optional[WeightManifest]:
    d = read_json(run_dir.weight_version_dir(version) / "manifest.json")
    return None if d is None else WeightManifest.from_json(d)


class WeightVersionGone(Exception):
    """The version was deleted between discovery and load; pick the newest again."""


def load_version(run_dir: RunDir, version: int, writer: str, apply: Optional[Callable[[dict], None]] = None,
                 verify_checksum: bool = False) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
    """Announce, read version ``version``, hand it to ``apply`` (e.g. the engine's
    ``load_weights``), then release the announcement. Raise WeightVersionGone if it vanished.

    safetensors maps the file lazily: the bytes are read while ``apply`` copies them.
    So the version stays pinned ("loading") until ``apply`` returns; without
    ``apply`` the tensors are copied into memory before the pin is released.
    """
    announce = run_dir.loading_announcement(writer)
    write_json_atomic(announce, LoadingAnnouncement(writer=writer, version=version, state="loading",
                                                    time_s=time.time()).to_json())
    folder = run_dir.weight_version_dir(version)
    manifest = read_manifest(run_dir, version)
    if manifest is None:
        raise WeightVersionGone(f"weight version {version} disappeared from {folder} before it was loaded")
    for name, meta in manifest.files.items():
        size = (folder / name).stat().st_size
        if size != meta["size_bytes"]:
            raise OSError(f"{folder / name}: {size} bytes, manifest says {meta['size_bytes']} (torn weight file)")
        if verify_checksum and meta["sha256"] and file_sha256(folder / name) != meta["sha256"]:
            raise OSError(f"{folder / name}: checksum differs from manifest")
    state = load_file(str(folder / WEIGHTS_FILE))
    for alias, stored in manifest.aliases.items():
        state[alias] = state[stored]
    if apply is not None:
        apply(state)
    else:
        state = {k: v.clone() for k, v in state.items()}
    write_json_atomic(announce, LoadingAnnouncement(writer=writer, version=version, state="loaded",
                                                    time_s=time.time()).to_json())
    return manifest, state


def apply_retention(run_dir: RunDir, keep_versions: int, heartbeat_stale_s: float) -> list[int]:
    """Delete old versions nobody alive is loading; return the deleted versions."""
    versions = published_versions(run_dir)
    protected = set(versions[-keep_versions:])
    alive = live_jobs(run_dir, heartbeat_stale_s)
    for path in run_dir.loading.glob("*.json"):
        d = read_json(path)
        if d and d.get("state") == "loading" and d.get("writer") in alive:
            protected.add(int(d["version"]))
    deleted = []
    for v in versions:
        if v in protected:
            continue
        folder = run_dir.weight_version_dir(v)
        # manifest first: from this instant the version does not exist for readers
        try:
            (folder / "manifest.json").unlink()
        except FileNotFoundError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        deleted.append(v)
    return deleted
