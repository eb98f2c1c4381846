"""The reward model (hpcrl/reward/): its config and verl's keys, the inputs, the parsers, the service's wire and
handshake, and the scores a reward job serves against an offline call of the same model (a discriminative model and
a generative judge), with real sockets and real models, in this process (no job is started here; the tests with a
model behind a socket are marked slow)."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
import torch

from conftest import TINY
from hpcrl.config import ConfigError, RewardConfig, RunConfig, load_config
from hpcrl.config.reward_model import RewardModelConfig
from hpcrl.reward.client import RewardClient
from hpcrl.reward.inputs import DiscriminativeInputs, InputTooLong, JudgeInputs, Truncation, same_tokenizer
from hpcrl.reward.models import DiscriminativeRM, GenerativeJudge, model_kind
from hpcrl.reward.parsers import last_number, load_parser, parse_score, yes_no
from hpcrl.reward.scoring import LocalBackend, ModelRewards
from hpcrl.reward.server import RewardServer
from hpcrl.reward.wire import (MAX_FRAME_BYTES, RewardService, RewardWaitStopped, RewardWaitTimeout, ScoreItem,
                               WireError, client_handshake, recv_frame, send_frame, server_handshake)
from hpcrl.rollout.reward_fn import RewardLoadError, RewardScorer, load_reward
from hpcrl.rundir.paths import RunDir
from hpcrl.tiny.model import build_tiny_model, build_tokenizer, quiet_progress_bars, tiny_config

RM = ["reward_model.enable=true", "reward_model.path=builtin:tiny-rm", "reward.name=by_data_source"]


# ---- config and verl's keys -----------------------------------------------------------------------------------

def test_the_section_checks_its_values_and_the_combinations_in_one_pass():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["reward_model.enable=true", "reward_model.placement=colocated", "reward_model.kind=rm",
                           "reward_model.prompt_template='Q: {question} A: {response}'", "reward_model.score_parser=best"])
    text = str(e.value)
    for fragment in ("reward_model.path", "reward_model.placement", "reward_model.kind", "{question}",
                     "reward_model.score_parser"):
        assert fragment in text, text
    with pytest.raises(ConfigError, match="the reward is the model's score"):
        load_config(TINY, ["reward_model.enable=true", "reward_model.path=builtin:tiny-rm"])  # tiny.yaml: toy_copy
    with pytest.raises(ConfigError, match="resources.reward_jobs"):
        load_config(TINY, [*RM, "resources.reward_jobs=0"])
    cfg = load_config(TINY, [*RM, "resources.reward_jobs=0", "reward_model.placement=rollout"])
    assert cfg.reward_model.placement == "rollout"


def test_a_judges_engine_is_checked_before_submission_like_the_rollout_engine(tmp_path, monkeypatch):
    """A generative judge on an engine whose package this Python lacks (vLLM's spec pointed at a package nobody has)
    is refused by the launch check, in the same pass as its other problems, with the fix; a discriminative model
    runs no engine; ``auto`` is the rollout engine's, whose problem that key says once."""
    from hpcrl.config import registries
    from hpcrl.launcher.inputs import check_inputs

    monkeypatch.setitem(registries.ENGINES, "vllm",
                        dataclasses.replace(registries.ENGINES["vllm"], package="hpcrl_no_such_package"))
    judge = [*RM[:1], "reward_model.path=builtin:tiny-judge", "reward.name=by_data_source", "eval.every_versions=0"]
    (tmp_path / "p.py").write_text("x = 1\n")
    with pytest.raises(ConfigError) as e:
        check_inputs(load_config(TINY, [*judge, "reward_model.engine=vllm",
                                        f"reward_model.score_parser={tmp_path}/p.py:nothing"]), "local")
    lines = str(e.value).splitlines()
    assert any(line.startswith("config reward_model.engine: got 'vllm'; allowed: an engine this Python can import "
                               "(hpcrl_no_such_package is not installed); fix: ") and
               line.endswith(", or reward_model.engine=transformers") for line in lines), lines
    assert any("reward_model.score_parser" in line for line in lines), "every problem in one pass"
    with pytest.raises(ConfigError) as e:
        check_inputs(load_config(TINY, [*judge, "rollout.engine=vllm", "model.path=builtin:tiny-h64"]), "local")
    assert [line.split(":")[0] for line in str(e.value).splitlines() if "is not installed" in line] == \
        ["config rollout.engine"], str(e.value)
    check_inputs(load_config(TINY, [*RM, "reward_model.engine=vllm", "eval.every_versions=0"]), "local")
    check_inputs(load_config(TINY, [*judge, "reward_model.engine=transformers"]), "local")


def test_verls_reward_model_keys_are_read_as_they_are_or_refused_one_by_one():
    notes: list[str] = []
    cfg = load_config(TINY, ["reward.name=by_data_source", "reward_model.enable=true", "reward_model.model.path=/rm",
                             "reward_model.micro_batch_size_per_gpu=8", "reward_model.max_length=512",
                             "reward_model.forward_max_token_len_per_gpu=4096", "reward_model.use_dynamic_bsz=true",
                             "reward_model.strategy=fsdp", "reward_model.enable_resource_pool=true",
                             "reward_model.nnodes=2", "reward_model.n_gpus_per_node=0",
                             "reward_model.reward_manager=naive", "reward_model.launch_reward_fn_async=true",
                             "reward_model.model.fsdp_config.param_offload=true"], notes=notes)
    rm = cfg.reward_model
    assert (rm.enable, rm.path, rm.micro_batch_size, rm.max_length, rm.max_batch_tokens, rm.placement) == (
        True, "/rm", 8, 512, 4096, "job")
    assert cfg.resources.reward_jobs == 2
    assert any("reward_model.strategy" in n for n in notes), notes
    cfg = load_config(TINY, ["reward.name=by_data_source", "reward.reward_model.enable=true",
                             "reward.reward_model.model_path=/judge", "reward.reward_model.enable_resource_pool=false",
                             "reward.reward_model.rollout.name=vllm", "reward.reward_model.rollout.response_length=64",
                             "reward.reward_model.rollout.temperature=0.7", "reward.reward_model.rollout.prompt_length=900",
                             "reward.reward_model.rollout.tensor_model_parallel_size=2",
                             "reward.reward_model.rollout.enable_prefix_caching=true",
                             "reward.reward_manager.source=register", "reward.reward_manager.module.name=x"])
    rm = cfg.reward_model
    assert (rm.path, rm.placement, rm.engine, rm.max_new_tokens, rm.temperature, rm.max_length,
            rm.tensor_parallel_size) == ("/judge", "rollout", "vllm", 64, 0.7, 900, 2)
    for override, fragment in (("reward_model.rollout.quantization=fp8", "runs in reward_model.dtype"),
                               ("reward_model.reward_loop_module_path=my.py", "a reward-loop class of your own"),
                               ("reward.reward_model.model_pth=/x", "reward.reward_model.model_path"),
                               ("reward_model.micro_bach_size_per_gpu=2", "did you mean")):
        with pytest.raises(ConfigError, match=fragment):
            load_config(TINY, [override])


# ---- inputs and parsers -----------------------------------------------------------------------------------------

def _item(prompt="repeat c", prompt_ids=(30, 5), response_ids=(5, 5, 1), response="c c", truth="c c c") -> ScoreItem:
    return ScoreItem(prompt=prompt, prompt_ids=list(prompt_ids), response_ids=list(response_ids), response=response,
                     ground_truth=truth, data_source="builtin:toy")


def _permuted_tokenizer():
    """The tiny tokenizer's words in another order (another tokenizer, same chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hpcrl.tiny.model import EOS, PAD, TINY_CHAT_TEMPLATE, UNK, tiny_vocab

    words = tiny_vocab()
    words = words[:3] + list(reversed(words[3:]))
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=UNK))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    out.chat_template = TINY_CHAT_TEMPLATE
    return out


def test_inputs_reuse_the_policys_tokens_or_go_through_the_reward_models_chat_template():
    policy, other = build_tokenizer(), _permuted_tokenizer()
    item = _item(prompt_ids=policy("repeat c")["input_ids"], response_ids=policy("c c <eos>")["input_ids"])
    same = DiscriminativeInputs(policy, policy, Truncation(None, "left"))
    assert same.reuse_ids and same.ids(item) == item.prompt_ids + item.response_ids
    switched = DiscriminativeInputs(other, policy, Truncation(None, "left"))
    assert not same_tokenizer(other, policy) and not switched.reuse_ids
    assert other.decode(switched.ids(item)) == "repeat c c c <eos>"  # user turn, assistant turn + its <eos>
    assert switched.ids(item) != same.ids(item)
    assert Truncation(3, "left")([1, 2, 3, 4, 5]) == [3, 4, 5] and Truncation(3, "right")([1, 2, 3, 4]) == [1, 2, 3]
    with pytest.raises(InputTooLong, match="max_length=3"):
        Truncation(3, "error")([1, 2, 3, 4])
    judge = JudgeInputs(policy, "{prompt} {response} ? {ground_truth}", Truncation(None, "left"))
    assert judge.ids(item) == policy("repeat c c c ? c c c", add_special_tokens=False)["input_ids"]


def test_score_parsers_builtin_and_your_own(tmp_path):
    assert last_number("score: 3 of 10 , final 7") == 7.0 and last_number("no verdict") is None
    assert yes_no("yes ... no ... Yes") == 1.0 and yes_no("NO") == 0.0 and yes_no("maybe") is None
    assert parse_score(last_number, "nothing")[0] is None and "no score" in parse_score(last_number, "x")[1]
    (tmp_path / "p.py").write_text("def parse(text):\n    return len(text)\n\ndef bad(text):\n    return 'x'\n")
    assert parse_score(load_parser(f"{tmp_path}/p.py:parse"), "abc") == (3.0, "")
    assert parse_score(load_parser(f"{tmp_path}/p.py:bad"), "abc")[0] is None


def test_hybrid_functions_take_the_models_score_and_client_by_name(tmp_path):
    (tmp_path / "r.py").write_text(
        "def hybrid(solution_str, ground_truth, rm_score, reward_model=None):\n"
        "    return 0.5 * rm_score + 0.5 * float(solution_str == ground_truth)\n"
        "def verl_style(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return float('rm_score' in kwargs)\n")
    hybrid = load_reward(RewardConfig(path=str(tmp_path / "r.py"), function="hybrid"), with_model=True)
    assert hybrid.passed[-2:] == ("rm_score", "reward_model")
    assert hybrid("s", "a", "a", None, rm_score=0.4) == pytest.approx(0.7)
    with pytest.raises(RewardLoadError, match="needs rm_score"):
        load_reward(RewardConfig(path=str(tmp_path / "r.py"), function="hybrid"))  # no reward model: refused
    verl = load_reward(RewardConfig(path=str(tmp_path / "r.py"), function="verl_style"), with_model=True)
    assert "rm_score" not in verl.passed  # a **kwargs function is not sent what it did not name
    alone = load_reward(RewardConfig(), with_model=True)
    scorer = RewardScorer(alone)
    assert scorer.score_full("w000/1/0", {"data_source": "", "answer": "", "extra_info": None}, "x", None, 0.25) \
        == (0.25, {})
    assert scorer.score_full("w000/1/1", {"data_source": "", "answer": "", "extra_info": None}, "x")[0] == 0.0
    assert scorer.pop_metrics()["reward/errors"] == 1  # no score from the model: 0, counted


def test_a_group_waiting_for_the_model_is_counted_apart_from_those_generating():
    """RewardScorer.waiting: the groups a rollout job's bound and share leave out (rollout/main.py admits another in
    their place), one while the model is asked and none after, also when the model fails."""
    entered, release = threading.Event(), threading.Event()

    class Model:
        def group_scores(self, row, responses, what, stop):
            entered.set()
            assert release.wait(10)
            if row["answer"] == "fail":
                raise RewardWaitTimeout("no reward job")
            return [0.5] * len(responses)

    scorer = RewardScorer(load_reward(RewardConfig(), with_model=True), Model())
    row = {"data_source": "", "answer": "", "extra_info": None, "prompt": "p", "prompt_ids": [1]}
    for answer in ("", "fail"):
        entered.clear(), release.clear()
        out = []
        t = threading.Thread(target=lambda: out.append(_try(lambda: scorer.score_group(
            ["w000/1/0", "w000/1/1"], {**row, "answer": answer}, [([2], "x"), ([3], "y")], [None, None]))))
        t.start()
        assert entered.wait(10) and scorer.waiting == 1
        release.set()
        t.join(10)
        assert scorer.waiting == 0
        assert out == ([[(0.5, {}), (0.5, {})]] if not answer else ["RewardWaitTimeout"])


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test compares the exception's type
        return type(e).__name__


# ---- the models and the service ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def disrm_folder(tmp_path_factory):
    """A random tiny sequence classifier on the tiny tokenizer (the shape of builtin:tiny-rm, untrained)."""
    from transformers import Qwen2ForSequenceClassification

    out = tmp_path_factory.mktemp("disrm") / "rm"
    tok = build_tokenizer()
    config = tiny_config(32, tok)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    torch.manual_seed(3)
    with quiet_progress_bars():
        Qwen2ForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("judge") / "judge", seed=5, head_dim=64)


def _items(n: int, seed: int = 0) -> list[ScoreItem]:
    g = torch.Generator().manual_seed(seed)
    tok = build_tokenizer()
    out = []
    for i in range(n):
        prompt = f"repeat {'abcdefgh'[i % 8]}"
        resp = torch.randint(3, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(ScoreItem(prompt=prompt, prompt_ids=tok(prompt)["input_ids"], response_ids=resp + [tok.eos_token_id],
                             response=tok.decode(resp, skip_special_tokens=True), ground_truth="c c", data_source="x"))
    return out


def _offline_disrm(folder, items) -> list[float]:
    """The same model, loaded by transformers' own class, one sequence at a time, no padding."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    model.config.pad_token_id = None  # one sequence, scored at its last token even when that is a sampled <pad>
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([it.prompt_ids + it.response_ids])).logits[0, -1].item() for it in items]


class Service:
    """A reward service in this process, announced in a run directory as a reward job does."""

    def __init__(self, rd: RunDir, model, job: str = "reward-0", secret: bytes = b"s3cret"):
        self.server = RewardServer(model, secret, job, epoch=f"e-{job}-{time.monotonic_ns()}")
        self.record = RewardService(job=job, host="127.0.0.1", port=self.server.port, epoch=self.server.epoch,
                                    pid=0, kind=model.kind, created_s=time.time())
        rd.reward_service().mkdir(parents=True, exist_ok=True)
        rd.reward_service(job).write_text(__import__("json").dumps(self.record.to_json()))

    def close(self, rd: RunDir) -> None:
        self.server.close()
        rd.reward_service(self.record.job).unlink(missing_ok=True)


def _run_dir(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run").create()
    rd.secret.write_text("s3cret")
    return rd


@pytest.mark.slow  # real models behind real sockets: seconds each
def test_a_discriminative_models_served_scores_equal_an_offline_call(tmp_path, disrm_folder):
    """The reward job's model behind its socket, several clients' requests batched together, padded and cut into
    micro-batches: each score equals transformers' own call on that sequence alone."""
    cfg = RewardModelConfig(enable=True, path=str(disrm_folder), micro_batch_size=3)
    model = DiscriminativeRM(disrm_folder, build_tokenizer(), cfg, "cpu", "float32")
    assert model_kind(disrm_folder, "auto") == "discriminative" and model.head is not None
    rd = _run_dir(tmp_path)
    svc = Service(rd, model)
    try:
        client = RewardClient(rd, "rollout-w000", request_timeout_s=30, wait_s=30, wait_log_s=10)
        groups = [_items(8, seed) for seed in range(4)]
        results: dict[int, list] = {}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, client.score(groups[k], "t", lambda: False)))
                   for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for k, items in enumerate(groups):
            got = [s.score for s in results[k]]
            assert got == pytest.approx(_offline_disrm(disrm_folder, items), abs=1e-5)
        assert svc.server.stats.items == 32 and svc.server.stats.requests == 4
    finally:
        svc.close(rd)


def _offline_judge(folder, prompt_ids: list[int], max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=0, eos_token_id=1)
    return build_tokenizer().decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


@pytest.mark.slow  # real models behind real sockets: seconds each
def test_a_generative_judges_served_scores_equal_an_offline_call(tmp_path, judge_folder):
    """The judge (the transformers engine, greedy) behind the socket: each verdict is transformers' own greedy
    ``generate`` of the same prompt, parsed by the same parser."""
    cfg = RunConfig(reward_model=RewardModelConfig(enable=True, path=str(judge_folder), max_new_tokens=12,
                                                   prompt_template="{prompt} {response} ?"))
    judge = GenerativeJudge(judge_folder, cfg, "cpu", "float32", start_s=120, generate_s=120)
    rd = _run_dir(tmp_path)
    svc = Service(rd, judge)
    try:
        items = _items(6, seed=9)
        client = RewardClient(rd, "rollout-w000", request_timeout_s=60, wait_s=30, wait_log_s=10)
        scored = client.score(items, "t", lambda: False)
        for item, s in zip(items, scored):
            text = _offline_judge(judge_folder, judge.inputs.ids(item), 12)
            assert s.text == text
            assert s.score == last_number(text)
        assert client.generate(["repeat a ?"], 4, True, "t", lambda: False)[0] == \
            _offline_judge(judge_folder, judge.inputs.prompt_ids("repeat a ?"), 4)
    finally:
        svc.close(rd)
        judge.close()


def test_the_handshake_refuses_a_stranger_both_ways_and_a_frame_is_bounded():
    a, b = socket.socketpair()
    service = RewardService(job="reward-0", host="h", port=1, epoch="e1", pid=0, kind="discriminative", created_s=0)
    errors: list[Exception] = []

    def serve():
        try:
            server_handshake(b, b"right", "reward-0", "e1")
        except WireError as e:
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(WireError, match="refused this job"):
        client_handshake(a, b"wrong", "rollout-w000", service)
    t.join(10)
    assert errors and "proof does not match" in str(errors[0])
    send_frame(a, {"x": 1})
    assert recv_frame(b) == {"x": 1}
    a.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(WireError, match="not a reward-service peer"):
        recv_frame(b)
    a.close()
    b.close()


@pytest.mark.slow  # real models behind real sockets: seconds each
def test_requests_spread_over_reward_jobs_retry_when_one_dies_and_wait_boundedly(tmp_path, disrm_folder):
    cfg = RewardModelConfig(enable=True, path=str(disrm_folder))
    rd = _run_dir(tmp_path)
    client = RewardClient(rd, "rollout-w000", request_timeout_s=10, wait_s=1.0, wait_log_s=0.2)
    with pytest.raises(RewardWaitTimeout, match="no reward job answered for .*no reward job has written"):
        client.score(_items(1), "scoring w000/7", lambda: False)
    with pytest.raises(RewardWaitStopped):
        client.score(_items(1), "scoring w000/7", lambda: True)
    model = DiscriminativeRM(disrm_folder, build_tokenizer(), cfg, "cpu", "float32")
    one, two = Service(rd, model, "reward-0"), Service(rd, model, "reward-1")
    client.wait_s = 30
    want = _offline_disrm(disrm_folder, _items(2))
    pool = [threading.Thread(target=lambda: client.score(_items(2), "t", lambda: False)) for _ in range(16)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert set(client.sent_to) == {"reward-0", "reward-1"}, client.sent_to
    two.close(rd)  # gone for good, its record withdrawn
    one.server.close()  # killed: its record stays, its port is closed (the kept connections fail)
    back: list = []
    threading.Timer(1.0, lambda: back.append(Service(rd, model, "reward-0"))).start()  # its restart: new port, epoch
    try:
        assert [s.score for s in client.score(_items(2), "t", lambda: False)] == pytest.approx(want, abs=1e-5)
        assert client.retries >= 1 and client.sent_to["reward-0"] >= 1
    finally:
        time.sleep(1.2)
        back[0].close(rd)


@pytest.mark.slow  # real models behind real sockets: seconds each
def test_the_local_placement_batches_group_threads_and_counts_what_it_did(disrm_folder):
    cfg = RewardModelConfig(enable=True, path=str(disrm_folder), placement="rollout")
    rewards = ModelRewards(LocalBackend(DiscriminativeRM(disrm_folder, build_tokenizer(), cfg, "cpu", "float32")),
                           build_tokenizer())
    items = _items(3)
    row = {"prompt": items[0].prompt, "prompt_ids": items[0].prompt_ids, "answer": "c", "data_source": "x",
           "extra_info": None}
    scores = rewards.group_scores(row, [(it.response_ids, it.response) for it in items], "t", lambda: False)
    assert scores == pytest.approx(_offline_disrm(disrm_folder, [ScoreItem(
        prompt=row["prompt"], prompt_ids=row["prompt_ids"], response_ids=it.response_ids, response=it.response)
        for it in items]), abs=1e-5)
    handle = rewards.handle(row, lambda: False)
    assert handle.score("c c") is not None
    m = rewards.pop_metrics()
    assert m["reward_model/groups"] == 1 and m["timing_s/reward"] > 0 and m["reward_model/problems"] == 0
    rewards.close()


def test_the_launcher_plans_reward_jobs_and_their_sbatch_array(tmp_path):
    from hpcrl.launcher.sbatch_lines import sbatch_lines
    from hpcrl.launcher.submit import plan_jobs

    cfg = load_config(TINY, [*RM, "resources.reward_jobs=2", "resources.reward.gpus_per_node=1",
                             "reward_model.device=cuda"])
    rd = RunDir(tmp_path / "run")
    names = [j.name for j in plan_jobs(cfg, rd)]
    assert names[-2:] == ["reward-0", "reward-1"]
    line = sbatch_lines(cfg, rd, tmp_path, "python")[-1]
    assert "--array=0,1" in line and "reward.sbatch" in line and "--gpus-per-node=1" in line, line
    local = load_config(TINY, [*RM, "reward_model.placement=rollout"])
    assert not any(j.name.startswith("reward-") for j in plan_jobs(local, rd))


@pytest.mark.slow  # real models behind real sockets: seconds each
def test_a_damaged_or_late_reply_is_named_and_the_request_goes_elsewhere(tmp_path, disrm_folder, caplog):
    """A stranger that passes the handshake but answers another request's id, then one that never answers: each is
    named in the log, left alone, and the request is answered by the good reward job that announces itself later."""
    import json

    rd = _run_dir(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def bad_server():
        for mode in ("wrong id", "silent"):
            conn, _ = listener.accept()
            server_handshake(conn, b"s3cret", "reward-9", "bad")
            req = recv_frame(conn)
            if mode == "wrong id":
                send_frame(conn, {"id": req["id"] + 1, "scores": [0.5]})
            else:
                time.sleep(3)
            conn.close()

    threading.Thread(target=bad_server, daemon=True).start()
    rd.reward_service().mkdir(parents=True, exist_ok=True)
    rd.reward_service("reward-9").write_text(json.dumps(RewardService(
        job="reward-9", host="127.0.0.1", port=port, epoch="bad", pid=0, kind="discriminative", created_s=0).to_json()))
    client = RewardClient(rd, "rollout-w000", request_timeout_s=1.0, wait_s=60, wait_log_s=10)
    model = DiscriminativeRM(disrm_folder, build_tokenizer(), RewardModelConfig(enable=True, path=str(disrm_folder)),
                             "cpu", "float32")
    good: list = []
    threading.Timer(4.0, lambda: good.append(Service(rd, model, "reward-0"))).start()
    with caplog.at_level("WARNING", logger="hpcrl.reward"):
        scored = client.score(_items(1), "scoring w000/3", lambda: False)
    text = caplog.text
    assert "reward-9" in text and "a reply to request" in text and "no reply in 1s" in text, text
    assert scored[0].score == pytest.approx(_offline_disrm(disrm_folder, _items(1))[0], abs=1e-5)
    assert client.sent_to == {"reward-0": 1} and client.retries >= 2
    good[0].close(rd)
    listener.close()
