"""``hpcrl samples RUN [--version V] [--worst|--best] [-n K]``: what the model writes, decoded from the shards.

Reads the committed shards of every writer (``samples/<writer>/``, each verified against its manifest
line, as the trainer reads them), keeps the trajectories that a weight version sampled (a token of
``--version V``; default the newest version found), orders them (newest first, or by reward with
``--worst`` / ``--best``) and prints the first ``-n``: sample id, reward, the prompt and the response
decoded with the run's tokenizer, and the version of every response token (run-length: ``v3 x5 v4 x3``
shows a response continued under new weights by partial rollout; tool tokens are counted). verl logs a
few generations per validation (``trainer.log_val_generations``); this reads any of them, any time.

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
from hpcrl.run_dir import RunDir
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


def read_samples(run_dir, version: Optional[int] = None) -> tuple[int, list[Sample], list[str]]:
    """(the version, its trajectories newest first, notes on shards that could not be read). ``version`` None:
    the newest version any token was sampled with."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    found: list[Sample] = []
    notes: list[str] = []
    newest = -1
    for writer in rd.writers():
        for line in reversed(_manifest(rd, writer)):
            try:
                groups = read_shard(rd.writer_dir(writer) / line.shard, line, writer)
            except ShardCorrupt as e:
                notes.append(f"{writer}/{line.shard}: {e}")
                continue
            top = max(g.version_end for g in groups)
            newest = max(newest, top)
            want = newest if version is None else version
            for g in groups:
                for j, t in enumerate(g.trajectories):
                    if len(t.token_versions) and t.token_versions.min() <= want <= t.token_versions.max():
                        found.append(Sample(f"{g.sample_id}/{j}", float(t.reward), t.prompt_ids, t.response_ids,
                                            t.response_mask, t.token_versions, g.committed_s))
            if top < want:
                break  # older shards hold older versions only
    want = newest if version is None else version
    found = [s for s in found if s.token_versions.min() <= want <= s.token_versions.max()]
    found.sort(key=lambda s: s.committed_s, reverse=True)
    return want, found, notes


def _tokenizer(rd: RunDir):
    from hpcrl.tiny.model import load_tokenizer

    cfg = rd.load_config()
    return load_tokenizer(rd.model_dir(cfg.model.path))


def format_samples(run_dir, version: Optional[int] = None, order: str = "newest", n: int = 4) -> str:
    """The text ``hpcrl samples`` prints (module docstring); ``order``: newest, worst or best."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    want, found, notes = read_samples(rd, version)
    if not found:
        fatal = read_fatal(rd)
        why = ((f"no group committed yet in {rd.samples}" if want < 0 else
                f"no trajectory sampled with version {want} in {rd.samples}")
               + (f"; the run stopped on an error no restart can fix: {fatal}" if fatal else ""))
        return why + "".join(f"\nnote: {x}" for x in notes)
    if order in ("worst", "best"):
        found.sort(key=lambda s: s.reward, reverse=order == "best")
    tok = _tokenizer(rd)
    rewards = np.array([s.reward for s in found])
    out = [f"version {want}: {len(found)} trajectories, reward mean {rewards.mean():.3f} min {rewards.min():.3f} "
           f"max {rewards.max():.3f}; showing {min(n, len(found))} ({order})"]
    for s in found[:n]:
        out += ["", f"{s.sample_id}  reward {s.reward:.3f}  tokens {len(s.response_ids)}  versions {s.versions()}",
                "  prompt:   " + tok.decode(s.prompt_ids.tolist(), skip_special_tokens=False).replace("\n", "\n            "),
                "  response: " + tok.decode(s.response_ids.tolist(), skip_special_tokens=False).replace("\n", "\n            ")]
    out += [f"note: {x}" for x in notes]
    return "\n".join(out)


def samples_main(run_dir: str, version: Optional[int], order: str, n: int) -> int:
    """``hpcrl samples``: 0, or 2 when RUN_DIR is not a run directory."""
    rd = RunDir(run_dir)
    if not rd.config_path.is_file() or not Path(rd.samples).is_dir():
        print(f"hpcrl samples: error: {rd.root} is not an hpcrl run directory with samples (no config.yaml or "
              "samples/)", file=sys.stderr)
        return 2
    print(format_samples(rd, version, order, n))
    return 0
