"""RunDir: the one place that names every path and every job of a run (cf. submitit's JobPaths).

Layout (ARCHITECTURE.md, "The run directory")::

    RUN/
      config.yaml                  resolved config, frozen at launch            (launcher writes)
      secret                       random token, mode 0600 (weight broadcast)   (launcher writes)
      base_model/                  builtin:tiny model + tokenizer               (launcher writes)
      sbatch/<role>.setup.sh       per-role setup lines for sbatch/*.sbatch     (launcher writes)
      samples/<writer>/shard-000042.h5, manifest.jsonl                          (one rollout job each)
      weights/v000007/             config.json, model.safetensors, tokenizer files, manifest.json (trainer);
                                   LoRA runs: adapter_config.json, adapter_model.safetensors, manifest.json
      weights/v000008/             ... model.delta instead of model.safetensors: a delta version (trainer)
      weights/v000007/bad.json     the version is damaged: never loaded again     (rollout job)
      control/heartbeat/<job>.json, control/loading/<writer>.json, control/admission.json,
      control/skipped_shards.jsonl, ...
      control/filtered_groups.json groups dynamic sampling dropped: budget given back  (trainer)
      control/fatal.json           an error no restart can fix                  (any job)
      control/changes.jsonl        grows by a line after each change pollers wait for (control/changes.py)
      control/in_flight/<writer>.json  partial groups for the job's successor    (rollout job)
      control/drain/<writer>.json  that writer's job is asked to leave the fleet  (launcher, hpcrl scale)
      control/reserve/<job>        room a job holds on the filesystem for its last records (control/job.py)
      control/scale.json           the fleet size asked for by hpcrl scale      (hpcrl scale)
      control/broadcast.json       host/port/epoch of the weight broadcast      (trainer)
      control/reward/<job>.json, reward_model/  a reward job's address (it writes); builtin:tiny-rm (launcher)
      checkpoints/<tag>/, checkpoints/latest.json                               (trainer)
      logs/metrics.jsonl, logs/staleness.jsonl.gz, logs/rollout-<writer>.jsonl, logs/jobs/<job>.log,
      logs/tensorboard/, logs/wandb/  (logging.backends)                        (trainer)
      logs/fleet/launcher.jsonl, logs/fleet/scale.jsonl, logs/fleet/<writer>.jsonl  the fleet's history
                                   (control/fleet_log.py)       (launcher, hpcrl scale, each rollout job)
      logs/tensorboard/eval/, logs/eval/wandb/  the same for the evaluation job        (evaluation job)
      logs/eval.jsonl, logs/eval_samples.jsonl.gz  one row per evaluated version,
                                   one per evaluated response                   (evaluation job)

Names: rollout job ``w`` of a run (``w`` a number the launcher gives it: ``0..rollout_jobs-1`` at launch,
the next unused ones when the fleet grows) writes samples as writer ``w000`` (:meth:`RunDir.writer_name`)
and runs as job ``rollout-w000`` (:meth:`RunDir.rollout_job`); the trainer's rank 0 is job
``trainer``, its other ranks ``trainer-rank1``, ...; the evaluation job is ``eval`` (also its name as
a reader of weights), an offline ``hpcrl eval`` of the run's versions ``eval-offline``. No other module
spells a path or a job name (``tests/test_layers.py`` checks).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import yaml

from hpcrl.config import RunConfig, config_from_dict, dump_config
from hpcrl.config.names import BUILTIN_MODELS, BUILTIN_REWARD_MODELS

TRAINER_JOB = "trainer"
"""Job name of the trainer's rank 0 (heartbeat, log file, launcher handle)."""
EVAL_JOB = "eval"
"""Job name of the evaluation job, and its name as a reader of weights (pins, bad markers)."""
EVAL_OFFLINE_JOB = "eval-offline"
"""Job and reader name of an offline ``hpcrl eval`` of a run's versions (while it holds a version)."""
_REWARD_JOB_RE = re.compile(r"^reward-(\d+)$")  # reward jobs: reward-0, reward-1, ... (RunDir.reward_job)
_WRITER_RE = re.compile(r"^w(\d{3,})$")
_ROLLOUT_PREFIX = "rollout-"
_VERSION_RE = re.compile(r"^v(\d{6})$")
_SHARD_RE = re.compile(r"^shard-(\d+)\.h5(\.tmp)?$")
WEIGHT_MANIFEST = "manifest.json"
"""The file that makes a weight version folder exist for readers (written last)."""
WEIGHT_TENSORS = "model.safetensors"
"""The tensors of a weight version (one safetensors file, HF layout)."""
WEIGHT_DELTA = "model.delta"
"""The tensors of a delta version: each tensor's XOR against its base version, compressed
(``weights/delta.py``); a safetensors file of byte tensors, named so that no loader takes it for weights."""
WEIGHT_MODEL_CONFIG = "config.json"
"""The HF model config of a weight version (so the folder loads as an HF model)."""
WEIGHT_ADAPTER_TENSORS = "adapter_model.safetensors"
"""The tensors of a LoRA adapter version (``actor.lora_rank``): peft's file name and layout, instead of
:data:`WEIGHT_TENSORS`."""
WEIGHT_ADAPTER_CONFIG = "adapter_config.json"
"""peft's config of a LoRA adapter version, instead of :data:`WEIGHT_MODEL_CONFIG`."""
WEIGHT_MODEL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                      "tokenizer.model")
"""The model folder's other files a weight version carries when the model has them (tokenizer, chat template,
generation config), so that every version is a complete Hugging Face folder; listed and hashed in its manifest."""
WEIGHT_BAD_MARKER = "bad.json"
"""Written into a version folder by a rollout job that found the version damaged."""
SHARD_MANIFEST = "manifest.jsonl"
"""Each writer's commit log: one line per sealed shard."""
FLEET_LAUNCHER = "launcher"
"""Source name of the launcher's fleet events (``logs/fleet/launcher.jsonl``)."""
FLEET_SCALE = "scale"
"""Source name of ``hpcrl scale``'s fleet events (``logs/fleet/scale.jsonl``)."""
_HISTORY_TITLE = "# changed since launch (hpcrl run --resume KEY=VALUE), oldest first:"
_HISTORY_MARK = "# - "


class RunDir:
    """Every path of one run directory, and the names of its writers and jobs.

    Constructing one touches nothing on disk; :meth:`create` makes the folders.
    """

    def __init__(self, root: os.PathLike | str):
        self.root = Path(root).resolve()

    # ---- names (static: the same for every run)
    @staticmethod
    def writer_name(rank: int) -> str:
        """Sample writer of rollout job ``rank``: ``w000``, ``w001``, ..."""
        return f"w{rank:03d}"

    @staticmethod
    def writer_rank(writer: str) -> int:
        """Inverse of :meth:`writer_name`; ValueError for anything else."""
        m = _WRITER_RE.match(writer)
        if not m:
            raise ValueError(f"{writer!r} is not a writer name (expected w000, w001, ...)")
        return int(m.group(1))

    @staticmethod
    def rollout_job(writer: str) -> str:
        """Job name of the rollout job that owns ``writer``: ``rollout-w000``."""
        return _ROLLOUT_PREFIX + writer

    @staticmethod
    def trainer_job(rank: int = 0) -> str:
        """Job name of trainer rank ``rank``: ``trainer`` for rank 0, else ``trainer-rank<r>``."""
        return TRAINER_JOB if rank == 0 else f"{TRAINER_JOB}-rank{rank}"

    @staticmethod
    def reward_job(index: int) -> str:
        """Job name of reward job ``index``: ``reward-0``, ``reward-1``, ... (also its service's name)."""
        return f"reward-{index}"

    @staticmethod
    def reward_index(job: str) -> Optional[int]:
        """The index of a reward job's name (``reward-3`` -> 3), None for other names."""
        return int(m.group(1)) if (m := _REWARD_JOB_RE.match(job)) else None

    @staticmethod
    def writer_of_job(job: str) -> Optional[str]:
        """The writer a job name belongs to (``rollout-w000`` -> ``w000``), None for other jobs."""
        if job.startswith(_ROLLOUT_PREFIX) and _WRITER_RE.match(job[len(_ROLLOUT_PREFIX):]):
            return job[len(_ROLLOUT_PREFIX):]
        return None

    # ---- top level
    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def secret(self) -> Path:
        """Random token (mode 0600) that authenticates peers of the weight broadcast."""
        return self.root / "secret"

    @property
    def base_model(self) -> Path:
        return self.root / "base_model"

    def model_dir(self, model_path: str) -> Path:
        """The folder of ``model.path``: ``base_model/`` for ``builtin:tiny[-h64]``, else the path itself (``~`` expanded)."""
        return self.base_model if model_path in BUILTIN_MODELS else Path(model_path).expanduser()

    def reward_model_dir(self, path: str) -> Path:
        """The folder of ``reward_model.path``: ``reward_model/`` for a built-in one (built at launch), else the path."""
        return self.root / "reward_model" if path in BUILTIN_REWARD_MODELS else Path(path).expanduser()

    @property
    def sbatch_dir(self) -> Path:
        return self.root / "sbatch"

    def sbatch_setup(self, role: str) -> Path:
        """Shell lines sourced by ``sbatch/<role>.sbatch`` before hpcrl starts."""
        return self.sbatch_dir / f"{role}.setup.sh"

    # ---- samples
    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def writer_dir(self, writer: str) -> Path:
        """``samples/<writer>/``: one rollout job's shards and manifest."""
        return self.samples / writer

    @staticmethod
    def shard_name(shard_index: int) -> str:
        """``shard-000042.h5``."""
        return f"shard-{shard_index:06d}.h5"

    @staticmethod
    def parse_shard_name(name: str) -> Optional[tuple[int, bool]]:
        """``(shard index, is a .tmp)`` of a file name in a writer folder; None if not a shard."""
        m = _SHARD_RE.match(name)
        return (int(m.group(1)), bool(m.group(2))) if m else None

    def shard_path(self, writer: str, shard_index: int) -> Path:
        """A sealed shard of ``writer``."""
        return self.writer_dir(writer) / self.shard_name(shard_index)

    @staticmethod
    def staging(path: Path) -> Path:
        """Where a file or folder is written before it is renamed to ``path``."""
        return path.with_name(path.name + ".tmp")

    @staticmethod
    def doomed(path: Path) -> Path:
        """Where a folder is renamed before it is removed (a weight version, a checkpoint): from the rename on
        it no longer exists for readers, and a job killed mid-removal leaves a name the next start sweeps."""
        return path.with_name(path.name + ".deleting")

    def shard_manifest(self, writer: str) -> Path:
        """``samples/<writer>/manifest.jsonl``: the writer's commit log."""
        return self.writer_dir(writer) / SHARD_MANIFEST

    def writers(self) -> list[str]:
        """Writers that have a sample folder, sorted."""
        try:
            with os.scandir(self.samples) as it:  # the entries' types come with the listing: no stat each
                return sorted(e.name for e in it if _WRITER_RE.match(e.name) and e.is_dir())
        except FileNotFoundError:
            return []

    # ---- weights
    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def weight_version_dir(self, version: int) -> Path:
        """``weights/v000007/``: one published weight version."""
        return self.weights / f"v{version:06d}"

    def weight_manifest(self, version: int) -> Path:
        """The manifest that makes a version exist for readers (written last)."""
        return self.weight_version_dir(version) / WEIGHT_MANIFEST

    def weight_file(self, version: int, name: str) -> Path:
        """A file of version ``version`` (``name``: :data:`WEIGHT_TENSORS`, :data:`WEIGHT_DELTA`,
        :data:`WEIGHT_MODEL_CONFIG`, :data:`WEIGHT_ADAPTER_TENSORS`, :data:`WEIGHT_ADAPTER_CONFIG` or one of
        :data:`WEIGHT_MODEL_FILES`); ValueError for any other name."""
        if name not in (WEIGHT_TENSORS, WEIGHT_DELTA, WEIGHT_MODEL_CONFIG, WEIGHT_ADAPTER_TENSORS, WEIGHT_ADAPTER_CONFIG,
                        *WEIGHT_MODEL_FILES):
            raise ValueError(f"{name!r} is not a weight file (expected {WEIGHT_TENSORS}, {WEIGHT_DELTA}, "
                             f"{WEIGHT_MODEL_CONFIG}, {WEIGHT_ADAPTER_TENSORS}, {WEIGHT_ADAPTER_CONFIG} or one of "
                             f"{', '.join(WEIGHT_MODEL_FILES)})")
        return self.weight_version_dir(version) / name

    def weight_bad_marker(self, version: int) -> Path:
        """``weights/vNNNNNN/bad.json``: a reader found this version damaged; nobody loads it again.
        It lives in the version folder, so retention and a trainer rollback remove it with the version."""
        return self.weight_version_dir(version) / WEIGHT_BAD_MARKER

    @staticmethod
    def parse_weight_version(name: str) -> Optional[int]:
        """The version of a folder name ``v000007`` (None for anything else, ``.tmp`` included)."""
        m = _VERSION_RE.match(name)
        return int(m.group(1)) if m else None

    # ---- control records
    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def heartbeats(self) -> Path:
        return self.control / "heartbeat"

    def heartbeat(self, job: str) -> Path:
        """``control/heartbeat/<job>.json``."""
        return self.heartbeats / f"{job}.json"

    @property
    def loading(self) -> Path:
        return self.control / "loading"

    def loading_announcement(self, writer: str) -> Path:
        """``control/loading/<writer>.json``: the version a rollout job is reading."""
        return self.loading / f"{writer}.json"

    def in_flight_states(self, writer: str) -> Path:
        """``control/in_flight/<writer>.json``: trajectories in flight, continued by the writer's next job."""
        return self.control / "in_flight" / f"{writer}.json"

    @property
    def broadcast_rendezvous(self) -> Path:
        """``control/broadcast.json``: host, port and epoch of the trainer's weight-broadcast store
        (trainer rank 0 writes it, tmp -> rename; rollout jobs read it to join)."""
        return self.control / "broadcast.json"

    def reward_service(self, job: str = "") -> Path:
        """``control/reward/<job>.json``: where reward job ``job`` listens (tmp -> rename); the folder without one."""
        return self.control / "reward" / (f"{job}.json" if job else "")

    @property
    def drain_requests(self) -> Path:
        """``control/drain/``: one record per rollout job asked to leave the fleet (``control/fleet.py``)."""
        return self.control / "drain"

    def drain_request(self, writer: str) -> Path:
        """``control/drain/<writer>.json``: the launcher or ``hpcrl scale`` asks that writer's job to drain."""
        return self.drain_requests / f"{writer}.json"

    @property
    def scale_request(self) -> Path:
        """``control/scale.json``: ``hpcrl scale`` asks the launcher following the run for another fleet size."""
        return self.control / "scale.json"

    @property
    def admission(self) -> Path:
        return self.control / "admission.json"

    @property
    def admission_lock(self) -> Path:
        return self.control / "admission.lock"

    @property
    def skipped_shards(self) -> Path:
        """Shards the trainer will never train on (``samples/skips.py``): their budget is returned
        and their prompts regenerated."""
        return self.control / "skipped_shards.jsonl"

    @property
    def filtered_groups(self) -> Path:
        """Groups the trainer's dynamic sampling dropped (``algorithm.filter_groups``): their admission budget is
        given back (``control/records.py``: :class:`FilteredGroups`)."""
        return self.control / "filtered_groups.json"

    @property
    def fatal(self) -> Path:
        """``control/fatal.json``: a job's error that a restart would only repeat (the launcher
        stops the run at once instead of resubmitting)."""
        return self.control / "fatal.json"

    @property
    def trainer_done(self) -> Path:
        return self.control / "trainer_done.json"

    def disk_reserve(self, job: str) -> Path:
        """``control/reserve/<job>``: room a job holds on the run directory's filesystem while it lives and gives
        back when a full disk ends it, so its fatal record and last heartbeat can still be written."""
        return self.control / "reserve" / job

    @property
    def changes(self) -> Path:
        """``control/changes.jsonl``: every writer of something pollers wait for (a weight version, a bad marker,
        a stop, drain or done record, a skipped shard, budget handed back) appends a line after it; pollers stat
        this one file instead of everything (``control/changes.py``)."""
        return self.control / "changes.jsonl"

    @property
    def stop_request(self) -> Path:
        """``control/stop.json``: the launcher asks every job to stop (Ctrl-C): the trainer checkpoints first."""
        return self.control / "stop.json"

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

    def _compressed_log(self, name: str) -> Path:
        """``logs/<name>.gz``; ``logs/<name>``, plain, where an older hpcrl wrote that (it is read and continued)."""
        plain = self.logs / name
        return plain if plain.exists() else self.logs / f"{name}.gz"

    @property
    def staleness(self) -> Path:
        """``logs/staleness.jsonl.gz`` (``hpcrl/logs/run_logs.py``): one row per consumed trajectory, compressed."""
        return self._compressed_log("staleness.jsonl")

    def rollout_metrics(self, writer: str) -> Path:
        """``logs/rollout-<writer>.jsonl``: one row per weight version of that writer."""
        return self.logs / f"{_ROLLOUT_PREFIX}{writer}.jsonl"

    def rollout_metrics_logs(self) -> dict[str, Path]:
        """Every writer's rollout log that exists, by writer name."""
        if not self.logs.is_dir():
            return {}
        out = {}
        for p in sorted(self.logs.glob(f"{_ROLLOUT_PREFIX}*.jsonl")):
            writer = p.stem[len(_ROLLOUT_PREFIX):]
            if _WRITER_RE.match(writer):
                out[writer] = p
        return out

    @property
    def fleet_logs_dir(self) -> Path:
        """``logs/fleet/``: the fleet's history, one file per source (``control/fleet_log.py``)."""
        return self.logs / "fleet"

    def fleet_log(self, source: str) -> Path:
        """``logs/fleet/<source>.jsonl``: ``source`` is :data:`FLEET_LAUNCHER`, :data:`FLEET_SCALE` or a writer."""
        if source not in (FLEET_LAUNCHER, FLEET_SCALE) and not _WRITER_RE.match(source):
            raise ValueError(f"{source!r} is not a fleet log source (launcher, scale or a writer name)")
        return self.fleet_logs_dir / f"{source}.jsonl"

    def fleet_logs(self) -> list[Path]:
        """Every fleet log that exists, sorted."""
        d = self.fleet_logs_dir
        return sorted(p for p in d.glob("*.jsonl") if p.is_file()) if d.is_dir() else []

    @property
    def tensorboard(self) -> Path:
        """``logs/tensorboard/``: the trainer's TensorBoard event files (logging.backends)."""
        return self.logs / "tensorboard"

    @property
    def wandb_init_dir(self) -> Path:
        """``logs/``: the ``dir`` given to ``wandb.init``, which writes its run under ``logs/wandb/``."""
        return self.logs

    @property
    def eval_tensorboard(self) -> Path:
        """``logs/tensorboard/eval/``: the evaluation job's TensorBoard events (a run of its own beside the trainer's)."""
        return self.tensorboard / "eval"

    @property
    def eval_wandb_init_dir(self) -> Path:
        """``logs/eval/``: the evaluation job's ``wandb.init`` dir (its W&B run under ``logs/eval/wandb/``)."""
        return self.logs / "eval"

    @property
    def job_logs(self) -> Path:
        return self.logs / "jobs"

    def slurm_log_pattern(self, role: str) -> Path:
        """Slurm's own output file of the sbatch scripts (``%j`` job id; ``%A_%a`` array task)."""
        return self.job_logs / ("slurm-rollout-%A_%a.out" if role == "rollout" else f"slurm-{role}-%j.out")

    @property
    def eval_log(self) -> Path:
        """``logs/eval.jsonl``: one row per weight version the evaluation evaluated (or skipped: the row says why)."""
        return self.logs / "eval.jsonl"

    @property
    def eval_samples(self) -> Path:
        """``logs/eval_samples.jsonl.gz``: one row per evaluated response (prompt, response, score), compressed."""
        return self._compressed_log("eval_samples.jsonl")

    def reward_metrics(self, job: str) -> Path:
        """``logs/<reward job>.jsonl``: one row a minute (and a last one) of what reward job ``job`` scored."""
        return self.logs / f"{job}.jsonl"

    def reward_metrics_logs(self) -> dict[str, Path]:
        """Every reward job's log that exists, by job name."""
        return {p.stem: p for p in sorted(self.logs.glob("*.jsonl")) if _REWARD_JOB_RE.match(p.stem)}

    def job_log(self, job: str) -> Path:
        """The Python log of one job (rank): ``logs/jobs/<job>.log``."""
        return self.job_logs / f"{job}.log"

    @property
    def report(self) -> Path:
        """``report/``: where ``hpcrl report RUN`` writes when no ``--out`` is given."""
        return self.root / "report"

    # ---- life cycle
    def create(self) -> "RunDir":
        """Make the run's folders (idempotent)."""
        for d in (self.samples, self.weights, self.heartbeats, self.loading, self.checkpoints, self.logs,
                  self.job_logs):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def freeze_config(self, cfg: RunConfig, changes: tuple[str, ...] = ()) -> None:
        """Write the resolved config as ``config.yaml`` (tmp -> fsync -> replace), under the history of its
        changes: the comment block of the file it replaces, plus ``changes`` (one line each, oldest first)."""
        from hpcrl.rundir.fsio import write_bytes_atomic

        history = self.config_history() + list(changes)
        head = "".join(f"{_HISTORY_MARK}{line}\n" for line in history)
        if head:
            head = f"{_HISTORY_TITLE}\n{head}"
        write_bytes_atomic(self.config_path, (head + dump_config(cfg)).encode())

    def config_history(self) -> list[str]:
        """The changes made to the frozen config since launch (``hpcrl run --resume KEY=VALUE``), oldest first."""
        if not self.config_path.is_file():
            return []
        return [line[len(_HISTORY_MARK):] for line in self.config_path.read_text().splitlines()
                if line.startswith(_HISTORY_MARK)]

    def load_config(self) -> RunConfig:
        """The frozen config, validated; FileNotFoundError if this is not a run directory."""
        if not self.config_path.is_file():
            raise FileNotFoundError(f"{self.config_path} missing: {self.root} is not an hpcrl run directory "
                                    "(start a run with `hpcrl run CONFIG --run-dir DIR`)")
        return config_from_dict(yaml.safe_load(self.config_path.read_text()))
