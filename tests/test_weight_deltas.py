"""Delta weight versions (``weights.delta``): a version written as its changes against a full base, rebuilt
and verified by readers; what happens when the delta, its base or the trainer writing it fails."""
import json

import pytest
import torch

from conftest import TINY
from hpcrl.analysis.export import export
from hpcrl.config import WeightsConfig, load_config
from hpcrl.process import faults
from hpcrl.rundir.paths import WEIGHT_DELTA, WEIGHT_TENSORS, RunDir
from hpcrl.weights import WeightVersionBad, make_publisher, make_subscriber
from hpcrl.weights.delta import decode_into, encode
from hpcrl.weights.publisher import WeightPublisher
from test_weights import damage_weights


def base_state() -> dict:
    g = torch.Generator().manual_seed(0)
    emb = (torch.randn(64, 16, generator=g) * 0.02).to(torch.bfloat16)
    return {"embed.weight": emb, "lm_head.weight": emb,  # tied: stored once, an alias in the manifest
            "mlp.weight": (torch.randn(32, 16, generator=g) * 0.02).to(torch.bfloat16),
            "norm.weight": torch.ones(16), "steps": torch.arange(3)}


def step(sd: dict, k: int) -> dict:
    """``sd`` after ``k`` small updates: a few bf16 values of each matrix change (a copy; ties kept)."""
    out = {n: t.clone() for n, t in sd.items() if n != "lm_head.weight"}
    for n in ("embed.weight", "mlp.weight"):
        flat = out[n].view(-1)
        flat[k::97] += 0.01
    out["norm.weight"][k % 16] += 1e-3
    out["lm_head.weight"] = out["embed.weight"]
    return out


def publisher(tmp_path, **cfg) -> WeightPublisher:
    return make_publisher(WeightsConfig(**cfg), RunDir(tmp_path).create())


def reader(wt, name: str = "w000"):
    return make_subscriber(WeightsConfig(), wt.run_dir, name)


def publish_chain(wt, n: int) -> list[dict]:
    """Versions 0..n-1 of a slowly changing model; their state dicts."""
    sds, sd = [], base_state()
    for v in range(n):
        sds.append(sd)
        wt.publish(v, sd, json.dumps({"model_type": "x"}), trainer_step=v, consumed_groups=4 * v)
        sd = step(sd, v)
    return sds


def assert_same(tensors: dict, sd: dict) -> None:
    assert set(tensors) == set(sd)
    for k, t in sd.items():
        assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t), k


def test_codec_is_exact_for_every_dtype():
    for t in (torch.randn(5, 7).to(torch.bfloat16), torch.randn(9), torch.randn(4).half(), torch.arange(6),
              torch.tensor([float("nan"), -0.0, float("inf")]), torch.tensor([True, False])):
        new = t.clone()
        new.view(-1)[0] = new.view(-1)[-1]
        frame, _ = encode(t, new)
        out = torch.empty_like(t)
        decode_into(t, memoryview(frame), out)
        assert torch.equal(out.view(torch.uint8) if t.dtype == torch.bool else out.view(-1).view(torch.uint8),
                           new.view(torch.uint8) if t.dtype == torch.bool else new.view(-1).view(torch.uint8))


def test_versions_between_full_ones_are_deltas_that_readers_rebuild_exactly(tmp_path):
    wt = publisher(tmp_path, full_every=3)
    sds = publish_chain(wt, 5)
    rd = wt.run_dir
    kinds = [json.loads(rd.weight_manifest(v).read_text())["base"] for v in range(5)]
    assert [k and k["version"] for k in kinds] == [None, 0, 0, None, 3], "full every 3 versions, deltas between"
    assert rd.weight_file(1, WEIGHT_DELTA).is_file() and not rd.weight_file(1, WEIGHT_TENSORS).exists()
    full, delta = (json.loads(rd.weight_manifest(v).read_text())["total_bytes"] for v in (0, 1))
    assert delta < full / 2
    fresh, follower = reader(wt, "w000"), reader(wt, "w001")
    follower.load(0)  # holds v0 in memory from here on
    for v in (1, 2, 4):
        wv = fresh.load(v)
        assert_same(wv.tensors, sds[v])
        assert wv.folder is None and wv.manifest.base_version == (0 if v < 3 else 3)
    wv = follower.load(2)
    assert_same(wv.tensors, sds[2])
    assert wv.nbytes == rd.weight_file(2, WEIGHT_DELTA).stat().st_size, "the base came from memory, not the disk"


def test_a_delta_version_lies_in_one_shared_buffer_that_vllm_maps(tmp_path):
    wt = publisher(tmp_path)
    sds = publish_chain(wt, 2)
    with reader(wt).take(1) as wv:
        if wv.mapped is None:
            pytest.skip("no room in /dev/shm here: the buffer is private memory")
        flat = torch.from_file(wv.mapped.path, shared=False, size=wv.mapped.nbytes, dtype=torch.uint8)
        rows = {r.name: r for r in wv.mapped.layout}
        assert set(rows) == set(sds[1])  # aliases included
        r = rows["mlp.weight"]
        got = flat[r.offset_bytes:r.offset_bytes + r.nbytes].view(torch.bfloat16).reshape(r.shape)
        assert torch.equal(got, sds[1]["mlp.weight"])


def test_a_delta_that_does_not_pay_is_written_full_and_becomes_the_base(tmp_path):
    wt = publisher(tmp_path, delta_max_ratio=0.5)
    sd0 = base_state()
    wt.publish(0, sd0, "{}", 0, 0)
    other = {k: (torch.randn_like(v.float()) * 0.02).to(v.dtype) if v.is_floating_point() else v
             for k, v in sd0.items() if k != "lm_head.weight"}
    other["lm_head.weight"] = other["embed.weight"]
    assert wt.publish(1, other, "{}", 1, 0).manifest.base is None, "every value changed: full"
    assert wt.publish(2, step(other, 0), "{}", 2, 0).manifest.base_version == 1
    assert_same(reader(wt).load(2).tensors, step(other, 0))


def test_delta_off_writes_every_version_full(tmp_path):
    wt = publisher(tmp_path, delta=False)
    publish_chain(wt, 3)
    assert all(wt.run_dir.weight_file(v, WEIGHT_TENSORS).is_file() for v in range(3))


@pytest.mark.parametrize("how", ["truncated", "header", "data", "missing"])
def test_a_damaged_delta_is_named_marked_and_the_trainer_then_writes_a_full_version(tmp_path, caplog, how):
    wt = publisher(tmp_path)
    sds = publish_chain(wt, 3)
    rd = wt.run_dir
    if how == "missing":
        rd.weight_file(2, WEIGHT_DELTA).unlink()
    else:
        damage_delta(rd, 2, how)
    sub = reader(wt)
    with sub.take_newest() as wv:  # v2 refused, v1 (an intact delta) taken
        assert wv.version == 1
        assert_same(wv.tensors, sds[1])
    assert wt.is_bad(2) and not wt.is_bad(0)
    assert "weight version 2" in caplog.text
    # the trainer sees the marker and re-publishes its weights: full, a clean start for every reader
    assert wt.publish(3, sds[2], "{}", 3, 8).manifest.base is None
    assert_same(reader(wt, "w001").load(3).tensors, sds[2])


def damage_delta(rd: RunDir, version: int, how: str) -> None:
    damage_weights(rd, version, how, WEIGHT_DELTA)


def test_a_base_that_no_longer_verifies_is_named_and_marked_and_nothing_wrong_is_loaded(tmp_path, caplog):
    wt = publisher(tmp_path)
    publish_chain(wt, 3)
    damage_weights(wt.run_dir, 0, "data")  # the base's bytes, under readers that do not hold it
    sub = reader(wt)
    assert sub.take_newest() is None, "no version can be rebuilt: wait for the trainer"
    assert all(wt.is_bad(v) for v in (0, 1, 2))
    assert "weight version 2 (a delta) cannot be rebuilt: its base, full version 0" in caplog.text
    assert "is damaged" in caplog.text
    assert wt.publish(3, step(base_state(), 5), "{}", 3, 8).manifest.base is None, "no intact base: full"
    assert sub.newest_usable() == 3 and sub.take_newest().version == 3


def test_a_base_deleted_under_a_reader(tmp_path, caplog):
    """The reader that holds the base in memory goes on; one that does not names the version and waits for a full
    one, which the trainer writes because its base is gone."""
    wt = publisher(tmp_path)
    sds = publish_chain(wt, 2)
    holder = reader(wt, "w000")
    holder.load(0)
    wt.folders.delete(0)
    assert_same(holder.load(1).tensors, sds[1])
    newcomer = reader(wt, "w001")
    with pytest.raises(WeightVersionBad, match="full version 0 .* is gone"):
        newcomer.take(1)
    assert wt.is_bad(1)
    assert wt.publish(2, sds[1], "{}", 2, 4).manifest.base is None
    assert_same(newcomer.take_newest().tensors, sds[1])


def test_a_base_republished_after_a_rollback_is_another_base(tmp_path):
    """The trainer resumes from a checkpoint before v0's successor and republishes versions with the same numbers
    but other bytes: a reader holding the old v0 must not rebuild the new deltas against it."""
    wt = publisher(tmp_path)
    publish_chain(wt, 2)
    sub = reader(wt)
    sub.load(1)  # holds the old v0
    wt.withdraw_after(-1)
    wt2 = publisher(tmp_path)  # the resumed trainer
    sd = step(base_state(), 7)
    wt2.publish(0, sd, "{}", 0, 0)
    wt2.publish(1, step(sd, 3), "{}", 1, 4)
    wv = sub.load(1)
    assert_same(wv.tensors, step(sd, 3))
    assert wv.nbytes > wt2.run_dir.weight_file(1, WEIGHT_DELTA).stat().st_size, "it read the new base from disk"


def test_a_held_base_that_went_wrong_in_memory_is_read_again_from_disk(tmp_path, caplog):
    wt = publisher(tmp_path)
    sds = publish_chain(wt, 2)
    sub = reader(wt)
    sub.load(0)
    sub.deltas.base.tensors["mlp.weight"].view(-1)[0] += 1  # a bit flip in host memory
    assert_same(sub.load(1).tensors, sds[1])
    assert "reading the base again from disk" in caplog.text and not wt.is_bad(1)


def test_retention_never_deletes_a_base_a_kept_delta_needs(tmp_path):
    wt = publisher(tmp_path, keep_versions=2, full_every=10)
    sds = publish_chain(wt, 6)
    assert sorted(wt.retain(heartbeat_stale_s=5)) == [1, 2, 3]
    assert wt.published_versions() == [0, 4, 5]
    assert_same(reader(wt).load(5).tensors, sds[5])
    assert not list(wt.run_dir.weights.glob("*.deleting")), "a removal leaves nothing behind"


def test_a_trainer_killed_mid_delta_leaves_no_visible_version(tmp_path, monkeypatch):
    wt = publisher(tmp_path)
    sds = publish_chain(wt, 2)
    monkeypatch.setattr(faults, "_specs", [["delta_write", "1", "fail"]])
    monkeypatch.setattr(faults, "_counts", {})
    with pytest.raises(faults.InjectedFault):
        wt.publish(2, step(sds[1], 1), "{}", 2, 8)
    monkeypatch.setattr(faults, "_specs", [])
    rd = wt.run_dir
    assert wt.published_versions() == [0, 1] and reader(wt).newest_usable() == 1
    assert rd.staging(rd.weight_version_dir(2)).is_dir(), "the half-written folder is under its staging name"
    restarted = publisher(tmp_path)  # holds no base: its first version is full
    assert restarted.publish(2, step(sds[1], 1), "{}", 2, 8).manifest.base is None
    assert_same(reader(wt).load(2).tensors, step(sds[1], 1))


def test_export_of_a_delta_version_is_a_complete_model_folder(tmp_path):
    from safetensors.torch import load_file
    rd = RunDir(tmp_path / "run").create()
    rd.freeze_config(load_config(TINY))  # a run directory as export reads it (no model built: export needs none)
    wt = make_publisher(WeightsConfig(), rd)
    sds = publish_chain(wt, 2)
    done = export(rd.root, tmp_path / "out", 1)
    theirs = load_file(str(done.folder / WEIGHT_TENSORS))
    assert WEIGHT_DELTA not in done.files and any("rebuilt" in n for n in done.notes)
    assert_same({**theirs, "lm_head.weight": theirs["embed.weight"]}, sds[1])


def test_hpcrl_eval_of_a_delta_folder_says_what_it_is_and_what_to_do(tmp_path, capsys):
    from hpcrl.cli import main as cli_main
    wt = publisher(tmp_path)
    publish_chain(wt, 2)
    assert cli_main(["eval", "--model", str(wt.run_dir.weight_version_dir(1))]) != 0
    err = capsys.readouterr().err
    assert "a delta weight version" in err and "hpcrl export" in err


def test_lora_adapter_versions_are_always_written_whole(tmp_path):
    """A LoRA run publishes its adapter alone (tiny): never a delta, and never held as a delta base."""
    from hpcrl.rundir.paths import WEIGHT_ADAPTER_TENSORS
    from hpcrl.weights.manifest import AdapterBase

    wt = publisher(tmp_path)
    base = AdapterBase(path="/models/base", hash="xxh3_128:" + "0" * 32)
    sd = {"base_model.model.q_proj.lora_A.weight": torch.zeros(256, 64, dtype=torch.bfloat16)}
    for v in range(3):
        sd = {k: t.clone() for k, t in sd.items()}
        sd["base_model.model.q_proj.lora_A.weight"][v, 0] = 1.0  # one value changes: a delta would be tiny
        manifest = wt.publish(v, sd, json.dumps({"peft_type": "LORA", "r": 4}), trainer_step=v, consumed_groups=4 * v,
                              adapter=base).manifest
        assert manifest.base is None and manifest.adapter == base
        assert set(manifest.files) == {WEIGHT_ADAPTER_TENSORS, "adapter_config.json"}
    assert wt.deltas.base is None
    with reader(wt).take(2) as wv:
        assert_same(wv.tensors, sd)
        assert wv.adapter["r"] == 4
