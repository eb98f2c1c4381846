"""`hpcrl report` and `hpcrl status` on real tiny runs.

Two finished runs (s=0 and s=0.5, 200 groups each) are made once per module.
Every number the tests check in report.md is recomputed here from the raw JSONL
files with plain ``json`` (not through hpcrl.analysis), by the definitions the
report states under its tables.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import re
import shutil
import subprocess
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, make_run, python, start_rollout, start_trainer, wait_until
from hpcrl.analysis.recommend import HIGH, recommend
from hpcrl.analysis.status import status_main
from hpcrl.rundir.fsio import JsonlTail
from hpcrl.logs.run_logs import read_jsonl_frame
from hpcrl.cli import main

RUN_PLOTS = ["lag_distribution.png", "lag_over_time.png", "partial_spans.png", "idle_ratios.png", "timeline.png",
             "throughput.png", "reward.png", "training.png", "drops.png"]
COMPARE_PLOTS = ["compare_reward.png", "compare_lag.png", "compare_idle.png", "compare_progress.png"]


# ---------------------------------------------------------------- raw logs, read independently

def log_bytes(path: Path) -> bytes:
    """A log's lines, read here without hpcrl's readers: a ``*.gz`` log is gzip members, the last maybe cut short."""
    data, out = path.read_bytes(), b""
    while path.suffix == ".gz" and data:
        member = zlib.decompressobj(wbits=31)
        out += member.decompress(data)
        if not member.eof:
            break
        data = member.unused_data
    return out if path.suffix == ".gz" else data


def staleness_log(root: Path) -> Path:
    """The staleness log: compressed, or plain where the test made an older hpcrl's run."""
    plain = root / "logs" / "staleness.jsonl"
    return plain if plain.exists() else root / "logs" / "staleness.jsonl.gz"


def jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in log_bytes(path).split(b"\n"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # the torn last line (or the empty string after the final newline)
    return rows


class Raw:
    def __init__(self, root: Path):
        self.st = jsonl(staleness_log(root))
        self.m = jsonl(root / "logs" / "metrics.jsonl")
        self.ro = [r for p in sorted((root / "logs").glob("rollout-*.jsonl")) for r in jsonl(p)]
        self.trained = [r for r in self.st if not r["dropped"]]
        self.groups: dict[str, list[dict]] = defaultdict(list)
        for r in self.trained:
            self.groups[r["group_id"]].append(r)
        step = [r["timing_s/wait_samples"] + r["timing_s/update"] + r["timing_s/param_sync"] for r in self.m]
        self.t0 = min([r["created_s"] for r in self.st] + [r["time_s"] - s for r, s in zip(self.m, step)]
                      + [r["time_s"] - r["wall_s"] - r["timing_s/load_weights"] for r in self.ro])

    @staticmethod
    def trainer_idle(m):
        return sum(r["timing_s/wait_samples"] for r in m) / sum(
            r["timing_s/wait_samples"] + r["timing_s/update"] + r["timing_s/param_sync"] for r in m)

    @staticmethod
    def rollout_idle(ro):
        return sum(r["rollouter/idle_ratio"] * r["wall_s"] for r in ro) / sum(r["wall_s"] for r in ro)

    def summary(self) -> dict:
        m, n = self.m, len(self.m)
        steps = [r["timing_s/wait_samples"] + r["timing_s/update"] + r["timing_s/param_sync"] for r in m]
        synced = [r["timing_s/param_sync"] for r in m if r["timing_s/param_sync"] > 0]
        lags = [max(r["lag"] for r in g) for g in self.groups.values()]
        total = m[-1]["time_s"] - self.t0
        k = max(1, round(n / 10))
        return {"step (s)": sum(steps) / n, "update (s)": sum(r["timing_s/update"] for r in m) / n,
                "sync (s)": sum(synced) / len(synced),
                "gen (s/group)": sum(g[0]["finished_s"] - g[0]["created_s"] for g in self.groups.values()) / len(lags),
                "total (s)": total, "final reward": sum(r["reward/mean"] for r in m[-k:]) / k,
                "lag mean": sum(lags) / len(lags), "lag max": max(lags), "idle trainer": self.trainer_idle(m),
                "idle rollout": self.rollout_idle(self.ro), "tokens/s": sum(r["n_tokens"] for r in m) / total,
                "dropped groups": len({r["group_id"] for r in self.st if r["dropped"]})
                + m[-1].get("fully_async/count/corrupt_groups_skipped", 0)}


# ---------------------------------------------------------------- the report, read back

def parse_report(md: str) -> dict:
    """{(h2, h3): [table, ...]} with each table a list of {column: cell} rows; plus paragraphs."""
    tables: dict[tuple, list] = defaultdict(list)
    h2 = h3 = ""
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            h2, h3 = line[3:], ""
        elif line.startswith("### "):
            h3 = line[4:]
        elif line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("| "):
                rows.append(dict(zip(header, [c.strip() for c in lines[i].strip("|").split("|")])))
                i += 1
            tables[(h2, h3)].append(rows)
            continue
        i += 1
    return tables


def close(cell: str, value: float, decimals: Optional[int] = None) -> bool:
    """The cell shows ``value`` rounded to the digits it has (or to ``decimals``)."""
    if cell == "n/a":
        return math.isnan(value)
    if decimals is None:
        decimals = len(cell.split(".")[1]) if "." in cell else 0
    return abs(float(cell) - value) <= 0.5 * 10 ** -decimals + 1e-9


def assert_row_matches(row: dict, expected: dict) -> None:
    for col, value in expected.items():
        ok = row[col] == str(value) if isinstance(value, int) else close(row[col], value)
        assert ok, f"column {col!r}: report says {row[col]}, raw logs give {value}"


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """The real command in its own process."""
    return subprocess.run([python(), "-m", "hpcrl", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout_s)


def cli(*args: str) -> subprocess.CompletedProcess:
    """The same command in this process (no interpreter start-up: pandas and matplotlib are loaded once)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


# ---------------------------------------------------------------- fixtures

BACKGROUND_RUNS = {"analysis:s0": ["rollout.total_rollout_steps=200"],
                   "analysis:s05": ["rollout.total_rollout_steps=200", "async_training.staleness_threshold=0.5"]}
"""Two 50-update runs, s=0 and s=0.5, started in the background when the session starts (conftest.BackgroundRuns):
the tests compare what the analysis reads with the raw logs, whatever the timing was."""


def background_keys(item) -> tuple[str, ...]:
    """The background runs a test item reads (none: it runs its own jobs)."""
    return tuple(BACKGROUND_RUNS) if "runs" in item.fixturenames else ()


@pytest.fixture(scope="module")
def runs(background_runs):
    """The two finished runs, by name."""
    return {name: background_runs.finish(f"analysis:{name}").root for name in ("s0", "s05")}


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    res = run_cli("report", str(runs["s0"]), str(runs["s05"]), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    return out, (out / "report.md").read_text(), res


# ---------------------------------------------------------------- tests

@pytest.mark.slow
def test_side_by_side_table_has_one_row_per_run_equal_to_the_raw_logs(runs, report):
    out, md, _ = report
    (table,) = parse_report(md)[("Side by side", "")]
    assert [r["run"] for r in table] == ["s0", "s05"]
    for row in table:
        raw = Raw(runs[row["run"]])
        assert row["s"] == {"s0": "0", "s05": "0.5"}[row["run"]]
        assert row["updates"] == "50/50"
        assert_row_matches(row, raw.summary())
    assert (out / "report.html").read_text().count("<tr>") > 10


@pytest.mark.slow
def test_per_run_tables_equal_the_raw_logs(runs, report):
    _, md, _ = report
    tables = parse_report(md)
    for name, root in runs.items():
        raw = Raw(root)
        h2 = f"Run {name}"
        # lag: groups by their largest lag, tokens by trajectory lag
        (lag,) = tables[(h2, "Lag")]
        groups_by_lag, tokens_by_lag, traj_by_lag = defaultdict(int), defaultdict(int), defaultdict(int)
        for g in raw.groups.values():
            groups_by_lag[max(r["lag"] for r in g)] += 1
        for r in raw.trained:
            tokens_by_lag[r["lag"]] += r["n_tokens"]
            traj_by_lag[r["lag"]] += 1
        assert [int(r["lag (versions)"]) for r in lag] == sorted(groups_by_lag)
        for r in lag:
            x = int(r["lag (versions)"])
            assert_row_matches(r, {"groups": groups_by_lag[x], "tokens": tokens_by_lag[x], "trajectories": traj_by_lag[x]})
            assert close(r["% of groups"], 100 * groups_by_lag[x] / len(raw.groups), 1)
            assert close(r["% of tokens"], 100 * tokens_by_lag[x] / sum(tokens_by_lag.values()), 1)
        # per version range: the report's labels, every number recomputed from raw rows
        (per_version,) = tables[(h2, "Idle ratios per version")]
        assert sum(int(r["updates"]) for r in per_version) == len(raw.m)
        for r in per_version:
            nums = [int(v) for v in re.findall(r"\d+", r["versions"])]  # "v3" or "v0-v10"
            lo, hi = nums[0], nums[-1]
            m = [x for x in raw.m if lo <= x["param_version"] <= hi]
            ro = [x for x in raw.ro if lo <= x["param_version"] <= hi]
            lags = [max(t["lag"] for t in g) for g in raw.groups.values() if lo <= g[0]["trainer_version"] <= hi]
            rewards = [t["reward"] for t in raw.trained if lo <= t["version_start"] <= hi]
            assert_row_matches(r, {"updates": len(m), "rollout groups": sum(x["groups"] for x in ro)})
            assert close(r["trainer idle"], Raw.trainer_idle(m) if m else math.nan)
            assert close(r["rollout idle"], Raw.rollout_idle(ro) if ro else math.nan)
            assert close(r["lag mean (versions)"], sum(lags) / len(lags) if lags else math.nan)
            assert close(r["reward of generated"], sum(rewards) / len(rewards) if rewards else math.nan)
        # throughput: trainer tokens over its step seconds; each writer's tokens over its wall seconds
        throughput, queue = tables[(h2, "Throughput and queue")]
        trainer = next(r for r in throughput if r["side"] == "trainer")
        secs = sum(x["timing_s/wait_samples"] + x["timing_s/update"] + x["timing_s/param_sync"] for x in raw.m)
        toks = sum(x["n_tokens"] for x in raw.m)
        assert_row_matches(trainer, {"tokens": toks, "seconds": secs, "tokens/s": toks / secs,
                                     "groups": raw.m[-1]["consumed_groups"]})
        writer = next(r for r in throughput if r["side"] == "rollout w000")
        assert_row_matches(writer, {"tokens": sum(x["tokens"] for x in raw.ro), "groups": sum(x["groups"] for x in raw.ro),
                                    "seconds": sum(x["wall_s"] for x in raw.ro)})
        assert abs(sum(float(r["% of time"]) for r in queue) - 100) < 0.5
        # timings and group life
        timing, life = tables[(h2, "Timeline: generation, training, weight sync")]
        upd = next(r for r in timing if r["part"] == "trainer: update")
        assert_row_matches(upd, {"count": len(raw.m), "total (s)": sum(x["timing_s/update"] for x in raw.m)})
        gen = next(r for r in life if r["stage"] == "generating")
        assert close(gen["mean (s)"], raw.summary()["gen (s/group)"])
        # nothing was dropped, and the report says so
        assert not tables[(h2, "Samples dropped")]
        assert raw.m[-1]["fully_async/count/dropped_max_staleness"] == 0
    assert md.count("None: no group was dropped") == 2
    assert md.count("None: all 1600 trained trajectories were generated under one weight version") == 2


@pytest.mark.slow
def test_every_plot_exists_and_is_a_valid_png(report):
    out, md, res = report
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    expected = COMPARE_PLOTS + [f"{run}/{p}" for run in ("s0", "s05") for p in RUN_PLOTS]
    assert sorted(linked) == sorted(expected)
    for rel in expected:
        path = out / rel
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", rel
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 300, (rel, im.size)
    assert "22 plots" in res.stdout


@pytest.mark.slow
def test_recommendation_states_the_idle_ratios_it_used(runs, report):
    _, md, res = report
    (table,) = parse_report(md)[("Side by side", "")]
    for row in table:
        line = next(x for x in md.splitlines()  # the recommendation's bullet (the ceiling's start alike)
                    if x.startswith(f"- {row['run']}: ") and "trainer idle" in x)
        raw = Raw(runs[row["run"]])
        assert close(re.search(r"trainer idle (\d\.\d\d)", line).group(1), Raw.trainer_idle(raw.m), 2), line
        assert close(re.search(r"rollout idle (\d\.\d\d)", line).group(1), Raw.rollout_idle(raw.ro), 2), line
        # the report and the command open with the plain lines (hpcrl/analysis/glance.py), the same numbers
        waits = re.search(rf"^{row['run']}: waiting: the trainer waited for samples (\d+)% of its time, the rollout "
                          r"jobs waited for weights or the budget (\d+)% of theirs: ", res.stdout, re.M)
        assert waits, res.stdout
        assert abs(int(waits.group(1)) / 100 - Raw.trainer_idle(raw.m)) <= 0.005 + 1e-9, waits.group(0)
        assert abs(int(waits.group(2)) / 100 - Raw.rollout_idle(raw.ro)) <= 0.005 + 1e-9, waits.group(0)
        for what in ("learning", "staleness", "waiting", "to change"):
            assert f"\n- {row['run']}: {what}: " in md.split("\n## Side by side")[0], what
    assert md.splitlines()[2] == "## At a glance", md[:300]


def test_recommendation_rule():
    class K:  # the knobs the rule reads: s=0, K=1, R=4 -> B=4, nothing ahead
        staleness_threshold, trigger_parameter_sync_step, groups_per_update = 0.0, 1, 4
        admission_budget, max_concurrent_groups, rollout_jobs = 4, 2, 1

    assert recommend(0.6, 0.05, K).bottleneck == "rollout"
    assert "resources.rollout_jobs 1 -> 2" in recommend(0.6, 0.05, K).line
    assert recommend(0.05, 0.6, K).bottleneck == "trainer"
    assert recommend(0.1, 0.2, K).bottleneck == "balanced"
    both = recommend(0.8, 0.6, K)
    assert both.bottleneck == "neither" and "staleness_threshold from 0 to at least 1" in both.line
    assert "trainer idle 0.80" in both.line and "rollout idle 0.60" in both.line
    K.staleness_threshold, K.admission_budget = 1.0, 8  # a whole update ahead already: the hand-off limits
    assert "max_concurrent_groups" in recommend(0.8, 0.6, K).line
    assert recommend(float("nan"), 0.5, K).bottleneck == "unknown"
    assert HIGH < 0.6


def synthetic_run(tmp_path, rewards, wait_s=0.6, rollout_idle=0.1):
    """A RunData of ``len(rewards)`` updates (4 groups each, lag alternating 0 and 1) without a run directory's jobs:
    the trainer waits ``wait_s`` of each 1 s step, the rollout job idles ``rollout_idle`` of its time."""
    import pandas as pd

    from hpcrl.analysis.load import RunData
    from hpcrl.config.knobs import Knobs
    from hpcrl.logs import metric_names as M

    n = len(rewards)
    metrics = pd.DataFrame({"step": range(1, n + 1), "time_s": [100.0 + i for i in range(1, n + 1)],
                            M.REWARD_MEAN: rewards, M.WAIT_SAMPLES_S: wait_s, M.UPDATE_S: 0.9 - wait_s,
                            M.PARAM_SYNC_S: 0.1, "param_version": range(1, n + 1), "n_tokens": 32})
    rollout = pd.DataFrame({"wall_s": [float(n)], M.ROLLOUT_IDLE_RATIO: [rollout_idle], "param_version": [0],
                            "groups": [4 * n]})
    staleness = pd.DataFrame([{"group_id": f"g{g}", "sample_id": f"w000/{g}/0", "writer": "w000", "lag": g % 2,
                               "version_start": 0, "version_end": 0, "trainer_version": g // 4, "trainer_step": g // 4 + 1,
                               "n_tokens": 8, "reward": 0.5, "created_s": 100.0, "finished_s": 100.5,
                               "committed_s": 100.6, "consumed_s": 101.0, "dropped": ""} for g in range(4 * n)])
    knobs = Knobs(staleness_threshold=0.5, ppo_mini_batch_size=4, total_rollout_steps=4 * n, n=8, rollout_jobs=1,
                  max_concurrent_groups=2)  # K=1, R=4: B=6, lag bound 1, n updates
    return RunData("synthetic", tmp_path, knobs, staleness, metrics, rollout, {}, None, 100.0)


def test_the_report_opens_with_plain_answers(tmp_path):
    """Is it learning, how stale, which job waits, what to change: in words, each with its numbers."""
    from hpcrl.logs import metric_names as M
    from hpcrl.analysis.glance import glance

    rising = synthetic_run(tmp_path, list(np.linspace(0.1, 0.9, 20)))
    learning, stale, waits, change = glance(rising)
    assert learning == "learning: yes: reward 0.121 -> 0.879 (mean of the first and the last 2 of 20 updates)", learning
    assert stale == ("staleness: the samples trained on came from weights 0.50 versions old on average, at most 1 "
                     "(async_training.staleness_threshold=0.5 allows 1 with one rollout job)"), stale
    assert waits == ("waiting: the trainer waited for samples 60% of its time, the rollout jobs waited for weights or "
                     "the budget 10% of theirs: generation is the slow side"), waits
    assert change == "to change: more generation: resources.rollout_jobs 1 -> 2 (or more GPUs per rollout job)"
    assert glance(synthetic_run(tmp_path, [0.0] * 20))[0].startswith("learning: no: every reward so far is 0")
    flat = glance(synthetic_run(tmp_path, [0.3, 0.5] * 10, wait_s=0.05, rollout_idle=0.6))
    assert flat[0].startswith("learning: not clearly: reward 0.4 -> 0.4"), flat[0]
    assert flat[2].endswith(": training is the slow side") and flat[3] == "to change: more training: give the " \
        "trainer more GPUs", flat
    # one update per window (10 updates): the noise comes from successive updates, so an alternating reward is no rise
    assert glance(synthetic_run(tmp_path, [0.1, 0.3] * 5))[0].startswith("learning: not clearly: reward 0.1 -> 0.3")
    assert glance(synthetic_run(tmp_path, [0.9, 0.1]))[0] == "learning: too early to tell: 2 update(s), reward 0.1"
    older = synthetic_run(tmp_path, [0.1, 0.3] * 5)  # an older hpcrl's metrics: no timing_s/param_sync (load: NaN)
    older.metrics[M.PARAM_SYNC_S], older.missing = np.nan, {"metrics": [M.PARAM_SYNC_S]}
    assert glance(older)[2] == "waiting: the rollout jobs waited for weights or the budget 10% of theirs: not known yet"


def test_a_rollout_bound_line_names_the_exact_scale_command_of_a_live_run():
    from hpcrl.analysis.recommend import FleetNow

    class K:
        staleness_threshold, trigger_parameter_sync_step, groups_per_update = 0.0, 1, 4
        admission_budget, max_concurrent_groups, rollout_jobs = 4, 2, 1

    live = recommend(0.6, 0.05, K, fleet=FleetNow("/scratch/me/run1", True, 2, 0.4)).line
    assert "`hpcrl scale /scratch/me/run1 --rollout-jobs 3`" in live, live
    assert "each of the 2 writers commits ~0.40 groups/s, so one more adds ~0.40 groups/s" in live
    done = recommend(0.6, 0.05, K, fleet=FleetNow("/scratch/me/run1", False, 2)).line
    assert "resources.rollout_jobs 2 -> 3 in the next run" in done and "/scratch/me/run1 --rollout" not in done
    fewer = recommend(0.05, 0.6, K, fleet=FleetNow("/r", True, 3)).line
    assert "`hpcrl scale /r --rollout-jobs 2`" in fewer


@pytest.mark.slow
def test_status_once_on_a_finished_run(runs):
    res = run_cli("status", str(runs["s05"]), "--once", timeout_s=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[" + "#" * 30 + "] 50/50 updates 100%  done" in res.stdout
    assert "run finished: 50 updates, version 50, 200 groups consumed" in res.stdout
    # the last update consumed groups of v49 or v50 (lag bound 1), so the rollout job loaded at least v49;
    # whether it also loaded the final v50 before it saw trainer_done is a race, and both are right
    loaded = re.search(r"rollout-w000\s+done\s+v(\d+)", res.stdout)
    assert loaded and int(loaded.group(1)) in (49, 50), res.stdout
    # without --once it also ends by itself on a finished run
    assert run_cli("status", str(runs["s0"]), "--interval-s", "0.2", timeout_s=60).returncode == 0


@pytest.mark.slow
def test_status_and_report_on_a_run_killed_mid_way(tmp_path):
    rd = make_run(tmp_path, "rollout.total_rollout_steps=400", name="killed")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: len(jsonl(rd.metrics)) >= 8, 240, "8 updates", jobs=(trainer, rollout))
    live = io.StringIO()
    assert status_main(rd.root, once=True, out=live) == 0
    text = live.getvalue()
    assert re.search(r"trainer \[#*\.+\] \d+/100 updates +\d+%  ETA \d", text), text
    assert "GONE" not in text and "run stopped" not in text
    trainer.kill()
    rollout.kill()
    with open(rd.metrics, "ab") as f:  # what a kill in the middle of a row leaves
        f.write(b'{"step": 999, "reward/me')
    res = cli("status", str(rd.root), "--once")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.count("GONE") == 2 and "is not running on" in res.stdout
    assert "run stopped before finishing" in res.stdout and "--resume" in res.stdout
    out = tmp_path / "report"
    res = cli("report", str(rd.root), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    md = (out / "report.md").read_text()
    assert "NOT finished" in md and "The run has not finished" in md
    assert "logs/metrics.jsonl: skipped 1 incomplete or invalid line(s)" in md
    raw = Raw(rd.root)
    ((row,),) = parse_report(md)[("Summary", "")]
    assert row["updates"] == f"{len(raw.m)}/100"
    expected = raw.summary()
    del expected["dropped groups"]
    assert_row_matches(row, expected)
    for p in RUN_PLOTS:
        assert (out / "killed" / p).read_bytes()[:4] == b"\x89PNG"


def _rewrite(path: Path, change, to: Optional[Path] = None) -> None:
    """Rewrite a log's rows through ``change`` (into ``to``, plain, the original removed, if given)."""
    text = "".join(json.dumps(change(r)) + "\n" for r in jsonl(path)).encode()
    if to is not None:
        path.unlink()
        path = to
    path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)


@pytest.mark.slow
def test_run_from_an_older_hpcrl_gets_a_clear_message(runs, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(runs["s0"], old, ignore=shutil.ignore_patterns("checkpoints", "weights", "samples", "base_model"))
    cfg = old / "config.yaml"
    cfg.write_text(cfg.read_text().replace("rollout:\n", "rollout:\n  retired_knob: 3\n", 1))
    drop = lambda keys: lambda r: {k: v for k, v in r.items() if k not in keys}  # noqa: E731
    _rewrite(old / "logs" / "staleness.jsonl.gz", drop({"created_s", "finished_s", "dropped"}),  # plain, as it was
             to=old / "logs" / "staleness.jsonl")
    _rewrite(old / "logs" / "metrics.jsonl", drop({"timing_s/param_sync"}))
    res = cli("report", str(old), "--out", str(tmp_path / "report"))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert "logs/staleness.jsonl lacks column(s) created_s, finished_s, dropped: it was written by an older hpcrl" \
        in res.stdout
    assert "logs/metrics.jsonl lacks column(s) timing_s/param_sync" in res.stdout
    assert "config.yaml was written by another hpcrl version" in res.stdout and "rollout.retired_knob" in res.stdout
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Timeline: incomplete (logs/metrics.jsonl lacks timing_s/param_sync" in md
    assert "No recommendation: the idle ratio is known for rollout only" in md
    assert "could not be built" not in md and "could not be drawn" not in md
    assert cli("status", str(old), "--once").returncode == 0


@pytest.mark.slow
def test_dropped_samples_are_counted_by_reason(runs, tmp_path):
    """Drops are rare in tiny runs: mark the groups of update 3 as dropped for staleness
    and count 4 groups of damaged shards, as the trainer would have logged them."""
    d = tmp_path / "drops"
    shutil.copytree(runs["s05"], d, ignore=shutil.ignore_patterns("checkpoints", "weights", "samples", "base_model"))
    _rewrite(d / "logs" / "staleness.jsonl.gz", lambda r: {**r, "dropped": "max_staleness" if r["trainer_step"] == 3 else ""})
    _rewrite(d / "logs" / "metrics.jsonl", lambda r: {**r, "fully_async/count/corrupt_groups_skipped": 4 * (r["step"] >= 10)})
    res = cli("report", str(d), "--out", str(tmp_path / "report"))
    assert res.returncode == 0, res.stdout + res.stderr
    tables = parse_report((tmp_path / "report" / "report.md").read_text())
    (drops,) = tables[("Details", "Samples dropped")]
    raw = Raw(d)
    marked = [r for r in raw.st if r["dropped"]]
    assert drops[0] == {"reason": "max_staleness", "groups": str(len({r["group_id"] for r in marked})),
                        "trajectories": str(len(marked)), "source": "logs/staleness.jsonl.gz (dropped)"}
    assert drops[1]["reason"] == "corrupt shard" and drops[1]["groups"] == "4"
    (lag,) = tables[("Details", "Lag")]
    assert sum(int(r["groups"]) for r in lag) == len(raw.groups)  # dropped groups are not in the lag table
    ((summary,),) = tables[("Summary", "")]
    assert summary["dropped groups"] == str(len({r["group_id"] for r in marked}) + 4)


def test_not_a_run_directory_and_a_run_not_started(tmp_path):
    res = cli("report", str(tmp_path), "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "is not an hpcrl run directory" in res.stderr and "Traceback" not in res.stderr
    assert cli("status", str(tmp_path / "nope"), "--once").returncode == 2
    rd = make_run(tmp_path, name="fresh")  # prepared, no job started yet
    res = cli("report", str(rd.root), "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "nothing to analyse yet" in res.stderr
    res = cli("status", str(rd.root), "--once")
    assert res.returncode == 0 and "no heartbeat yet" in res.stdout and "0/300 updates" in res.stdout


def test_a_run_stopped_before_its_first_update_says_why_in_report_and_samples(tmp_path):
    """A run whose model could not be loaded has nothing to report and no sample: both commands name the error
    that stopped it, not only that the logs are empty."""
    from hpcrl.analysis.samples import format_samples
    from hpcrl.control.fatal import write_fatal

    rd = make_run(tmp_path)
    assert format_samples(rd) == (f"no group committed yet in {rd.samples}", False)
    write_fatal(rd, "rollout-w000", "loading the model failed: ValueError: no model_type", "model")
    res = cli("report", str(rd.root), "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and ("(the run stopped before its first update, on an error no restart can fix: "
                                    "rollout-w000: loading the model failed: ValueError: no model_type)") in res.stderr
    assert format_samples(rd) == (f"no group committed yet in {rd.samples}; the run stopped on an error no restart "
                                  "can fix: rollout-w000: loading the model failed: ValueError: no model_type", False)


@pytest.mark.slow
def test_the_zoomed_plots_name_the_versions_they_show(runs, tmp_path, monkeypatch):
    """The timeline's zoom said "5 weight versions" and showed 7 version lines (its margins catch more)."""
    from hpcrl.analysis import plots
    from hpcrl.analysis.load import load_run

    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, out: figures.append(fig) or out)
    data = load_run(runs["s0"])
    plots.timeline(data, tmp_path / "timeline.png")
    plots.throughput(data, tmp_path / "throughput.png")
    zoom = figures[0].axes[1]
    labels = [t.get_text() for t in zoom.texts if re.fullmatch(r"v\d+", t.get_text())]
    said = re.match(r"(\d+) weight versions published \(v(\d+)-v(\d+)\) in the middle of the run", zoom.get_title())
    assert said and int(said.group(1)) == len(labels), (zoom.get_title(), labels)
    assert (labels[0], labels[-1]) == (f"v{said.group(2)}", f"v{said.group(3)}"), labels
    queue = next(a for a in figures[1].axes if a.get_title().startswith("Queue between"))
    assert said.group(0) in queue.get_title(), queue.get_title()


def test_samples_of_a_version_whose_shards_retention_removed_says_so_once_and_exits_1(tmp_path):
    """The trainer removes consumed shards behind its checkpoint (``trainer.keep_consumed_shards``): ``hpcrl samples``
    of an old version said "No trajectory ..." then one "file listed in the manifest is missing" note per shard, and
    exited 0."""
    from hpcrl.samples.reader import delete_consumed
    from hpcrl.samples.writer import ShardWriter
    from test_samples import make_group

    rd = make_run(tmp_path, "trainer.keep_consumed_shards=2")
    writer = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60)
    for i in range(6):
        writer.add(make_group(i, version=i))
        writer.seal()
    writer.close()
    assert delete_consumed(rd, {"w000": {"line": 5, "row": 0}}, keep=2) == 3  # shards of versions 0, 1 and 2
    old = cli("samples", str(rd.root), "--version", "1")
    assert old.returncode == 1 and old.stdout.splitlines() == [
        f"no trajectory sampled with version 1 in {rd.samples}",
        "note: 3 shard files listed in the manifests were removed: the trainer removes the shards behind its checkpoint "
        "and keeps the newest trainer.keep_consumed_shards=2 per writer (-1 keeps every one, for a run whose old "
        "samples you want to read); the oldest version still on disk is v3"], old.stdout
    kept = cli("samples", str(rd.root), "--version", "4")
    assert kept.returncode == 0 and kept.stdout.startswith("version 4: 3 trajectories"), kept.stdout
    assert "removed" not in kept.stdout, "the shards of version 4 and newer are read first: none was missed"
    assert "missing" not in old.stdout + kept.stdout


def test_tail_reader_waits_for_a_torn_line_and_rereads_a_rolled_back_log(tmp_path):
    p = tmp_path / "log.jsonl"
    tail = JsonlTail(p)
    assert tail.poll() == []
    p.write_bytes(b'{"a": 1}\n{"a": 2')
    assert tail.poll() == [{"a": 1}]
    with open(p, "ab") as f:
        f.write(b'}\n')
    assert tail.poll() == [{"a": 1}, {"a": 2}]
    p.write_bytes(b'{"b": 1}\n')  # shorter: a resumed trainer truncated it back to its checkpoint
    assert tail.poll() == [{"b": 1}]


def test_columnar_log_reader_skips_what_a_killed_writer_leaves(tmp_path):
    """read_jsonl_frame: pyarrow's fast path and the line-by-line fallback give the
    same frame and report the same bad lines (by line number)."""
    def read(data: bytes):
        p = tmp_path / "log.jsonl"
        p.write_bytes(data)
        bad = []
        return read_jsonl_frame(p, on_bad_line=lambda n, text: bad.append(n)), bad

    f, bad = read(b'{"a": 1, "reward": 1}\n{"a": 2, "reward": 0}\n{"a": 3, "rew')  # torn last row: fast path
    assert f.a.tolist() == [1, 2] and f.reward.dtype == "float64" and bad == [3]
    f, bad = read(b'{"a": 1}\nnot json\n{"a": 2}\n{"a"')  # a damaged row in the middle: fallback
    assert f.a.tolist() == [1, 2] and bad == [2, 4]
    f, bad = read(b'{"a": NaN}\n{"a": 2.5}\n')  # what json.dumps writes for nan: fallback, kept
    assert np.isnan(f.a[0]) and f.a[1] == 2.5 and bad == []
    f, bad = read(b'{"a": 1}\n' * 70000 + b'{"a": 1.5, "b": "x"}\n')  # a new type and key in a later block
    assert len(f) == 70001 and f.a.iloc[-1] == 1.5 and f.b.iloc[-1] == "x" and f.b.isna().sum() == 70000
    assert read(b"")[0].empty and read(b'{"a"')[0].empty and read(b'{"a"')[1] == [1]
    assert read_jsonl_frame(tmp_path / "missing.jsonl").empty
