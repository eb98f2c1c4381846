"""RunDir: the one place that names every path of a run (cf. submitit's JobPaths).

Layout (DESIGN.md)::

    RUN/
      config.yaml                  resolved config, frozen at launch        (launcher writes)
      base_model/                  builtin:tiny model + tokenizer           (launcher writes)
      samples/<writer>/shard-000042.h5, manifest.jsonl                      (one rollout job each)
      weights/v000007/             config.json, model.safetensors, manifest.json (trainer)
      control/heartbeat/<job>.json, control/loading/<writer>.json, control/admission.json, ...
      checkpoints/<tag>/, checkpoints/latest.json                           (trainer)
      logs/metrics.jsonl, logs/staleness.jsonl, logs/jobs/                  (each job its own file)
"""
from __future__ import annotations

import os
from pathlib import Path

from hpcrl.config import RunConfig, config_from_dict, dump_config

import yaml


class RunDir:
    def __init__(self, root: os.PathLike | str):
        self.root = Path(root).resolve()

    # ---- top level
    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def base_model(self) -> Path:
        return self.root / "base_model"

    # ---- samples
    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def writer_dir(self, writer: str) -> Path:
        return self.samples / writer

    def shard_path(self, writer: str, shard_index: int) -> Path:
        return self.writer_dir(writer) / f"shard-{shard_index:06d}.h5"

    def shard_manifest(self, writer: str) -> Path:
        return self.writer_dir(writer) / "manifest.jsonl"

    def writers(self) -> list[str]:
        if not self.samples.is_dir():
            return []
        return sorted(p.name for p in self.samples.iterdir() if p.is_dir())

    # ---- weights
    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def weight_version_dir(self, version: int) -> Path:
        return self.weights / f"v{version:06d}"

    # ---- control records
    @property
    def control(self) -> Path:
        return self.root / "control"

    def heartbeat(self, job: str) -> Path:
        return self.control / "heartbeat" / f"{job}.json"

    def loading_announcement(self, writer: str) -> Path:
        return self.control / "loading" / f"{writer}.json"

    @property
    def admission(self) -> Path:
        return self.control / "admission.json"

    @property
    def admission_lock(self) -> Path:
        return self.control / "admission.lock"

    @property
    def trainer_done(self) -> Path:
        return self.control / "trainer_done.json"

    # ---- checkpoints
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest_checkpoint(self) -> Path:
        return self.checkpoints / "latest.json"

    # ---- logs
    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.logs / "metrics.jsonl"

    @property
    def staleness(self) -> Path:
        return self.logs / "staleness.jsonl"

    def rollout_metrics(self, writer: str) -> Path:
        return self.logs / f"rollout-{writer}.jsonl"

    @property
    def job_logs(self) -> Path:
        return self.logs / "jobs"

    # ---- life cycle
    def create(self) -> "RunDir":
        for d in (self.samples, self.weights, self.control / "heartbeat", self.control / "loading",
                  self.checkpoints, self.logs, self.job_logs):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def freeze_config(self, cfg: RunConfig) -> None:
        from hpcrl.fsio import write_bytes_atomic

        write_bytes_atomic(self.config_path, dump_config(cfg).encode())

    def load_config(self) -> RunConfig:
        if not self.config_path.is_file():
            raise FileNotFoundError(f"{self.config_path} missing: {self.root} is not an hpcrl run directory "
                                    "(start a run with `hpcrl run CONFIG --run-dir DIR`)")
        return config_from_dict(yaml.safe_load(self.config_path.read_text()))
