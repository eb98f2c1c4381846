"""The simulated engine's latency model, lengths, determinism, abort and continuation (no run, no torch model)."""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from hpcrl.config.simulated import SimulatedConfig
from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineOptions
from hpcrl.rollout.simulated_engine import SimulatedEngine

EOS = 1


def _model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "eos_token_id": EOS}))
    return tmp_path


def _fixed_lengths(tmp_path, length: int) -> str:
    """``empirical:RUN`` where every response has ``length`` tokens: the latency arithmetic becomes exact."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "staleness.jsonl").write_text("".join(json.dumps({"n_tokens": length}) + "\n" for _ in range(3)))
    return f"empirical:{run}"


def _engine(tmp_path, max_num_seqs=256, cap=64, **sim) -> SimulatedEngine:
    opts = EngineOptions(model_dir=_model_dir(tmp_path), max_new_tokens=cap, temperature=1.0, top_p=1.0,
                         device="cpu", dtype="float32")
    return SimulatedEngine(opts, SimulatedConfig(**sim), max_num_seqs)


def test_one_batch_takes_length_steps_of_base_plus_per_seq_and_prefill(tmp_path):
    eng = _engine(tmp_path, decode_base_s=0.1, decode_per_seq_s=0.025, prefill_per_token_s=0.01, time_scale=100,
                  lengths=_fixed_lengths(tmp_path, 10))
    t0 = time.monotonic()
    out = asyncio.run(eng.generate([5, 6, 7], n=4, seed=1))
    wall = time.monotonic() - t0
    # 4 sequences x 3 prompt tokens of prefill, then 10 steps of 0.1 + 4 * 0.025
    assert eng.busy_model_s == pytest.approx(4 * 3 * 0.01 + 10 * 0.2)
    assert wall >= eng.busy_model_s / 100 * 0.9
    assert [len(s.response_ids) for s in out] == [10] * 4
    assert all(s.finish_reason == FINISH_STOP and s.response_ids[-1] == EOS for s in out)
    assert all(s.response_ids[:-1].min() >= 3 and s.response_ids.max() < 64 for s in out)  # no special token but EOS
    assert all(np.all(s.logprobs < 0) for s in out)


def test_max_num_seqs_queues_the_rest(tmp_path):
    eng = _engine(tmp_path, max_num_seqs=2, decode_base_s=0.1, decode_per_seq_s=0.025, prefill_per_token_s=0.0,
                  time_scale=100, lengths=_fixed_lengths(tmp_path, 10))
    asyncio.run(eng.generate([5], n=4, seed=1))
    assert eng.busy_model_s == pytest.approx(2 * 10 * (0.1 + 2 * 0.025))


def test_concurrent_requests_share_the_batch(tmp_path):
    """Two groups at once cost one batch of 8, not two of 4: what continuous batching buys."""
    eng = _engine(tmp_path, decode_base_s=0.1, decode_per_seq_s=0.0, prefill_per_token_s=0.0, time_scale=100,
                  lengths=_fixed_lengths(tmp_path, 10))

    async def two():
        return await asyncio.gather(eng.generate([5], 4, 1), eng.generate([6], 4, 2))

    asyncio.run(two())
    assert eng.busy_model_s == pytest.approx(10 * 0.1)


def test_cap_ends_with_length_and_same_seed_same_tokens(tmp_path):
    eng = _engine(tmp_path, cap=5, time_scale=1000, lengths=_fixed_lengths(tmp_path, 10))
    a = asyncio.run(eng.generate([5], n=3, seed=7))
    b = asyncio.run(eng.generate([5], n=3, seed=7))
    c = asyncio.run(eng.generate([5], n=3, seed=8))
    assert all(s.finish_reason == FINISH_LENGTH and len(s.response_ids) == 5 for s in a)
    assert all(np.array_equal(x.response_ids, y.response_ids) for x, y in zip(a, b))
    assert not np.array_equal(a[0].response_ids, c[0].response_ids)
    assert not np.array_equal(a[0].response_ids, a[1].response_ids)  # n responses are not copies


def test_abort_returns_partial_tokens_and_the_continuation_keeps_the_drawn_length(tmp_path):
    # 40 steps of 0.01 wall s each: an abort after ~0.1 s lands mid-response
    eng = _engine(tmp_path, cap=64, decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0, time_scale=1,
                  lengths=_fixed_lengths(tmp_path, 40))
    whole = asyncio.run(eng.generate([5, 6], n=2, seed=3))

    async def cut():
        task = asyncio.ensure_future(eng.generate([5, 6], n=2, seed=3))
        await asyncio.sleep(0.1)
        await eng.abort_all()
        first = await task
        rest = await asyncio.gather(*(eng.generate([5, 6] + s.response_ids.tolist(), 1, seed=99,
                                                   max_new_tokens=64 - len(s.response_ids)) for s in first))
        return first, [r[0] for r in rest]

    first, rest = asyncio.run(cut())
    for w, f, r in zip(whole, first, rest):
        assert f.finish_reason == FINISH_ABORT and 0 < len(f.response_ids) < 40
        assert r.finish_reason == FINISH_STOP
        joined = np.concatenate([f.response_ids, r.response_ids])
        assert np.array_equal(joined, w.response_ids)  # same tokens, same length as if never cut


def test_abort_before_admission_returns_nothing_and_continues(tmp_path):
    eng = _engine(tmp_path, max_num_seqs=1, cap=64, decode_base_s=0.01, decode_per_seq_s=0.0,
                  prefill_per_token_s=0.0, time_scale=1, lengths=_fixed_lengths(tmp_path, 20))

    async def cut():
        task = asyncio.ensure_future(eng.generate([5], n=2, seed=3))
        await asyncio.sleep(0.05)
        await eng.abort_all()
        return await task

    first = asyncio.run(cut())
    assert [s.finish_reason for s in first] == [FINISH_ABORT, FINISH_ABORT]
    assert len(first[1].response_ids) == 0  # it never entered the batch
    rest = asyncio.run(eng.generate([5], 1, seed=0, max_new_tokens=64))[0]
    assert len(rest.response_ids) == 20 and rest.finish_reason == FINISH_STOP


@pytest.mark.parametrize("dist", ["geometric", "lognormal"])
def test_length_distributions_have_the_configured_mean(dist):
    sim = SimulatedConfig(lengths=dist, length_mean=200.0, length_sigma=1.0)
    x = sim.draw_lengths(np.random.default_rng(0), 200_000)
    assert x.min() >= 1
    assert x.mean() == pytest.approx(200.0, rel=0.03)
    if dist == "lognormal":  # the long tail: the mean is well above the median
        assert np.median(x) < 0.7 * x.mean()


def test_step_time_is_linear_in_running_sequences():
    sim = SimulatedConfig(decode_base_s=0.02, decode_per_seq_s=0.001)
    assert sim.decode_step_s(0) == pytest.approx(0.02)
    assert sim.decode_step_s(100) == pytest.approx(0.12)


def test_sequences_of_different_lengths_finish_one_by_one(tmp_path):
    """Lengths differ within a batch: the batch shrinks as each ends (the step time with it)."""
    eng = _engine(tmp_path, cap=4096, decode_base_s=0.001, decode_per_seq_s=0.001, prefill_per_token_s=0.0,
                  time_scale=1000, lengths="lognormal", length_mean=50.0)
    out = asyncio.run(eng.generate([5], n=16, seed=4))
    lengths = sorted(len(s.response_ids) for s in out)
    assert len(set(lengths)) > 4
    # each step costs 0.001 + 0.001 * (sequences still running)
    expected = sum((lengths[i] - (lengths[i - 1] if i else 0)) * (0.001 + 0.001 * (16 - i)) for i in range(16))
    assert eng.busy_model_s == pytest.approx(expected)


@pytest.mark.parametrize("overrides, key, fix", [
    (["rollout.engine=simulated", "trainer.simulated=true", "eval.every_versions=0", "model.path=/models/qwen"],
     "model.path", "set model.path=builtin:tiny"),
    (["rollout.engine=simulated", "model.path=/models/qwen"], "eval.every_versions", "set eval.every_versions=0"),
    (["trainer.simulated=true", "eval.every_versions=0"], "trainer.simulated", "set rollout.engine=simulated"),
    (["rollout.engine=simulated"], "eval.every_versions", "set eval.every_versions=0"),
    (["eval.engine=simulated"], "eval.engine", "set eval.engine=null"),
])
def test_a_simulated_part_never_meets_a_real_one(overrides, key, fix):
    from hpcrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", overrides)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"config {key}:") and "allowed:" in msg and fix in msg


def test_the_simulated_engine_with_a_real_model_and_trainer_is_the_sizing_probe():
    from hpcrl.config import load_config

    probe = load_config("configs/tiny.yaml", ["rollout.engine=simulated", "eval.every_versions=0",
                                              "model.path=/models/qwen"])
    assert probe.is_sizing_probe and probe.is_simulated
    assert not load_config("configs/tiny.yaml", ["rollout.engine=simulated", "eval.every_versions=0"]).is_sizing_probe


def test_the_simulated_engine_module_imports_no_torch_itself():
    """The engine's own file needs numpy only (the rollout job's other parts bring torch)."""
    import ast
    from pathlib import Path

    import hpcrl.rollout.simulated_engine as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(x == "torch" or x.startswith("torch.") for x in names)


def test_the_batch_keeps_to_wall_time_times_time_scale_under_many_short_sleeps(tmp_path):
    """Every finish is a sleep; what a sleep overshoots (and the scheduler's own work) is carried into the next,
    so many events do not make the engine slower than its phase model."""
    eng = _engine(tmp_path, cap=4096, decode_base_s=0.01, decode_per_seq_s=0.0001, prefill_per_token_s=0.0,
                  time_scale=200, lengths="lognormal", length_mean=60.0)
    t0 = time.monotonic()
    out = asyncio.run(eng.generate([5], n=128, seed=3))
    wall = time.monotonic() - t0
    assert len({len(s.response_ids) for s in out}) > 60  # that many finishes, each a sleep
    assert wall * 200 >= eng.busy_model_s * 0.95
    assert wall * 200 <= eng.busy_model_s * 1.1 + 10  # before: one overshoot per sleep, lost
