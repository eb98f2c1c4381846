"""Randomized fault campaign: kill either job at any instant, damage shards and weights, check the promise.

Each trial is one tiny run (``configs/tiny.yaml``, random ``total_rollout_steps``,
``checkpoint_every_updates`` 3-8, ``seal_groups`` 1-4, ``staleness_threshold``
0 or 0.5, short timeouts) with real processes and real signals. Trial kinds
(``--kinds``):

=============  ==========================================================================
kind           what happens
=============  ==========================================================================
random         1-3 SIGKILL/SIGTERM of a random job at a random time; restarted after 0-3 s
commit         the rollout SIGTERMs itself at shard commits (``seal_manifest``), 1-3 times
instants       chain of kills at the instant a checkpoint, a publish, a shard commit and a
               weight load begin (``HPCRL_FAULT_POINT``, SIGTERM or SIGKILL at random)
shard-header   both jobs down, bytes flipped in the first 64 bytes of the next unconsumed shard
shard-data     the same, in its second half
weight-header  both jobs down, bytes flipped in the safetensors header of the checkpoint's version
weight-data    the same, in its tensor data
broadcast      ``weights.transport=broadcast``: kills at random times (sometimes both jobs at once) and
               inside a bucket's send or receive (``broadcast_bucket``)
partial        ``partial_rollout`` with s=1: kills at random times while groups span versions
agent          the tool agent on the toy calculator task with partial rollout: kills at random times,
               mid-generation and mid-tool-call
in-flight      partial rollout; once groups in flight were saved, the rollout job is killed and
               ``control/in_flight/w000.json`` replaced by ``null``, ``[]``, a wrong type, torn JSON or
               random bytes; it must be named in the log and ignored (the prompts start over)
=============  ==========================================================================

Checks per trial: the trainer finished (else: hang); exactly-once
(:mod:`hpcrl.analysis.exactly_once`: nothing committed twice, consumed twice or
lost); each metrics step once; only complete weight versions on disk; no job
process left behind; no job failing by itself (a crash loop); injected damage named in a
job log and never trained on (shards) or loaded (weights); with partial rollout, every
token's weight version is one the trainer had published, non-decreasing along a
trajectory, and never newer than the trainer's version when it consumed the group. Damaged-weight handling lands with branch
``weights``: run ``--kinds random,commit,instants,shard-header,shard-data`` before it.

Run::

    .venv/bin/python bench/soak.py --trials 6 --seed 1                 # a few minutes
    .venv/bin/python bench/soak.py --trials 90 --seed 7 --dir /scratch/me/soak   # >= 200 kills
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcrl.analysis.exactly_once import audit  # noqa: E402
from hpcrl.config import load_config  # noqa: E402
from hpcrl.rundir.fsio import read_json, read_jsonl  # noqa: E402
from hpcrl.launcher.prepare import prepare_run_dir  # noqa: E402
from hpcrl.launcher.submit import job_python  # noqa: E402
from hpcrl.logs.run_logs import read_staleness  # noqa: E402
from hpcrl.rundir.paths import RunDir  # noqa: E402

log = logging.getLogger("soak")
KINDS = ("random", "commit", "instants", "shard-header", "shard-data", "weight-header", "weight-data", "broadcast",
         "partial", "agent", "in-flight")
SAMPLE_KINDS = KINDS[:5]
TRAINER_POINTS, ROLLOUT_POINTS = ("checkpoint", "publish"), ("seal_manifest", "weight_load")


class Proc:
    """One incarnation of a job (``python -m hpcrl trainer|rollout RUN``), output appended to a file."""

    def __init__(self, role: str, rd: RunDir, fault: str | None):
        self.role, self.fault = role, fault
        args = ["trainer", str(rd.root)] if role == "trainer" else ["rollout", str(rd.root), "--writer-rank", "0"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # (``-m hpcrl`` in REPO: this checkout's hpcrl)
        env.pop("HPCRL_FAULT_POINT", None)
        if fault:
            env["HPCRL_FAULT_POINT"] = fault
        out = open(rd.root / f"{role}.out", "ab")
        self.p = subprocess.Popen([job_python(), "-m", "hpcrl", *args], stdout=out, stderr=subprocess.STDOUT,
                                  env=env, cwd=REPO)
        out.close()

    stopped_by_us = False
    """The campaign signalled it (its exit status is then no failure of its own)."""

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, sig: int, timeout_s: float = 60) -> bool:
        """Send ``sig``; True if the process ended within ``timeout_s`` (then SIGKILL)."""
        self.stopped_by_us = True
        if self.alive():
            self.p.send_signal(sig)
        try:
            self.p.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            return False


@dataclass
class Trial:
    """What one trial did and what its checks found."""

    index: int
    kind: str
    kills: dict[str, int] = field(default_factory=dict)
    """By kind: sigkill, sigterm (random times), term@<point>, kill@<point>."""
    problems: dict[str, list] = field(default_factory=dict)
    hang: bool = False
    lost: int = 0
    duplicated: int = 0
    damaged_used: bool = False
    wrong_versions: int = 0
    """Trajectories whose token versions are not ones the trainer had published, go backwards, or are newer
    than the trainer's version when it consumed them."""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


KILLED_AT_RANDOM = ("random", "broadcast", "partial", "agent")
PARTIAL = ["async_training.staleness_threshold=1.0", "async_training.partial_rollout=true",
           "rollout.max_concurrent_groups=4"]
AGENT = ["data.source=builtin:toy_calc", "reward.name=toy_calc", "agent.default=tool_agent",
         "agent.tools=[{name: calculator}]", "agent.tool_parser=tiny", "agent.max_assistant_turns=2",
         "agent.max_user_turns=1", "rollout.response_length=16"]
KIND_OVERRIDES = {"broadcast": ["weights.transport=broadcast", "timeouts.broadcast_s=10",
                                "timeouts.broadcast_connect_s=2"],
                  "partial": PARTIAL + ["rollout.response_length=24"], "agent": PARTIAL + AGENT,
                  "in-flight": PARTIAL + ["rollout.response_length=24"]}
"""What a kind changes in the tiny config (after the random staleness, which it may override)."""


def make_run(root: Path, rng: random.Random, kind: str, max_kills: int = 3) -> RunDir:
    # more kills need a longer run for them to land in (each restart costs a few seconds)
    steps = 48
    if kind in ("commit", "instants"):
        steps = rng.choice([40, 48, 64]) * max(1, max_kills // 3)
    elif kind in KILLED_AT_RANDOM:  # long enough for the kills to land while it runs (~2 s per 4 updates here)
        steps = rng.choice([96, 128, 160]) * max(1, max_kills // 3)
    overrides = [f"rollout.total_rollout_steps={steps}", f"trainer.checkpoint_every_updates={rng.randint(3, 8)}",
                 f"rollout.seal_groups={rng.randint(1, 4)}", "rollout.seal_interval_s=0.5",
                 f"async_training.staleness_threshold={rng.choice([0.0, 0.0, 0.5])}",
                 "timeouts.wait_samples_s=90", "timeouts.wait_weights_s=90", "timeouts.heartbeat_interval_s=0.5",
                 "timeouts.heartbeat_stale_s=5", "trainer.keep_consumed_shards=-1",  # the audit reads every shard
                 *KIND_OVERRIDES.get(kind, [])]
    cfg = load_config(REPO / "configs" / "tiny.yaml", overrides)
    return prepare_run_dir(cfg, root, resume=False)


class Runner:
    """Starts, kills and restarts the two jobs of one run; counts the kills."""

    def __init__(self, rd: RunDir, rng: random.Random, trial: Trial):
        self.rd, self.rng, self.trial = rd, rng, trial
        self.procs: dict[str, Proc] = {}
        self.all: list[Proc] = []
        self.faults: dict[str, list[str]] = {"trainer": [], "rollout": []}

    def start(self, role: str) -> None:
        fault = self.faults[role].pop(0) if self.faults[role] else None
        self.procs[role] = Proc(role, self.rd, fault)
        self.all.append(self.procs[role])

    def count(self, what: str) -> None:
        self.trial.kills[what] = self.trial.kills.get(what, 0) + 1

    def done(self) -> bool:
        return self.rd.trainer_done.exists()

    def restart_faulted(self) -> None:
        """A job that stopped itself at a fault point: count it and start it again after 0-3 s."""
        for role, p in list(self.procs.items()):
            if p.fault and not p.alive():
                point, _, action = p.fault.split(":")
                hit = p.p.returncode in (-signal.SIGKILL, 1) and self._fault_logged(role)
                if hit:
                    self.count(f"{'kill' if action == 'kill' else 'term'}@{point}")
                elif p.p.returncode != 0:
                    self.trial.problems.setdefault("job_failed", []).append(f"{role} rc {p.p.returncode}")
                p.fault = None
                if p.p.returncode != 0 or not self.done():
                    time.sleep(self.rng.uniform(0, 3))
                    self.start(role)

    def _fault_logged(self, role: str) -> bool:
        job = "trainer" if role == "trainer" else "rollout-w000"
        path = self.rd.job_log(job)
        return path.exists() and "fault injection" in path.read_text(errors="replace")[-200_000:]

    def kill_random(self, both: bool = False) -> None:
        """SIGKILL or SIGTERM one job (or both, one after the other), then start it again after 0-3 s."""
        roles = ["trainer", "rollout"] if both else [self.rng.choice(["trainer", "rollout"])]
        killed = []
        for role in roles:
            p = self.procs[role]
            if not p.alive() or self.done():
                continue
            sig = self.rng.choice([signal.SIGKILL, signal.SIGTERM])
            if not p.stop(sig, timeout_s=60):
                self.trial.problems.setdefault("stuck_after_sigterm", []).append(role)
            self.count("sigkill" if sig == signal.SIGKILL else "sigterm")
            killed.append(role)
        for role in self.rng.sample(killed, len(killed)):  # either may come back first
            time.sleep(self.rng.uniform(0, 3))
            self.start(role)

    def restart_failed(self) -> None:
        """A job that ended by itself with an error (not killed by the campaign) is a problem (a crash loop
        shows as several); start it again so the trial goes on."""
        for role, p in list(self.procs.items()):
            if not p.fault and not p.alive() and p.p.returncode != 0 and not p.stopped_by_us:
                self.trial.problems.setdefault("job_failed", []).append(f"{role} rc {p.p.returncode}")
                p.stopped_by_us = True
                if not self.done():
                    self.start(role)

    def finish(self, deadline_s: float) -> None:
        """Wait for the trainer to finish (restarting jobs that faulted); then for the rollout."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            self.restart_faulted()
            if not self.procs["rollout"].alive() and not self.done():
                self.restart_failed()
            t = self.procs["trainer"]
            if not t.alive() and not t.fault:
                if t.p.returncode == 0 and self.done():
                    break
                self.trial.problems.setdefault("trainer_failed", []).append(t.p.returncode)
                return
            time.sleep(0.2)
        else:
            self.trial.hang = True
            self.trial.problems["hang"] = [f"trainer not done after {deadline_s:.0f}s"]
            return
        r = self.procs["rollout"]
        try:
            r.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.trial.problems["rollout_did_not_stop"] = ["rollout alive 60 s after trainer_done"]

    def cleanup(self) -> None:
        left = [p for p in self.all if p.alive()]
        for p in left:
            p.stop(signal.SIGKILL)
        if left:
            self.trial.problems.setdefault("processes_left", []).extend(p.role for p in left)


# ---------------------------------------------------------------- damage

def flip(path: Path, lo: int, hi: int, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    hi = min(hi, len(data))
    for _ in range(4):
        data[rng.randrange(lo, hi)] ^= 0xFF
    path.write_bytes(bytes(data))


def checkpoint_state(rd: RunDir) -> dict:
    from hpcrl.trainer.safe_checkpoint import load_tree

    tag = read_json(rd.latest_checkpoint)["tag"]
    return load_tree(str(rd.checkpoints / tag / "mp_rank_00_model_states.pt"))["hpcrl"]


def wait_for(pred, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


def damage_trial(run: Runner, kind: str) -> dict:
    """Both jobs down after a checkpoint, damage a shard or weight file, restart both."""
    rd, rng = run.rd, run.rng
    if not wait_for(lambda: (read_json(rd.latest_checkpoint) or {}).get("step", 0) >= 3, 120):
        run.trial.problems["setup"] = ["no checkpoint at step 3 within 120 s"]
        return {}
    # USR2: checkpoint at the trainer's frontier (the checkpoint's weight version is the newest)
    run.procs["trainer"].stop(rng.choice([signal.SIGKILL, signal.SIGUSR2]) if kind.startswith("shard")
                              else signal.SIGUSR2)
    state = checkpoint_state(rd)
    pos = state["cursor"].get("w000", {"line": 0, "row": 0})
    wait_for(lambda: len(list(read_jsonl(rd.shard_manifest("w000")))) > pos["line"], 20)
    run.procs["rollout"].stop(signal.SIGKILL)
    if kind.startswith("shard"):
        lines = list(read_jsonl(rd.shard_manifest("w000")))
        if len(lines) <= pos["line"]:
            run.trial.problems["setup"] = ["no committed shard after the checkpoint's cursor"]
            return {}
        target = rd.writer_dir("w000") / lines[pos["line"]]["shard"]
        # rows before the checkpoint's cursor were trained on before the damage; the rest must never be
        damaged_rows = [f"w000/{p}" for p in lines[pos["line"]]["prompt_indices"][pos["row"]:]]
    else:
        target = rd.weight_version_dir(state["param_version"]) / "model.safetensors"
    size = target.stat().st_size
    if kind.endswith("header"):
        lo, hi = (0, 64) if kind.startswith("shard") else (8, 8 + int.from_bytes(target.read_bytes()[:8], "little"))
    else:
        lo, hi = size // 2, size
    flip(target, lo, hi, rng)
    time.sleep(rng.uniform(0, 3))
    run.start("trainer")
    run.start("rollout")
    return {"path": target, "version": state.get("param_version"),
            "rows": damaged_rows if kind.startswith("shard") else []}


def check_damage(rd: RunDir, kind: str, info: dict, trial: Trial) -> None:
    if not info:
        return
    if kind == "in-flight":
        rlog = rd.job_log("rollout-w000").read_text(errors="replace")
        if f"ignoring the groups in flight saved in {info['in_flight']}" not in rlog:
            trial.problems["damage_not_named"] = [f"{info['in_flight']} ({info['form']})"]
        return
    path: Path = info["path"]
    logs = "\n".join(p.read_text(errors="replace") for p in rd.job_logs.glob("*.log"))
    if kind.startswith("shard"):
        if not re.search(r"SKIPPING shard \S*" + re.escape(path.name), logs):
            trial.problems["damage_not_named"] = [str(path)]
        st = read_staleness(rd)
        if ((st.shard == path.name) & st.group_id.isin(info["rows"])).any():
            trial.damaged_used = True
            trial.problems["damaged_shard_trained"] = [path.name]
    else:
        vdir = path.parent.name
        if not re.search(rf"{vdir}.*(damag|corrupt|checksum|mismatch|differs|torn|bad)|"
                         rf"(damag|corrupt|checksum|mismatch|torn|bad).*{vdir}", logs, re.I):
            trial.problems["damage_not_named"] = [str(path)]
        rlog = rd.job_log("rollout-w000").read_text(errors="replace")
        after = rlog.split("recovered", 1)[-1] if "recovered" in rlog else rlog
        if re.search(rf"loaded weight version {info['version']} in", after):
            trial.damaged_used = True
            trial.problems["damaged_weights_loaded"] = [vdir]


IN_FLIGHT_FORMS = {"null": b"null", "list": b"[]", "groups null": b'{"schema": 1, "groups": null}',
                   "wrong type": b'{"schema": 1, "groups": [{"prompt_index": "7", "agent": 1, "trajectories": {}}]}',
                   "zeros": bytes(64), "random": None, "torn": None}
"""What a damaged ``control/in_flight/<writer>.json`` holds (random: 64 random bytes; torn: the file cut in half)."""


def in_flight_trial(run: Runner) -> dict:
    """Once the rollout job has saved groups in flight, SIGKILL it, damage the file, start it again."""
    rd, rng = run.rd, run.rng
    path = rd.in_flight_states("w000")
    if not wait_for(path.exists, 120):
        run.trial.problems["setup"] = ["no groups in flight saved within 120 s"]
        return {}
    run.procs["rollout"].stop(signal.SIGKILL)
    run.count("sigkill")
    form = rng.choice(sorted(IN_FLIGHT_FORMS))
    data = IN_FLIGHT_FORMS[form]
    if form == "random":
        data = bytes(rng.randrange(256) for _ in range(64))
    elif form == "torn":
        data = path.read_bytes()[: max(len(path.read_bytes()) // 2, 1)]
    path.write_bytes(data)
    time.sleep(rng.uniform(0, 3))
    run.start("rollout")
    return {"in_flight": path, "form": form}


# ---------------------------------------------------------------- checks

def check_token_versions(rd: RunDir, trial: Trial) -> None:
    """Every committed trajectory: versions non-decreasing and published; every consumed one: no newer than
    the trainer's version when it took the group."""
    from hpcrl.samples.reader import read_shard
    from hpcrl.samples.schema import ShardManifestLine

    newest = max((int(r["param_version"]) for r in read_jsonl(rd.metrics)), default=0) + 1
    bad = []
    for d in read_jsonl(rd.shard_manifest("w000")):
        line = ShardManifestLine.from_json(d)
        for g in read_shard(rd.writer_dir("w000") / line.shard, line, "w000"):
            for j, t in enumerate(g.trajectories):
                v = t.token_versions
                if len(v) and ((v[1:] < v[:-1]).any() or v.min() < 0 or v.max() > newest):
                    bad.append(f"{line.shard} prompt {g.prompt_index} #{j}")
    st = read_staleness(rd)
    late = st[st.version_end > st.trainer_version]
    bad += [f"consumed at v{r.trainer_version} with a token of v{r.version_end}" for r in late.itertuples()]
    trial.wrong_versions = len(bad)
    if bad:
        trial.problems["wrong_token_versions"] = bad[:5]

def check_run(rd: RunDir, trial: Trial) -> None:
    cfg = rd.load_config()
    if trial.hang or "trainer_failed" in trial.problems:
        return
    a = audit(rd, cfg.knobs.group_bound)
    for k, v in a.problems().items():
        trial.problems[k] = v[:5]
    trial.lost = len(a.lost) + len(a.before_cursor_not_consumed)
    trial.duplicated = len(a.committed_twice) + len(a.consumed_twice) + len(a.consumed_from_skipped_shards)
    steps = [r["step"] for r in read_jsonl(rd.metrics)]
    if steps != list(range(1, cfg.total_updates + 1)):
        trial.problems["metrics_steps"] = [f"{len(steps)} rows, first differences at {steps[:3]}..."]
    incomplete = [p.name for p in rd.weights.iterdir()
                  if RunDir.parse_weight_version(p.name) is not None and not (p / "manifest.json").is_file()]
    if incomplete:
        trial.problems["incomplete_weight_versions"] = incomplete
    strays = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if str(rd.root) in (d / "cmdline").read_bytes().decode(errors="replace"):
                    strays.append(int(d.name))
            except OSError:
                pass
    if strays:
        trial.problems["processes_left"] = strays


def run_trial(index: int, kind: str, rng: random.Random, parent: Path, deadline_s: float,
              max_kills: int = 3) -> Trial:
    """One trial of ``kind``; random and commit trials make 1..max_kills kills."""
    trial = Trial(index, kind)
    t0 = time.monotonic()
    rd = make_run(parent / f"trial-{index:03d}-{kind}", rng, kind, max_kills)
    run = Runner(rd, rng, trial)
    info = {}
    try:
        if kind == "commit":
            run.faults["rollout"] = [f"seal_manifest:{rng.randint(2, 12)}:term" for _ in range(rng.randint(1, max_kills))]
        elif kind == "instants":
            for point in rng.sample(TRAINER_POINTS + ROLLOUT_POINTS, 4):
                role = "trainer" if point in TRAINER_POINTS else "rollout"
                n = {"checkpoint": rng.randint(1, 2), "publish": rng.randint(2, 6), "weight_load": rng.randint(1, 4),
                     "seal_manifest": rng.randint(2, 12)}[point]
                run.faults[role].append(f"{point}:{n}:{rng.choice(['term', 'kill'])}")
        elif kind == "broadcast":  # sometimes inside a bucket's send or receive too
            for role in ("trainer", "rollout"):
                if rng.random() < 0.5:
                    run.faults[role].append(f"broadcast_bucket:{rng.randint(2, 30)}:{rng.choice(['term', 'kill'])}")
        run.start("trainer")
        run.start("rollout")
        if kind in KILLED_AT_RANDOM:
            for _ in range(rng.randint(1, max_kills)):
                time.sleep(rng.uniform(1, 10 if max_kills <= 3 else 6))
                run.restart_faulted()
                run.kill_random(both=kind != "random" and rng.random() < 0.3)
        elif kind == "in-flight":
            info = in_flight_trial(run)
        elif kind not in ("commit", "instants"):
            info = damage_trial(run, kind)
        if "setup" not in trial.problems:
            run.finish(deadline_s)
    finally:
        run.cleanup()
    if "setup" not in trial.problems:
        check_run(rd, trial)
        check_damage(rd, kind, info, trial)
        if not trial.hang and "trainer_failed" not in trial.problems:
            check_token_versions(rd, trial)
    trial.wall_s = time.monotonic() - t0
    return trial


def summary(trials: list[Trial]) -> str:
    """The campaign table: one row per kind and a total."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import table

    kill_kinds = sorted({k for t in trials for k in t.kills})
    rows = []
    for kind in [k for k in KINDS if any(t.kind == k for t in trials)] + ["total"]:
        ts = [t for t in trials if kind in ("total", t.kind)]
        rows.append([kind, len(ts), sum(t.ok for t in ts)] + [sum(t.kills.get(k, 0) for t in ts) for k in kill_kinds]
                    + [sum(sum(t.kills.values()) for t in ts), sum(t.lost for t in ts), sum(t.duplicated for t in ts),
                       sum(t.hang for t in ts), sum(t.damaged_used for t in ts), sum(t.wrong_versions for t in ts)])
    return table(["kind", "trials", "passed", *kill_kinds, "kills", "lost", "duplicated", "hangs", "damaged used",
                  "wrong versions"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=6, help="number of trials (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seeds the kinds, times, signals and damage (default 0)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--dir", default=None, help="parent folder of the trial run dirs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs of failed trials")
    p.add_argument("--max-kills", type=int, default=3, help="random/commit trials make 1..N kills (default 3)")
    p.add_argument("--deadline-s", type=float, default=300, help="a trainer not done after this long is a hang")
    a = p.parse_args(argv)
    kinds = a.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]  # a kind named twice is drawn twice as often
    if bad or a.trials < 1:
        p.error(f"--kinds must be a subset of {','.join(KINDS)} (got {bad}); --trials >= 1 (got {a.trials})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s soak %(message)s")
    rng = random.Random(a.seed)
    parent = Path(tempfile.mkdtemp(prefix="hpcrl-soak-", dir=a.dir))
    trials = []
    for i in range(a.trials):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        t = run_trial(i, kind, random.Random(rng.random()), parent, a.deadline_s, a.max_kills)
        trials.append(t)
        log.info("trial %d %-13s %s in %.0fs kills %s %s", i, kind, "ok" if t.ok else "FAILED", t.wall_s, t.kills,
                 t.problems or "")
        if t.ok or not a.keep:
            shutil.rmtree(parent / f"trial-{i:03d}-{kind}", ignore_errors=True)
    print(summary(trials))
    if a.keep and not all(t.ok for t in trials):
        print(f"failed trials kept in {parent}")
    else:
        shutil.rmtree(parent, ignore_errors=True)
    return 0 if all(t.ok for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
