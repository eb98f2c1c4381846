"""Weight exchange through files: atomic versions, verified loads, damaged versions marked and
skipped, retention that respects readers and keeps an intact version."""
import json
import time

import pytest
import torch
from safetensors.torch import load_file

from hpcrl.config import WeightsConfig
from hpcrl.control.records import HeartbeatThread, LoadingAnnouncement
from hpcrl.fsio import write_json_atomic
from hpcrl.run_dir import WEIGHT_TENSORS, RunDir
from hpcrl.weights import WeightVersionBad, make_transport
from hpcrl.weights.filesystem import FilesystemTransport


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g),
            "c.half": torch.randn(7, generator=g).to(torch.bfloat16), "d.steps": torch.arange(3)}


def transport(tmp_path, keep_versions: int = 3) -> FilesystemTransport:
    return make_transport(WeightsConfig(keep_versions=keep_versions), RunDir(tmp_path).create())


def test_publish_then_load_roundtrip(tmp_path):
    wt = transport(tmp_path)
    sd = state(0)
    m = wt.publish(0, sd, json.dumps({"model_type": "x"}), trainer_step=0, consumed_groups=0)
    assert wt.newest_usable() == 0 and m.total_bytes > 0
    assert m.files[WEIGHT_TENSORS].hash_algorithm == "xxh3_128" and m.files[WEIGHT_TENSORS].hash_hex
    manifest, loaded = wt.load(0, writer="w000")
    assert manifest.param_version == 0 and manifest.files == m.files
    for k in sd:
        torch.testing.assert_close(loaded[k], sd[k])
    ann = json.loads(wt.run_dir.loading_announcement("w000").read_text())
    assert ann["state"] == "loaded" and ann["version"] == 0


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
    m = wt.publish(0, sd, "{}", 0, 0)
    assert m.aliases == {"lm_head.weight": "embed.weight"}
    _, loaded = wt.load(0, "w000")
    torch.testing.assert_close(loaded["lm_head.weight"], emb)


def test_version_without_manifest_does_not_exist(tmp_path):
    wt = transport(tmp_path)
    wt.publish(0, state(0), "{}", 0, 0)
    wt.publish(1, state(1), "{}", 1, 4)
    wt.run_dir.weight_manifest(1).unlink()  # as if the trainer died before its commit point
    wt.run_dir.staging(wt.run_dir.weight_version_dir(2)).mkdir()  # died before the rename
    assert wt.published_versions() == [0] and wt.newest_usable() == 0


def damage_weights(rd: RunDir, version: int, how: str) -> None:
    """Damage version `version` as seen in the field: truncated file, flipped header or data bytes, bad manifest."""
    f = rd.weight_file(version, WEIGHT_TENSORS)
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
    applied = []
    with pytest.raises(WeightVersionBad, match="version 1"):
        wt.load(1, "w000", apply=lambda s, _dir: applied.append(s))
    assert applied == [], "a damaged version must never reach the engine"
    assert wt.is_bad(1) and wt.run_dir.weight_bad_marker(1).is_file()
    assert json.loads(wt.run_dir.loading_announcement("w000").read_text())["state"] != "loading"
    # another reader (a new process) sees the marker and never tries it
    other = transport(tmp_path)
    assert other.newest_usable() == 0
    m = other.load_newest("w001", apply=lambda s, _dir: applied.append(s))
    assert m.param_version == 0 and len(applied) == 1
    torch.testing.assert_close(applied[0]["a.weight"], state(0)["a.weight"])


def test_load_newest_falls_back_past_damage_it_finds_itself(tmp_path, caplog):
    wt = transport(tmp_path)
    for v in range(3):
        wt.publish(v, state(v), "{}", v, 4 * v)
    damage_weights(wt.run_dir, 2, "data")
    m = wt.load_newest("w000")
    assert m.param_version == 1 and wt.is_bad(2)
    assert "weight version 2" in caplog.text and "damaged" in caplog.text
    damage_weights(wt.run_dir, 1, "truncated")
    damage_weights(wt.run_dir, 0, "truncated")
    assert wt.load_newest("w000") is None  # nothing usable left: the caller waits for a new version


def test_unhashed_version_still_has_its_size_checked(tmp_path):
    wt = FilesystemTransport(RunDir(tmp_path).create(), keep_versions=2, checksum=False)
    wt.publish(0, state(0), "{}", 0, 0)
    damage_weights(wt.run_dir, 0, "truncated")
    with pytest.raises(WeightVersionBad, match="torn"):
        wt.load(0, "w000")


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
    _, loaded = wt.load(1, "w000")  # the pinned version is still whole
    torch.testing.assert_close(loaded["a.weight"], state(1)["a.weight"])


def test_retention_never_deletes_the_last_intact_version(tmp_path):
    wt = transport(tmp_path, keep_versions=2)
    for v in range(5):
        wt.publish(v, state(v), "{}", v, 4 * v)
    for v in (3, 4):
        wt.mark_bad(v, "w000", "test")
    assert sorted(wt.retain(heartbeat_stale_s=5)) == [0, 1]
    assert wt.published_versions() == [2, 3, 4] and wt.newest_usable() == 2


def test_withdraw_after_removes_newer_versions_and_their_markers(tmp_path):
    wt = transport(tmp_path)
    for v in range(4):
        wt.publish(v, state(v), "{}", v, 4 * v)
    wt.mark_bad(3, "w000", "test")
    assert wt.withdraw_after(1) == [2, 3]
    assert wt.published_versions() == [0, 1]
    wt.publish(3, state(9), "{}", 3, 12)  # the restarted trainer publishes v3 again: a new, intact version
    assert wt.newest_usable() == 3, "a reader that marked the old v3 bad must load the new one"


def test_weights_package_imports_only_lower_layers():
    """hpcrl/weights/ sits below the jobs: it may use config, fsio, run_dir and control only."""
    import ast
    from pathlib import Path

    import hpcrl.weights

    forbidden = ("hpcrl.trainer", "hpcrl.rollout", "hpcrl.launcher", "hpcrl.analysis")
    for path in Path(hpcrl.weights.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.startswith(forbidden)]
            assert not bad, f"{path.name} imports {bad}: hpcrl/weights/ must not depend on the jobs"
