"""``hpcrl samples RUN [--version V] [--worst|--best] [-n K]``: what the model writes, decoded from the shards.

Reads the committed shards of every writer (``samples/<writer>/``, each verified against its manifest
line, as the trainer reads them), keeps the trajectories that a weight version sampled (a token of
``--version V``; default the newest version found), orders them (newest first, or by reward with
``--worst`` / ``--best``) and prints the first ``-n``: sample id, reward, the prompt and the response
decoded with the run's tokenizer, and the version of every response token (run-length: ``v3 x5 v4 x3``
shows a response continued under new weights by partial rollout; tool tokens are counted). verl logs a
few generations per validation (``trainer.log_val_generations``); this reads any of those still on disk: the
trainer removes the shards behind its checkpoint but the newest ``trainer.keep_consumed_shards`` per writer, and
says how many are gone. Exit 1 when no trajectory was found.

Shards are read newest first, per writer, until they hold only versions older than the one asked for, so a
long run costs what its last versions cost.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from hpcrl.control.fatal import read_fatal
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.reader import ShardCorrupt, read_shard
from hpcrl.samples.schema import ShardManifestLine


@dataclass
class Sample:
    """One trajectory as ``hpcrl samples`` shows it."""

    sample_id: str
    """``<writer>/<prompt index>/<j>``."""
    reward: float
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    token_versions: np.ndarray
    committed_s: float

    def versions(self) -> str:
        """Run-length versions of the response tokens: ``v3 x5 v4 x3`` (``(2 tool)`` for mask-0 tokens)."""
        runs: list[list[int]] = []
        for v in self.token_versions.tolist():
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        tool = int((self.response_mask == 0).sum())
        return " ".join(f"v{v} x{n}" for v, n in runs) + (f" ({tool} tool tokens)" if tool else "")


def _manifest(rd: RunDir, writer: str) -> list[ShardManifestLine]:
    lines = []
    try:
        text = rd.shard_manifest(writer).read_text()
    except FileNotFoundError:
        return []
    for raw in text.splitlines():
        try:
            lines.append(ShardManifestLine.from_json(json.loads(raw)))
        except ValueError:
            continue  # a torn or foreign line: the trainer skips it too
    return lines


@dataclass
class Found:
    """What :func:`read_samples` found."""

    version: int
    """The version asked for (the newest found when none was: -1 when no group is committed)."""
    samples: list
    """Its trajectories, newest first."""
    notes: list
    """Shards that could not be read."""
    removed: int = 0
    """Shard files listed in the manifests and no longer on disk (the trainer removes consumed ones)."""
    oldest: Optional[int] = None
    """The oldest version a token of the shards read was sampled with."""


def read_samples(run_dir, version: Optional[int] = None) -> Found:
    """The trajectories a version sampled (``version`` None: the newest version any token was sampled with), the
    shards that could not be read and those no longer on disk."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    out = Found(-1, [], [])
    newest = -1
    for writer in rd.writers():
        for line in reversed(_manifest(rd, writer)):
            path = rd.writer_dir(writer) / line.shard
            if not path.exists():
                out.removed += 1
                continue
            try:
                groups = read_shard(path, line, writer)
            except ShardCorrupt as e:
                out.notes.append(f"{writer}/{line.shard}: {e}")
                continue
            top = max(g.version_end for g in groups)
            newest = max(newest, top)
            low = min(g.version_start for g in groups)
            out.oldest = low if out.oldest is None else min(out.oldest, low)
            want = newest if version is None else version
            for g in groups:
                for j, t in enumerate(g.trajectories):
                    if len(t.token_versions) and t.token_versions.min() <= want <= t.token_versions.max():
                        out.samples.append(Sample(f"{g.sample_id}/{j}", float(t.reward), t.prompt_ids,
                                                  t.response_ids, t.response_mask, t.token_versions, g.committed_s))
            if top < want:
                break  # older shards hold older versions only
    out.version = newest if version is None else version
    out.samples = [s for s in out.samples if s.token_versions.min() <= out.version <= s.token_versions.max()]
    out.samples.sort(key=lambda s: s.committed_s, reverse=True)
    return out


def _removed_note(rd: RunDir, found: Found) -> str:
    """One line for the shards that are gone: how many, why (retention), what is left."""
    try:
        keep = rd.load_config().trainer.keep_consumed_shards
    except (OSError, ValueError):
        keep = None
    left = f"; the oldest version still on disk is v{found.oldest}" if found.oldest is not None else ""
    if keep is not None and keep < 0:
        return (f"{found.removed} shard files listed in the manifests are not on disk, although "
                f"trainer.keep_consumed_shards=-1 keeps every one: something else removed them{left}")
    return (f"{found.removed} shard files listed in the manifests were removed: the trainer removes the shards behind "
            f"its checkpoint and keeps the newest trainer.keep_consumed_shards={keep if keep is not None else '?'} "
            f"per writer (-1 keeps every one, for a run whose old samples you want to read){left}")


def _tokenizer(rd: RunDir):
    from hpcrl.tiny.model import load_tokenizer

    cfg = rd.load_config()
    return load_tokenizer(rd.model_dir(cfg.model.path))


def format_samples(run_dir, version: Optional[int] = None, order: str = "newest", n: int = 4) -> tuple[str, bool]:
    """The text ``hpcrl samples`` prints (module docstring) and whether it shows any trajectory; ``order``: newest,
    worst or best."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    found = read_samples(rd, version)
    want = found.version
    removed = [_removed_note(rd, found)] if found.removed else []
    if not found.samples:
        fatal = read_fatal(rd)
        why = ((f"no group committed yet in {rd.samples}" if want < 0 and not found.removed else
                f"no trajectory sampled with version {want} in {rd.samples}")
               + (f"; the run stopped on an error no restart can fix: {fatal}" if fatal else ""))
        return why + "".join(f"\nnote: {x}" for x in removed + found.notes), False
    if order in ("worst", "best"):
        found.samples.sort(key=lambda s: s.reward, reverse=order == "best")
    tok = _tokenizer(rd)
    rewards = np.array([s.reward for s in found.samples])
    out = [f"version {want}: {len(found.samples)} trajectories, reward mean {rewards.mean():.3f} min "
           f"{rewards.min():.3f} max {rewards.max():.3f}; showing {min(n, len(found.samples))} ({order})"]
    for s in found.samples[:n]:
        out += ["", f"{s.sample_id}  reward {s.reward:.3f}  tokens {len(s.response_ids)}  versions {s.versions()}",
                "  prompt:   " + tok.decode(s.prompt_ids.tolist(), skip_special_tokens=False).replace("\n", "\n            "),
                "  response: " + tok.decode(s.response_ids.tolist(), skip_special_tokens=False).replace("\n", "\n            ")]
    out += [f"note: {x}" for x in removed + found.notes]
    return "\n".join(out), True


def samples_main(run_dir: str, version: Optional[int], order: str, n: int) -> int:
    """``hpcrl samples``: 0; 1 when no trajectory was found; 2 when RUN_DIR is not a run directory."""
    rd = RunDir(run_dir)
    if not rd.config_path.is_file() or not Path(rd.samples).is_dir():
        print(f"hpcrl samples: error: {rd.root} is not an hpcrl run directory with samples (no config.yaml or "
              "samples/)", file=sys.stderr)
        return 2
    text, shown = format_samples(rd, version, order, n)
    print(text)
    return 0 if shown else 1
