"""Weight exchange through files: atomic versions, verified loads, damaged versions marked and
skipped, retention that respects readers and keeps an intact version."""
import json
import time

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.config import WeightsConfig
from hpcrl.control.records import HeartbeatThread, LoadingAnnouncement
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.rundir.paths import WEIGHT_TENSORS, RunDir
from hpcrl.weights import WeightVersionBad, make_publisher, make_subscriber
from hpcrl.weights.folders import VersionFolders
from hpcrl.weights.publisher import WeightPublisher


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g),
            "c.half": torch.randn(7, generator=g).to(torch.bfloat16), "d.steps": torch.arange(3)}


def transport(tmp_path, keep_versions: int = 3) -> WeightPublisher:
    """The trainer's side of a files-only run in ``tmp_path``."""
    return make_publisher(WeightsConfig(keep_versions=keep_versions), RunDir(tmp_path).create())


def reader(wt, name: str = "w000"):
    """A subscriber of the same run (a rollout job named ``name``)."""
    return make_subscriber(WeightsConfig(), wt.run_dir, name)


def test_publish_then_take_roundtrip_pins_while_taken(tmp_path):
    wt = transport(tmp_path)
    sd = state(0)
    m = wt.publish(0, sd, json.dumps({"model_type": "x"}), trainer_step=0, consumed_groups=0).manifest
    sub = reader(wt)
    assert sub.newest_usable() == 0 and m.total_bytes > 0
    assert m.files[WEIGHT_TENSORS].hash_algorithm == "xxh3_128" and m.files[WEIGHT_TENSORS].hash_hex
    pin = wt.run_dir.loading_announcement("w000")
    with sub.take(0) as wv:
        assert wv.manifest.param_version == 0 and wv.manifest.files == m.files and wv.path == "filesystem"
        assert wv.folder == wt.run_dir.weight_version_dir(0) and wv.mapped is None and wv.nbytes == m.total_bytes
        for k in sd:
            torch.testing.assert_close(wv.tensors[k], sd[k])
        assert json.loads(pin.read_text())["state"] == "loading", "pinned while the caller holds it"
    ann = json.loads(pin.read_text())
    assert ann["state"] == "loaded" and ann["version"] == 0
    assert set(wv.metrics(apply_s=0.5)) >= {"weights/path", "timing_s/load_weights/transfer", "weights/bytes"}


def test_written_file_is_a_safetensors_file(tmp_path):
    """vLLM and HF read the folder with safetensors itself: our streaming writer must stay compatible."""
    wt = transport(tmp_path)
    sd = state(1)
    wt.publish(0, sd, "{}", 0, 0)
    theirs = load_file(str(wt.run_dir.weight_file(0, WEIGHT_TENSORS)))
    assert set(theirs) == set(sd)
    for k in sd:
        torch.testing.assert_close(theirs[k], sd[k])


def test_tied_tensors_roundtrip(tmp_path):
    wt = transport(tmp_path)
    emb = torch.randn(8, 4)
    sd = {"embed.weight": emb, "lm_head.weight": emb}  # tied embeddings share storage
    m = wt.publish(0, sd, "{}", 0, 0).manifest
    assert m.aliases == {"lm_head.weight": "embed.weight"}
    loaded = reader(wt).load(0).tensors
    torch.testing.assert_close(loaded["lm_head.weight"], emb)


def test_version_without_manifest_does_not_exist(tmp_path):
    wt = transport(tmp_path)
    wt.publish(0, state(0), "{}", 0, 0)
    wt.publish(1, state(1), "{}", 1, 4)
    wt.run_dir.weight_manifest(1).unlink()  # as if the trainer died before its commit point
    wt.run_dir.staging(wt.run_dir.weight_version_dir(2)).mkdir()  # died before the rename
    assert wt.published_versions() == [0] and reader(wt).newest_usable() == 0


def damage_weights(rd: RunDir, version: int, how: str, name: str = WEIGHT_TENSORS) -> None:
    """Damage version `version` as seen in the field: truncated file, flipped header or data bytes, bad manifest
    (``name``: the version's tensor file, ``model.delta`` for a delta version)."""
    f = rd.weight_file(version, name)
    data = bytearray(f.read_bytes())
    if how == "truncated":
        del data[-10:]
    elif how == "header":
        data[10] ^= 0xFF  # inside the JSON header
    elif how == "data":
        data[-3] ^= 0x01  # one bit of tensor data: safetensors itself loads this without complaint
    elif how == "manifest":
        rd.weight_manifest(version).write_text('{"param_version": ')
        return
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "header", "data", "manifest"])
def test_damaged_version_is_marked_bad_and_the_newest_intact_one_is_loaded(tmp_path, how):
    wt = transport(tmp_path)
    wt.publish(0, state(0), "{}", 0, 0)
    wt.publish(1, state(1), "{}", 1, 4)
    damage_weights(wt.run_dir, 1, how)
    with pytest.raises(WeightVersionBad, match="version 1"):
        reader(wt).take(1)  # a damaged version never reaches the caller
    assert wt.is_bad(1) and wt.run_dir.weight_bad_marker(1).is_file()
    assert json.loads(wt.run_dir.loading_announcement("w000").read_text())["state"] != "loading"
    # another reader (a new process) sees the marker and never tries it
    other = reader(wt, "w001")
    assert other.newest_usable() == 0
    with other.take_newest() as wv:
        assert wv.version == 0
        torch.testing.assert_close(wv.tensors["a.weight"], state(0)["a.weight"])


def test_load_newest_falls_back_past_damage_it_finds_itself(tmp_path, caplog):
    wt = transport(tmp_path)
    for v in range(3):
        wt.publish(v, state(v), "{}", v, 4 * v)
    damage_weights(wt.run_dir, 2, "data")
    sub = reader(wt)
    with sub.take_newest() as wv:
        assert wv.version == 1 and wt.is_bad(2)
    assert "weight version 2" in caplog.text and "damaged" in caplog.text
    damage_weights(wt.run_dir, 1, "truncated")
    damage_weights(wt.run_dir, 0, "truncated")
    assert sub.take_newest() is None  # nothing usable left: the caller waits for a new version


def test_unhashed_version_still_has_its_size_checked(tmp_path):
    wt = WeightPublisher(RunDir(tmp_path).create(), keep_versions=2, checksum=False)
    wt.publish(0, state(0), "{}", 0, 0)
    damage_weights(wt.run_dir, 0, "truncated")
    with pytest.raises(WeightVersionBad, match="torn"):
        reader(wt).take(0)


def test_retention_keeps_newest_and_what_a_live_job_is_loading(tmp_path):
    wt = transport(tmp_path, keep_versions=2)
    rd = wt.run_dir
    for v in range(6):
        wt.publish(v, state(v), "{}", v, 4 * v)
    hb = HeartbeatThread(rd, "rollout-w000", "rollout", interval_s=0.2).start()  # a live rollout job
    write_json_atomic(rd.loading_announcement("w000"), LoadingAnnouncement("w000", 1, "loading", time.time()).to_json())
    # a dead job's announcement (no fresh heartbeat) must not pin anything
    write_json_atomic(rd.loading_announcement("w001"), LoadingAnnouncement("w001", 2, "loading", time.time()).to_json())
    deleted = wt.retain(heartbeat_stale_s=5)
    hb.stop("done")
    assert sorted(deleted) == [0, 2, 3]
    assert wt.published_versions() == [1, 4, 5]
    loaded = reader(wt).load(1).tensors  # the pinned version is still whole
    torch.testing.assert_close(loaded["a.weight"], state(1)["a.weight"])


def test_retention_never_deletes_the_last_intact_version(tmp_path):
    wt = transport(tmp_path, keep_versions=2)
    for v in range(5):
        wt.publish(v, state(v), "{}", v, 4 * v)
    for v in (3, 4):
        VersionFolders(wt.run_dir).mark_bad(v, "w000", "test")
    assert sorted(wt.retain(heartbeat_stale_s=5)) == [0, 1]
    assert wt.published_versions() == [2, 3, 4] and reader(wt).newest_usable() == 2


def test_withdraw_after_removes_newer_versions_and_their_markers(tmp_path):
    wt = transport(tmp_path)
    for v in range(4):
        wt.publish(v, state(v), "{}", v, 4 * v)
    sub = reader(wt)
    with pytest.raises(WeightVersionBad):
        damage_weights(wt.run_dir, 3, "data")
        sub.take(3)
    assert wt.withdraw_after(1) == [2, 3]
    assert wt.published_versions() == [0, 1]
    wt.publish(3, state(9), "{}", 3, 12)  # the restarted trainer publishes v3 again: a new, intact version
    assert sub.newest_usable() == 3, "a reader that marked the old v3 bad must load the new one"


def test_a_reader_that_is_neither_job_follows_versions_with_the_subscriber_alone(tmp_path):
    """An evaluation job (reader ``eval``) follows the versions with nothing but a subscriber; while it
    holds a version with a live heartbeat, retention keeps it; released, it may go."""
    wt = transport(tmp_path, keep_versions=2)
    rd = wt.run_dir
    for v in range(2):
        wt.publish(v, state(v), "{}", v, 4 * v)
    ev = make_subscriber(WeightsConfig(), RunDir(rd.root), "eval")
    hb = HeartbeatThread(rd, "eval", "eval", interval_s=0.2).start()
    try:
        seen = []
        with ev.take(ev.newest_usable()) as held:
            for v in range(2, 5):
                wt.publish(v, state(v), "{}", v, 4 * v)
                wt.retain(heartbeat_stale_s=5)
            assert held.version == 1 and 1 in wt.published_versions(), "pinned by a live reader"
            torch.testing.assert_close(held.tensors["a.weight"], state(1)["a.weight"])
        for v in ev.published_versions():
            seen.append(ev.load(v).version)
        assert seen == [1, 3, 4]
        wt.retain(heartbeat_stale_s=5)
        assert wt.published_versions() == [3, 4], "released: retention may delete it"
    finally:
        hb.stop("done")
