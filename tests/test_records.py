"""Records that cross a job boundary are checked by type when read (hpcrl/rundir/json_record.py): anything
that is not the record is a RecordError naming the record and the field, never a crash deep inside."""
import json
from dataclasses import dataclass, field
from typing import Optional

import pytest

from hpcrl.control.records import Heartbeat, TrainerDone, read_heartbeats, read_trainer_done
from hpcrl.rundir.json_record import JsonRecord, RecordError
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.manifest import WeightManifest


@dataclass
class Inner(JsonRecord):
    name: str
    size: int


@dataclass
class Outer(JsonRecord):
    version: int
    rate: float
    inner: list[Inner]
    by_name: dict[str, int] = field(default_factory=dict)
    note: Optional[str] = None


GOOD = {"version": 3, "rate": 2, "inner": [{"name": "a", "size": 1}], "by_name": {"x": 1}, "note": None}


def test_a_good_record_round_trips_and_ints_widen_to_floats():
    rec = Outer.from_json(GOOD)
    assert rec.inner == [Inner("a", 1)] and rec.rate == 2.0 and isinstance(rec.rate, float)
    assert Outer.from_json(rec.to_json()) == rec
    assert Outer.from_json({**GOOD, "written_by_a_newer_job": 1}) == rec, "unknown fields are ignored"


@pytest.mark.parametrize("value, message", [
    (None, "expected a JSON object, got null"),
    ([], "expected a JSON object, got list"),
    ({**GOOD, "version": None}, "Outer.version: expected int, got null"),
    ({**GOOD, "version": True}, "Outer.version: expected int, got bool"),
    ({**GOOD, "version": "3"}, "Outer.version: expected int, got str"),
    ({**GOOD, "inner": {"name": "a"}}, "Outer.inner: expected a list"),
    ({**GOOD, "inner": [{"name": "a"}]}, r"Outer.inner\[0\]: field 'size' is missing"),
    ({**GOOD, "by_name": {"x": "1"}}, "Outer.by_name.x: expected int"),
    ({k: v for k, v in GOOD.items() if k != "rate"}, "field 'rate' is missing"),
])
def test_anything_else_is_refused_naming_the_field(value, message):
    with pytest.raises(RecordError, match=message):
        Outer.from_json(value)


def test_a_manifest_of_the_wrong_shape_is_refused():
    with pytest.raises(RecordError, match="WeightManifest.files"):
        WeightManifest.from_json({"param_version": 0, "trainer_step": 0, "consumed_groups": 0, "files": [],
                                  "tensors": [], "total_bytes": 0, "published_s": 0.0})


def test_readers_leave_out_heartbeats_that_are_not_records_and_trust_no_malformed_trainer_done(tmp_path):
    rd = RunDir(tmp_path).create()
    rd.heartbeats.mkdir(parents=True, exist_ok=True)
    good = Heartbeat(job="trainer", role="trainer", host="h", pid=1, time_s=1.0)
    rd.heartbeat("trainer").write_text(json.dumps(good.to_json()))
    for i, text in enumerate(["null", "[]", '{"job": "x"}', '{"job": "y", "role": "r", "host": "h", "pid": "1", '
                                                            '"time_s": 1}']):
        (rd.heartbeats / f"bad{i}.json").write_text(text)
    assert list(read_heartbeats(rd)) == ["trainer"]
    assert read_trainer_done(rd) is None
    rd.trainer_done.write_text("[]")
    assert read_trainer_done(rd) is None
    rd.trainer_done.write_text(json.dumps(TrainerDone(3, 1, 12, 5.0).to_json()))
    assert read_trainer_done(rd).consumed_groups == 12


def test_a_skipped_shard_record_of_the_wrong_shape_is_named_and_ignored(tmp_path, caplog):
    from hpcrl.samples.skips import SkipLog, SkippedShard

    rd = RunDir(tmp_path).create()
    good = SkippedShard("w000", "shard-000001.h5", [3, 5], 2, "truncated", 1.0)
    rd.skipped_shards.write_text("null\n" + json.dumps({**good.to_json(), "prompt_indices": "3,5"}) + "\n"
                                 + json.dumps(good.to_json()) + "\n")
    log = SkipLog(rd)
    assert [r.shard for r in log.poll()] == ["shard-000001.h5"] and log.skipped_groups() == 2
    assert "SkippedShard.prompt_indices: expected a list" in caplog.text and str(rd.skipped_shards) in caplog.text


def test_two_threads_rewriting_one_record_never_trip_over_each_other(tmp_path):
    """A job's start-up steps rewrite its heartbeat while the beat thread does (seen: a rename of the other
    thread's temp file failed and the rollout job died)."""
    import threading

    from hpcrl.rundir.fsio import write_json_atomic

    path, errors = tmp_path / "beat.json", []

    def writer(k: int) -> None:
        try:
            for i in range(300):
                write_json_atomic(path, {"writer": k, "i": i})
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and json.loads(path.read_text())["i"] == 299
    assert not list(tmp_path.glob("beat.json.tmp*")), "no temp file left behind"


@pytest.mark.parametrize("text", ["null", "[]", '{"started": {"w000": "3"}}', "{torn"])
def test_a_damaged_admission_record_is_set_aside_and_rebuilt_from_the_manifests(tmp_path, caplog, text):
    """Every writer reads it at start: a crash there would be a crash loop of the whole fleet."""
    from hpcrl.control.admission import Admission

    rd = RunDir(tmp_path).create()
    for w, groups in (("w000", [2, 3]), ("w001", [4])):
        rd.writer_dir(w).mkdir(parents=True)
        rd.shard_manifest(w).write_text("".join(json.dumps({"n_groups": g}) + "\n" for g in groups))
    rd.admission.parent.mkdir(parents=True, exist_ok=True)
    rd.admission.write_text(text)
    adm = Admission(rd, "w001", budget=8)
    adm.join(4, set())
    assert json.loads(rd.admission.read_text())["started"] == {"w000": 5, "w001": 4}
    assert "was damaged" in caplog.text and list(rd.admission.parent.glob(rd.admission.name + ".damaged-*"))
    assert adm.try_start(consumed_groups_at_version=0) is None, "9 started >= 0 + 8: the rebuilt count holds"


def test_a_heartbeats_counters_are_a_typed_record_each_job_writing_its_own_fields(tmp_path):
    """JobStats: written and read through the type; a kind's JSON holds only its fields; a wrong type is named."""
    from hpcrl.analysis.status import JobView, _eval_detail
    from hpcrl.control.records import HeartbeatThread, JobStats

    rd = RunDir(tmp_path).create()
    beats = {"trainer": JobStats(step=3, consumed_groups=12, reward_mean=0.25, idle_ratio=0.4),
             "rollout-w000": JobStats(groups_committed=7),
             "eval": JobStats(last_version=3, score=0.5, score_name="val-core/toy/reward/mean@1", evaluating=5,
                              prompts_done=2, prompts=8, skipped=0)}
    for job, stats in beats.items():
        hb = HeartbeatThread(rd, job, job.split("-")[0], 60.0)
        hb.update(stats=stats)
        hb.write()
    on_disk = {job: json.loads(rd.heartbeat(job).read_text())["stats"] for job in beats}
    assert on_disk["rollout-w000"] == {"groups_committed": 7}, "a kind's beat holds only its own counters"
    assert set(on_disk["trainer"]) == {"step", "consumed_groups", "reward_mean", "idle_ratio"}
    assert {job: b.stats for job, b in read_heartbeats(rd).items()} == beats
    view = lambda st: JobView("eval", "evaluating", 3, 1.0, "h", 1, stats=st)  # noqa: E731
    assert _eval_detail(view(beats["eval"])) == "last v3 0.500; evaluating v5 (2/8 prompts)"
    older = JobStats.from_json({"last_version": -1, "score": None, "score_name": "", "evaluating": -1,
                                "prompts_done": 0, "prompts": 8, "skipped": 0})  # an older hpcrl's eval beat
    assert older.evaluating_now is None and _eval_detail(view(older)) == "nothing evaluated yet"
    with pytest.raises(RecordError, match=r"Heartbeat\.stats\.groups_committed: expected int"):
        Heartbeat.from_json({**json.loads(rd.heartbeat("rollout-w000").read_text()),
                             "stats": {"groups_committed": "seven"}})


def test_no_job_spells_heartbeat_counters_as_a_dict():
    """Writers pass a JobStats (``stats={...}`` with a dict is the untyped record this replaced); readers take its
    fields (``.stats[...]``, ``.stats.get(...)`` read a dict)."""
    import ast
    from pathlib import Path

    def dict_stats(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "stats" and (
                    isinstance(node.value, ast.Dict)
                    or isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "dict"):
                yield node.value.lineno
            if isinstance(node, (ast.Subscript, ast.Attribute)) and getattr(node.value, "attr", "") == "stats" \
                    and (isinstance(node, ast.Subscript) or node.attr == "get"):
                yield node.lineno

    assert list(dict_stats(ast.parse('hb.update(stats={"groups_committed": 3})\nx = beat.stats.get("score")')))
    root = Path(__file__).resolve().parents[1]
    found = [f"{p.relative_to(root)}:{line}" for p in sorted((root / "hpcrl").rglob("*.py"))
             for line in dict_stats(ast.parse(p.read_text()))]
    assert not found, "heartbeat counters as a dict; use hpcrl.control.records.JobStats:\n" + "\n".join(found)
