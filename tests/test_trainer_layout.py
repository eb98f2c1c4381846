"""The trainer's long-sequence layout (token-budget micro-batches balanced over ranks, padding-free packs, log-probs
from the hidden states in chunks, checkpointed layers, Ulysses sequence parallelism) changes how the work is cut,
never the update: on groups of mixed lengths with tool tokens, the precomputed log-probs, values and score norms and
the mini-batch's gradient equal the padded whole-logits path's (tests/padded_reference.py) to 1e-6 in fp32, for
every packing, on two real DeepSpeed ranks (gloo). The packing rules themselves are checked without a model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from hpcrl.process.network import free_port
from hpcrl.trainer.packing import balance_rows, chunks_by_tokens, micro_batches, pack_rows

sys.path.insert(0, str(REPO / "tests"))
from layout_peer import ALGOS, PACKINGS  # noqa: E402


def test_token_budget_bins_hold_every_row_once_within_the_budget_and_ranks_run_as_many():
    lengths = [3000, 120, 40, 28000, 900, 900, 5, 16000, 7, 2048, 2048, 300]
    plan = micro_batches(lengths, 4, budget_tokens=4096, rows_per_micro=1)
    rows = sorted(r for rank in plan for micro in rank for r in micro)
    assert rows == list(range(len(lengths))), "every row once"
    assert len({len(rank) for rank in plan}) == 1, "every rank runs the same number of micro-batches"
    for rank in plan:
        for micro in rank:
            assert len(micro) == 1 or sum(lengths[r] for r in micro) <= 4096, (micro, "over the budget")
    loads = sorted(sum(lengths[r] for r in share) for share in balance_rows(lengths, 4))
    assert loads[2:] == [16000, 28000] and loads[1] - loads[0] < 300, loads  # the two long rows alone, the rest even
    assert pack_rows(range(5), [5, 5, 5, 5, 5], 10) == [[0, 1], [2, 3], [4]]
    assert chunks_by_tokens([5, 5, 20, 1], 10) == [[0, 1], [2], [3]]


def test_ranks_with_fewer_rows_than_micro_batches_get_stand_ins():
    plan = micro_batches([5000, 5000, 5000], 2, budget_tokens=4000, rows_per_micro=1)
    assert [len(rank) for rank in plan] == [2, 2]
    assert [] in plan[0] + plan[1], "a rank short of rows runs an empty micro-batch (a stand-in)"
    by_rows = micro_batches(list(range(16)), 2, budget_tokens=None, rows_per_micro=4)
    assert by_rows == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]]


def two_ranks(out, names: list[str]) -> None:
    """tests/layout_peer.py on two gloo ranks for ``names``."""
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "layout_peer.py"), str(out), *names],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, cwd=REPO) for r in range(2)]
    logs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]


CHECKED = [f"{a}/{p}" for i, a in enumerate(ALGOS) for j, p in enumerate(PACKINGS)
           if (i + j) % 3 == 0 and not p.startswith("sp2")] + [
    "gae/sp2-tokens30", "seqmean+kl/sp2-tokens30", "dapo/sp2-rows1-ckpt", "lora+kl/sp2-rows1-ckpt"]
"""Every estimator and loss setting with one to three of the five packings without sequence parallelism, every
packing with two or three settings; sequence parallelism (size 2 over the two ranks) with the value head, the
reference, the entropy bonus's gradient and LoRA."""


@pytest.mark.slow
def test_every_packing_gives_the_padded_paths_update_on_two_ranks(tmp_path):
    """Also: the same update under ZeRO-2 with optimizer offload and ZeRO-3 with both offloads (the policy and the
    reference partitioned as they load) has ZeRO 0's gradient norm and weights."""
    # sequence parallelism changes transformers' attention for the whole process: its settings run in a pair of their own
    for names in ([n for n in CHECKED if "/sp" not in n] + ["zero"], [n for n in CHECKED if "/sp" in n]):
        two_ranks(tmp_path, names)
    stand_ins = 0
    for name in CHECKED:
        got = json.loads((tmp_path / f"{name.replace('/', '_')}.json").read_text())
        stand_ins += got["stand_ins"]
        assert got["ulysses"] == (got["sp"] == 2) == ("/sp2" in name), (name, "Ulysses attention exactly when sp=2")
        tol = 1e-6 * max(1.0, got["grad_scale"])
        assert not got["missing"], (name, got["missing"])
        assert got["grad_max_diff"] <= tol, (name, got)
        assert all(d <= 1e-6 for d in got["fields"].values()), (name, got["fields"])
        assert abs(got["loss_oracle"]) > 0, name
    assert stand_ins > 0, "a rank short of rows ran a stand-in in some setting (and the gradient still equals)"
    zero = json.loads((tmp_path / "zero.json").read_text())
    for stage in ("2", "3"):  # ZeRO-2 with optimizer offload, ZeRO-3 partitioned at load with both offloads
        assert abs(zero[stage]["grad_norm"] - zero["0"]["grad_norm"]) <= 1e-6 * zero["0"]["grad_norm"], zero
        assert zero[stage]["pg_loss"] == pytest.approx(zero["0"]["pg_loss"], abs=1e-7), zero
        assert zero[stage]["weights_max_diff"] <= 1e-5, zero
    # sdpa cuts the skewed micro-batches into more packs on one rank than on the other: ZeRO-3's ranks still run the
    # same forwards (a stand-in pack where they have fewer), else a model whose layers are gathered in each would hang
    assert zero["3"]["same_forwards"], zero["3"]
    assert not zero["0"]["same_forwards"], ("the data must cut the ranks' micro-batches into different packs", zero["0"])
