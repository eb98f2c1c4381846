"""Weight exchange through files: atomic versions, verified loads, retention that respects readers."""
import json
import time

import pytest
import torch

from hpcrl.control.records import HeartbeatThread, LoadingAnnouncement
from hpcrl.fsio import write_json_atomic
from hpcrl.run_dir import RunDir
from hpcrl.weights.filesystem import (apply_retention, load_version, newest_version, publish_version,
                                      published_versions)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}


def test_publish_then_load_roundtrip(tmp_path):
    rd = RunDir(tmp_path).create()
    sd = state(0)
    m = publish_version(rd, 0, sd, json.dumps({"model_type": "x"}), trainer_step=0, consumed_groups=0)
    assert newest_version(rd) == 0 and m.total_bytes > 0
    manifest, loaded = load_version(rd, 0, writer="w000", verify_checksum=True)
    assert manifest.param_version == 0
    for k in sd:
        torch.testing.assert_close(loaded[k], sd[k])
    ann = json.loads(rd.loading_announcement("w000").read_text())
    assert ann["state"] == "loaded" and ann["version"] == 0


def test_tied_tensors_roundtrip(tmp_path):
    rd = RunDir(tmp_path).create()
    emb = torch.randn(8, 4)
    sd = {"embed.weight": emb, "lm_head.weight": emb}  # tied embeddings share storage
    m = publish_version(rd, 0, sd, "{}", 0, 0)
    assert m.aliases == {"lm_head.weight": "embed.weight"}
    _, loaded = load_version(rd, 0, "w000")
    torch.testing.assert_close(loaded["lm_head.weight"], emb)


def test_version_without_manifest_does_not_exist(tmp_path):
    rd = RunDir(tmp_path).create()
    publish_version(rd, 0, state(0), "{}", 0, 0)
    publish_version(rd, 1, state(1), "{}", 1, 4)
    (rd.weight_version_dir(1) / "manifest.json").unlink()  # as if the trainer died before its commit point
    (rd.weights / "v000002.tmp").mkdir()                     # died before the rename
    assert published_versions(rd) == [0] and newest_version(rd) == 0


def test_torn_weight_file_is_refused(tmp_path):
    rd = RunDir(tmp_path).create()
    publish_version(rd, 0, state(0), "{}", 0, 0)
    f = rd.weight_version_dir(0) / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(OSError, match="torn"):
        load_version(rd, 0, "w000")


def test_retention_keeps_newest_and_what_a_live_job_is_loading(tmp_path):
    rd = RunDir(tmp_path).create()
    for v in range(6):
        publish_version(rd, v, state(v), "{}", v, 4 * v)
    hb = HeartbeatThread(rd, "rollout-w000", "rollout", interval_s=0.2).start()  # a live rollout job
    write_json_atomic(rd.loading_announcement("w000"), LoadingAnnouncement("w000", 1, "loading", time.time()).to_json())
    # a dead job's announcement (no fresh heartbeat) must not pin anything
    write_json_atomic(rd.loading_announcement("w001"), LoadingAnnouncement("w001", 2, "loading", time.time()).to_json())
    deleted = apply_retention(rd, keep_versions=2, heartbeat_stale_s=5)
    hb.stop("done")
    assert sorted(deleted) == [0, 2, 3]
    assert published_versions(rd) == [1, 4, 5]
    _, loaded = load_version(rd, 1, "w000")  # the pinned version is still whole
    torch.testing.assert_close(loaded["a.weight"], state(1)["a.weight"])
