"""The trainer's forward on the real tiny model: it reproduces the engine's log-probs (the
behaviour policy of every importance weight), values sit where the token is chosen, and
publishing leaves the value head out."""
import time

import numpy as np
import pytest
import torch

from hpcrl.rollout.engine import EngineOptions
from hpcrl.rollout.transformers_engine import TransformersEngine
from hpcrl.samples.schema import Group, Trajectory
from hpcrl.tiny.model import build_tiny_model
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.forward import logprobs_of
from hpcrl.trainer.models import PolicyWithValueHead, load_reference, policy_state_dict
from hpcrl.trainer.offpolicy import correct


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def sampled_groups(tiny, temperature=1.0, version=3):
    eng = TransformersEngine(EngineOptions(tiny, max_new_tokens=6, temperature=temperature, top_p=1.0, device="cpu",
                                           dtype="float32"))
    groups = []
    for gi, prompt in enumerate([[30, 5], [31, 7, 8, 9]]):  # two prompt lengths: padding in the batch
        trajs = [Trajectory(prompt, s.response_ids, np.ones(len(s.response_ids), np.int8), s.logprobs,
                            np.full(len(s.response_ids), version - gi, np.int32), 0.0)
                 for s in eng.generate_sync(prompt, 4, seed=gi)]
        groups.append(Group("w000", gi, trajs, 0.0, 0.0))
    return groups


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_log_probs_match_the_engine_log_probs(tiny, temperature):
    groups = sampled_groups(tiny, temperature)
    batch = build_batch(groups, pad_id=0, trainer_version=3)
    model = PolicyWithValueHead(load_reference(tiny), value_head=True)
    with torch.no_grad():
        logp, ent, values = logprobs_of(model, batch, temperature, extra="entropy")
    m = batch.mask > 0
    assert torch.allclose(logp[m], batch.behav_logp[m], atol=1e-4), "same weights: pi_prox = mu token by token"
    _, _, s = correct(batch.mask, prox_logp=logp, behav_logp=batch.behav_logp)
    assert abs(s["rollout_corr/kl"]) < 1e-5 and s["rollout_corr/k3_kl"] < 1e-8
    assert torch.all(values == 0), "zero-initialised value head"
    assert values.shape == logp.shape == ent.shape == batch.mask.shape
    # the plain HF model (the reference path) gives the same log-probs
    with torch.no_grad():
        ref_logp, _, ref_values = logprobs_of(load_reference(tiny), batch, temperature)
    assert ref_values is None and torch.allclose(ref_logp[m], logp[m], atol=1e-5)


def test_per_token_versions_reach_the_batch_as_lag(tiny):
    batch = build_batch(sampled_groups(tiny), pad_id=0, trainer_version=3)
    m = batch.mask > 0
    assert set(batch.token_lag[m].tolist()) == {0, 1}  # group 0 sampled by v3, group 1 by v2
    assert torch.all(batch.token_lag[:4][m[:4]] == 0) and torch.all(batch.token_lag[4:][m[4:]] == 1)
    assert torch.all(batch.token_lag[~m] == 0)


def test_publish_keeps_the_hf_names_and_leaves_the_value_head_out(tiny):
    ref = load_reference(tiny)
    wrapped = PolicyWithValueHead(ref, value_head=True)
    published = policy_state_dict(wrapped.state_dict())
    assert set(published) == set(ref.state_dict())
    assert not any("value_head" in k for k in published)
    assert all(not p.requires_grad for p in ref.parameters()), "the reference model is frozen"


def test_transformers_engine_abort_returns_partial_responses(tiny):
    """abort_all stops a generation between two decoding steps; the tokens so far come back."""
    import asyncio
    import threading

    from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH

    eng = TransformersEngine(EngineOptions(tiny, max_new_tokens=5000, temperature=1.0, top_p=1.0, device="cpu",
                                           dtype="float32"))
    eng.eos_id = None  # no EOS: only the budget or the abort ends it
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("s", eng.generate_sync([30, 5], 2, seed=0)))
    thread.start()
    time.sleep(0.5)
    asyncio.run(eng.abort_all())
    thread.join(30)
    assert [s.finish_reason for s in out["s"]] == [FINISH_ABORT] * 2
    assert all(0 < len(s.response_ids) < 5000 and len(s.logprobs) == len(s.response_ids) for s in out["s"])
    assert [s.finish_reason for s in eng.generate_sync([30, 5], 2, seed=0, max_new_tokens=3)] == [FINISH_LENGTH] * 2
