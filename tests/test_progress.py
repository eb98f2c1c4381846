"""What hpcrl run prints, from the run directory alone: start-up steps as they begin, one line per new weight
version (never the versions printed before a resume), an ETA from the steady-state speed only, problems
per version, a sampled response every logging.show_samples lines."""
import json
import time

from conftest import make_run
from hpcrl.control.records import Heartbeat
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.launcher.progress import Console, steady_seconds_per_update


def metrics_row(step, t):
    return {"step": step, "param_version": step - 1, "reward/mean": 0.5, "fully_async/lag/mean": 0.0,
            "fully_async/lag/max": 0, "trainer/idle_ratio": 0.1, "throughput/tokens_per_s": 100.0, "time_s": t}


def append(path, rows):
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_eta_is_the_median_time_between_updates_so_start_up_and_restarts_do_not_count():
    t = [1000.0 + i for i in range(10)] + [2000.0 + i for i in range(10)]  # a 990 s stop between 10 and 11
    rows = [metrics_row(i + 1, x) for i, x in enumerate(t)]
    assert steady_seconds_per_update(rows) == 1.0
    assert steady_seconds_per_update(rows[:1]) is None


def test_a_resumed_session_prints_only_new_versions_with_an_eta_at_once(tmp_path):
    rd = make_run(tmp_path, "logging.show_samples=0")
    append(rd.metrics, [metrics_row(s, 1000.0 + 2 * s) for s in range(1, 11)])
    lines = []
    console = Console(rd, rd.load_config(), lines.append, resume=True)
    console.poll()
    assert lines == [], "the versions of the earlier session are not printed again"
    append(rd.metrics, [metrics_row(11, 5000.0)])
    console.poll()
    assert len(lines) == 1 and lines[0].startswith("v11   step    11/300") and "eta 9m38s" in lines[0], lines


def test_problems_and_samples_on_the_version_lines(tmp_path):
    rd = make_run(tmp_path, "logging.show_samples=2")
    lines = []
    console = Console(rd, rd.load_config(), lines.append, resume=False)
    ro = rd.rollout_metrics("w000")
    append(ro, [{"writer": "w000", "param_version": 0, "rollouter/idle_ratio": 0.2, "reward/errors": 3,
                 "reward/first_error": "w000/7/2: ZeroDivisionError: division by zero", "tool_calls/errors": 0,
                 "data/prompts_filtered": 5, "sample/id": "w000/7/0", "sample/prompt": "repeat c",
                 "sample/response": "c c c", "sample/reward": 0.375}])
    append(rd.metrics, [metrics_row(1, 1000.0)])
    console.poll()
    append(ro, [{"writer": "w000", "param_version": 1, "rollouter/idle_ratio": 0.2, "reward/errors": 2}])
    append(rd.metrics, [metrics_row(2, 1001.0), metrics_row(3, 1002.0)])
    console.poll()
    assert "reward errors 3 (first: w000/7/2: ZeroDivisionError: division by zero)" in lines[0], lines[0]
    assert "5 prompts filtered" in lines[0] and "eta ?" in lines[0]
    assert lines[1] == "  sample w000/7/0 (v0, reward 0.375): 'repeat c' -> 'c c c'", lines[1]
    assert lines[2].endswith("| reward errors 2"), "the first message is said once"
    assert "prompts filtered" not in lines[3] and "sample" in lines[4], lines


def test_a_large_fleets_idle_ratios_are_summed_up_and_its_logs_not_read_every_poll(tmp_path, monkeypatch):
    """Up to four rollout jobs a version line shows each one's idle ratio; a fleet of 768 would have printed 768
    numbers per line and read 768 logs every poll: above four the line shows their mean, min and max, and the logs
    are read every ``jobs / ROLLOUT_LOGS_PER_S`` seconds (every one of them still at the end)."""
    from hpcrl.launcher import progress

    monkeypatch.setattr(progress, "ROLLOUT_LOGS_PER_S", 1 / 60)  # each log read again a minute later
    rd = make_run(tmp_path, "logging.show_samples=0")
    writers = [f"w{i:03d}" for i in range(6)]
    for i, w in enumerate(writers[:2]):
        append(rd.rollout_metrics(w), [{"writer": w, "param_version": 0, "rollouter/idle_ratio": 0.1 * (i + 1)}])
    lines = []
    console = Console(rd, rd.load_config(), lines.append, resume=False)
    append(rd.metrics, [metrics_row(1, 1000.0)])
    console.poll()
    assert "idle trainer 0.10 rollout 0.10/0.20  tokens/s" in lines[-1], lines[-1]
    for i, w in enumerate(writers[2:], start=2):
        append(rd.rollout_metrics(w), [{"writer": w, "param_version": 0, "rollouter/idle_ratio": 0.1 * (i + 1)}])
    append(rd.metrics, [metrics_row(2, 1001.0)])
    console.poll()
    assert "rollout 0.10/0.20  tokens/s" in lines[-1], "read at the first poll; the next read is not due yet"
    console._rollout_due_s = 0.0  # due now
    append(rd.metrics, [metrics_row(3, 1002.0)])
    console.poll()
    assert "idle trainer 0.10 rollout 0.35 (mean of 6, 0.10-0.60)  tokens/s" in lines[-1], lines[-1]
    append(rd.rollout_metrics("w005"), [{"writer": "w005", "param_version": 1, "rollouter/idle_ratio": 0.0,
                                         "reward/errors": 4}])
    append(rd.metrics, [metrics_row(4, 1003.0)])
    console.close()
    assert lines[-1].startswith("v4 ") and "rollout 0.25 (mean of 6, 0.00-0.50)" in lines[-1], lines[-1]
    assert "reward errors 4" in lines[-1], "the last line reads every log"


def test_the_first_start_says_what_each_job_waits_for(tmp_path):
    rd = make_run(tmp_path)
    lines = []
    console = Console(rd, rd.load_config(), lines.append, resume=False)
    console.poll()
    now = time.time()
    write_json_atomic(rd.heartbeat("trainer"), Heartbeat("trainer", "trainer", "h", 1, now, state="starting",
                                                         step="building DeepSpeed's ops", step_started_s=now - 12).to_json())
    console.poll()
    console.poll()
    assert lines == ["  trainer: building DeepSpeed's ops (12s)"], lines


def test_on_a_terminal_a_bar_sits_under_the_lines(tmp_path, capsys):
    rd = make_run(tmp_path, "logging.show_samples=0")
    lines = []
    console = Console(rd, rd.load_config(), lines.append, resume=False, bar=True)
    append(rd.metrics, [metrics_row(1, 1000.0), metrics_row(2, 1001.0)])
    console.poll()
    console.close()
    err = capsys.readouterr()
    assert lines == [], "lines go above the bar (tqdm.write), not through emit"
    assert "v2    step     2/300" in err.out and "2/300 updates" in err.err and "eta 4m58s" in err.err, err
