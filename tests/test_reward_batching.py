"""How the reward service batches a discriminative model's work (hpcrl/reward/models.py ``micro_batches``,
hpcrl/reward/server.py ``Batcher``): the cuts of least padding plus a forward's cost, against every possible cut;
requests scored together by length, each answered with its own scores in its own order."""
from __future__ import annotations

import dataclasses
import time

import pytest

from hpcrl.config.reward_model import RewardModelConfig
from hpcrl.reward.models import DiscriminativeRM, micro_batches
from hpcrl.tiny.model import build_tokenizer
from test_reward_model import _items, _offline_disrm, disrm_folder  # noqa: F401 - a module fixture


def test_micro_batches_are_the_cuts_of_least_padding_plus_forwards():
    """Against every way of cutting the sorted lengths (contiguous runs: a run padded to its longest), within the
    limits: the same least cost; by default the fewest forwards first."""
    import itertools
    import random

    assert micro_batches([3, 9, 5, 9, 1], 2, None) == [[1, 3], [2], [0, 4]]  # 3 forwards, 29 padded tokens
    assert micro_batches([4, 4, 4], 8, 8) == [[0], [1, 2]]  # at most 8 padded tokens a forward
    assert micro_batches([100, 20, 20, 20], 4, None, forward_tokens=64) == [[0], [1, 2, 3]]
    assert micro_batches([100, 20, 20, 20], 4, None) == [[0, 1, 2, 3]]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 8))]
        seqs, tokens, forward = rng.randint(1, 5), rng.choice([None, 80, 150]), rng.choice([0, 16, 64, 1 << 40])
        got = micro_batches(lengths, seqs, tokens, forward)
        assert sorted(k for b in got for k in b) == list(range(len(lengths)))
        for b in got:
            assert len(b) <= seqs and (len(b) == 1 or tokens is None or len(b) * lengths[b[0]] <= tokens)
        ls = sorted(lengths, reverse=True)
        best = min(sum(forward + (j - i) * ls[i] for i, j in zip(cuts, cuts[1:]))
                   for r in range(len(ls)) for inner in itertools.combinations(range(1, len(ls)), r)
                   for cuts in [(0, *inner, len(ls))]
                   if all(j - i <= seqs and (j - i == 1 or tokens is None or (j - i) * ls[i] <= tokens)
                          for i, j in zip(cuts, cuts[1:])))
        assert sum(forward + len(b) * lengths[b[0]] for b in got) == best, (lengths, seqs, tokens, forward)


def test_the_batcher_scores_what_waits_by_length_and_answers_each_request_in_its_own_order(disrm_folder):
    """Requests of mixed lengths waiting together are scored in forwards of similar lengths (sorted, not in the
    order they came), yet every request gets its own items' scores in its own order (each equal to the model's
    score of that sequence alone) and an input it cannot take gets its problem, in its place."""
    from hpcrl.reward.server import Batcher, ServerStats

    cfg = RewardModelConfig(enable=True, path=str(disrm_folder), micro_batch_size=3, max_length=16,
                            truncation="error")
    model = DiscriminativeRM(disrm_folder, build_tokenizer(), cfg, "cpu", "float32")
    forwards: list[list[int]] = []
    real_forward = model.forward

    def forward(seqs):
        forwards.append([len(s) for s in seqs])
        time.sleep(0.05)  # the requests submitted meanwhile wait together
        return real_forward(seqs)

    model.forward = forward
    groups = [_items(5, seed) for seed in range(4)]
    too_long = groups[2][1] = dataclasses.replace(groups[2][1], response_ids=list(range(3, 25)))
    batcher = Batcher(model, ServerStats())
    try:
        futures = [batcher.submit(items) for items in groups]
        results = [f.result(timeout=60) for f in futures]
    finally:
        batcher.close()
    for k, items in enumerate(groups):
        want = _offline_disrm(disrm_folder, items)
        for i, (got, item) in enumerate(zip(results[k], items)):
            if item is too_long:
                assert got.score is None and "max_length" in got.problem, got
            else:
                assert got.score == pytest.approx(want[i], abs=1e-5), (k, i)
    arrival = [len(it.prompt_ids) + len(it.response_ids) for items in groups for it in items if it is not too_long]
    assert sum(map(len, forwards)) == len(arrival) and all(f == sorted(f, reverse=True) for f in forwards)
    assert [n for f in forwards for n in f] != arrival, "the items were scored in the order they came"
