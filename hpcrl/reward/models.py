"""The reward models: a discriminative one (an HF sequence classifier scored at the last token) and a generative
judge (a causal LM on an hpcrl engine, its verdict parsed into a score). Both take :class:`ScoreItem` lists and give
one :class:`Scored` per item; a reward job serves one of them, or a rollout job holds one (``reward_model.placement``).

**Discriminative.** Inputs (``inputs.py``) are sorted by length and cut into the micro-batches of least padding (of at
most ``reward_model.micro_batch_size`` sequences and ``max_batch_tokens`` padded tokens; on a CPU, split further
where that saves more padding than a forward costs: :func:`micro_batches`), padded on the right, and the
model's score head is applied to the hidden state of each sequence's last token (verl's DisRM score: the last
token's logit of the last label). Right padding under a causal mask leaves every real token's hidden state as it is
without padding, so a score does not depend on its batch (to float rounding). A model whose head is not found
(``score`` or ``classifier``, a linear layer) is scored by its own pooling instead, which reads the last token that
is not the pad token.

**Generative.** Each response's judge prompt goes to the engine ``reward_model.engine`` names (``auto``: the rollout
job's, ``rollout.engine``), started by ``rollout/engines.py`` as the rollout job starts its own, the judge's settings
in place of the rollout section's engine options (:func:`judge_run_config`), at ``reward_model.temperature`` (0: greedy) with a seed derived from
``reward_model.seed`` and the prompt's tokens, so the same response always gets the same verdict; the decoded text
goes through ``reward_model.score_parser``.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from hpcrl.config.reward_model import RewardModelConfig
from hpcrl.reward.inputs import DiscriminativeInputs, InputTooLong, JudgeInputs, Truncation
from hpcrl.reward.parsers import load_parser, parse_score
from hpcrl.reward.wire import ScoreItem, Scored
from hpcrl.tiny.model import load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DISCRIMINATIVE, GENERATIVE = "discriminative", "generative"


class RewardModelLoadError(ValueError):
    """The reward model folder cannot be used (one line: what, and the fix)."""


def model_kind(folder: Path, kind: str) -> str:
    """``reward_model.kind``, ``auto`` read from the folder's ``config.json`` architectures; RewardModelLoadError."""
    if kind != "auto":
        return kind
    try:
        archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise RewardModelLoadError(f"reward_model.path {folder}: no readable config.json ({e}); fix: point it at an "
                                   "HF model folder") from None
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return DISCRIMINATIVE
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs):
        return GENERATIVE
    raise RewardModelLoadError(f"reward_model.path {folder}: architectures {archs} are neither a sequence classifier "
                               "nor a causal LM; fix: set reward_model.kind to discriminative or generative")


def configured_kind(rm: RewardModelConfig) -> str:
    """The kind of model ``reward_model`` names: a built-in one's by its name, a folder's by :func:`model_kind`
    (RewardModelLoadError)."""
    if rm.builtin:
        return GENERATIVE if rm.path == "builtin:tiny-judge" else DISCRIMINATIVE
    return model_kind(Path(rm.path).expanduser(), rm.kind)


def resolve_device(device: str) -> str:
    """``auto`` -> cuda where this process sees a GPU, else cpu."""
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> bfloat16 on cuda, float32 on cpu."""
    return dtype if dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")


CPU_FORWARD_TOKENS = 64
"""What one forward costs beyond its tokens on a CPU, in padded tokens (measured with bench/bench_reward.py's model:
~5 ms a forward, ~0.08 ms a token): a micro-batch is split where that saves more padding than this. On a GPU a
forward's tokens are nearly free below the micro-batch's limits: the fewest forwards (:data:`FEWEST_FORWARDS`)."""
FEWEST_FORWARDS = 1 << 40


def micro_batches(lengths: list[int], max_seqs: int, max_tokens: Optional[int],
                  forward_tokens: int = FEWEST_FORWARDS) -> list[list[int]]:
    """Indices of ``lengths`` longest first, cut into the batches of least cost: each at most ``max_seqs``
    sequences and (when set) ``max_tokens`` padded tokens (a longer sequence is a batch alone), each costing its
    padded tokens (its count times its longest) plus ``forward_tokens`` (a forward's own cost; the default: the
    fewest batches, then the least padding). Exact, by dynamic programming over the cut points of the sorted
    lengths, in O(len(lengths) * max_seqs)."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    ls = [lengths[k] for k in order]
    best = [0] + [math.inf] * len(ls)  # best[j]: the least cost of the first j; cut[j]: where its last batch starts
    cut = [0] * (len(ls) + 1)
    for j in range(1, len(ls) + 1):
        for i in range(max(0, j - max_seqs), j):  # the last batch is ls[i:j], padded to ls[i]
            if j - i > 1 and max_tokens is not None and (j - i) * ls[i] > max_tokens:
                continue
            cost = best[i] + forward_tokens + (j - i) * ls[i]
            if cost < best[j]:  # ties: the longer batch (found first)
                best[j], cut[j] = cost, i
    batches, j = [], len(ls)
    while j:
        batches.append(order[cut[j]:j])
        j = cut[j]
    return batches[::-1]


class RewardModel(abc.ABC):
    """What a reward job serves (module docstring)."""

    kind: str = ""
    batched: bool = False
    """Items of several requests are batched together (a discriminative forward: the model has :meth:`prepare`,
    :meth:`plan` and :meth:`forward`, which ``server.Batcher`` drives); else each request is its own call (a judge's
    engine batches concurrent requests itself)."""

    @abc.abstractmethod
    def score(self, items: list[ScoreItem]) -> list[Scored]:
        """One :class:`Scored` per item (a bad item has a problem, never an exception)."""

    def generate(self, prompts: list[Any], max_new_tokens: Optional[int], greedy: bool) -> list[str]:
        """A generative judge's answer to each free prompt (a hybrid reward function's own call)."""
        raise NotImplementedError("a discriminative reward model generates no text; use score (rm_score)")

    def describe(self) -> str:
        """One line for the job's log."""
        return self.kind

    def close(self) -> None:
        """Release the model (and an engine's processes)."""


class DiscriminativeRM(RewardModel):
    """An HF sequence classifier scored at the last token (module docstring)."""

    kind, batched = DISCRIMINATIVE, True

    def __init__(self, folder: Path, policy_tokenizer, cfg: RewardModelConfig, device: str, dtype: str):
        from transformers import AutoModelForSequenceClassification

        self.folder, self.device, self.cfg = Path(folder), device, cfg
        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=DTYPES[dtype], trust_remote_code=cfg.trust_remote_code).to(device).eval()
        self.tokenizer = load_tokenizer(folder)
        limit = cfg.max_length or getattr(self.model.config, "max_position_embeddings", None)
        self.inputs = DiscriminativeInputs(self.tokenizer, policy_tokenizer, Truncation(limit, cfg.truncation))
        self.backbone = getattr(self.model, self.model.base_model_prefix, None)
        head = getattr(self.model, "score", None) or getattr(self.model, "classifier", None)
        self.head = head if isinstance(head, torch.nn.Linear) and self.backbone is not None else None
        pad = self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.pad_token_id or 0)

    def describe(self) -> str:
        return (f"discriminative {type(self.model).__name__} from {self.folder} on {self.device}; inputs: "
                f"{self.inputs.describe()}; score: {'the head at the last token' if self.head is not None else 'its own pooling'}")

    def prepare(self, item: ScoreItem) -> list[int] | Scored:
        """The item's model input, or its :class:`Scored` problem (too long, empty, unreadable)."""
        try:
            ids = self.inputs.ids(item)
        except (InputTooLong, ValueError, TypeError) as e:
            return Scored(None, problem=str(e))
        return ids if ids else Scored(None, problem="an empty input")

    def plan(self, lengths: list[int]) -> list[list[int]]:
        """Inputs of these lengths cut into forwards (:func:`micro_batches`, a forward's cost for this device)."""
        forward_tokens = CPU_FORWARD_TOKENS if torch.device(self.device).type == "cpu" else FEWEST_FORWARDS
        return micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.max_batch_tokens, forward_tokens)

    def score(self, items: list[ScoreItem]) -> list[Scored]:
        out: list[Scored] = [Scored(None)] * len(items)
        seqs: list[list[int]] = []
        where: list[int] = []
        for i, item in enumerate(items):
            ids = self.prepare(item)
            if isinstance(ids, Scored):
                out[i] = ids
                continue
            seqs.append(ids)
            where.append(i)
        for batch in self.plan([len(s) for s in seqs]):
            for k, value in zip(batch, self.forward([seqs[k] for k in batch])):
                out[where[k]] = Scored(value)
        return out

    @torch.inference_mode()
    def forward(self, seqs: list[list[int]]) -> list[float]:
        """The score of each token sequence (one padded forward)."""
        lengths = torch.tensor([len(s) for s in seqs])
        ids = torch.full((len(seqs), int(lengths.max())), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[r, :len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.head is not None:
            hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(seqs), device=hidden.device), lengths.to(hidden.device) - 1]
            logits = self.head(last)
        else:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        return logits[:, -1].float().cpu().tolist()

    def close(self) -> None:
        self.model = None


def judge_seed(seed: int, prompt_ids: list[int]) -> int:
    """The sampling seed of one judge prompt: from ``reward_model.seed`` and the prompt's tokens."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=8,
                             key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") % (2**63)


class GenerativeJudge(RewardModel):
    """A causal LM judge on an hpcrl engine (module docstring)."""

    kind, batched = GENERATIVE, False

    def __init__(self, folder: Path, run: Any, device: str, dtype: str, start_s: float, generate_s: float):
        """``run``: the RunConfig (its ``reward_model`` section; its engine options, :func:`judge_run_config`)."""
        from hpcrl.rollout.engine import EngineOptions, EngineRunner
        from hpcrl.rollout.engines import make_engine

        cfg = run.reward_model
        self.folder, self.cfg, self.generate_s = Path(folder), cfg, generate_s
        self.tokenizer = load_tokenizer(folder)
        limit = cfg.max_length or _max_positions(folder)
        self.inputs = JudgeInputs(self.tokenizer, cfg.prompt_template, Truncation(
            limit - cfg.max_new_tokens if limit else None, cfg.truncation))
        self.parser = load_parser(cfg.score_parser)
        self.engine_name = cfg.engine if cfg.engine != "auto" else run.rollout.engine
        self.runner = EngineRunner()
        opts = EngineOptions(model_dir=self.folder, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                             top_p=cfg.top_p, device=device, dtype=dtype, seed=cfg.seed)
        try:
            self.engine = make_engine(self.engine_name, opts, judge_run_config(run, limit), self.runner, start_s)
        except BaseException:
            self.runner.close()
            raise

    def describe(self) -> str:
        return (f"generative judge from {self.folder} on the {self.engine_name} engine (temperature "
                f"{self.cfg.temperature}, up to {self.cfg.max_new_tokens} tokens, parser {self.cfg.score_parser})")

    def score(self, items: list[ScoreItem]) -> list[Scored]:
        out: list[Scored] = [Scored(None)] * len(items)
        prompts, where = [], []
        for i, item in enumerate(items):
            try:
                prompts.append(self.inputs.ids(item))
                where.append(i)
            except (InputTooLong, ValueError, KeyError, IndexError) as e:
                out[i] = Scored(None, problem=str(e))
        for i, text in zip(where, self._generate(prompts, None, self.cfg.temperature == 0)):
            value, problem = parse_score(self.parser, text)
            out[i] = Scored(value, text, problem)
        return out

    def generate(self, prompts: list[Any], max_new_tokens: Optional[int], greedy: bool) -> list[str]:
        return self._generate([self.inputs.prompt_ids(p) for p in prompts], max_new_tokens,
                              greedy or self.cfg.temperature == 0)

    def _generate(self, prompts: list[list[int]], max_new_tokens: Optional[int], greedy: bool) -> list[str]:
        """Decoded answers to token prompts, all requests in flight at once (the engine batches them)."""
        if not prompts:
            return []

        async def all_of_them():
            return await asyncio.gather(*(self.engine.generate(p, 1, judge_seed(self.cfg.seed, p), max_new_tokens,
                                                               greedy) for p in prompts))

        calls = self.runner.call(all_of_them, self.generate_s, f"the judge answering {len(prompts)} prompts")
        return [self.tokenizer.decode(c[0].response_ids, skip_special_tokens=True) for c in calls]

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.runner.close()


def _max_positions(folder: Path) -> Optional[int]:
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def judge_run_config(run: Any, max_model_len: Optional[int]) -> Any:
    """The run config a judge's engine is built from (``Engine.build(opts, cfg)``): the rollout section's engine
    options replaced by the judge's (``reward_model.gpu_memory_utilization``, ``tensor_parallel_size``,
    ``max_num_seqs``; its context ``max_model_len``), so that an engine reads its own options where it always does."""
    rm = run.reward_model
    return dataclasses.replace(run, rollout=dataclasses.replace(
        run.rollout, gpu_memory_utilization=rm.gpu_memory_utilization, max_model_len=max_model_len,
        tensor_parallel_size=rm.tensor_parallel_size, data_parallel_size=1, max_num_seqs=rm.max_num_seqs))


def load_reward_model(run: Any, folder: Path, policy_tokenizer) -> RewardModel:
    """The reward model of ``run.reward_model`` (``run``: the RunConfig) from ``folder`` (the policy's tokenizer
    decides how a discriminative model's inputs are built); RewardModelLoadError for a folder that is not one,
    anything transformers or the engine raise for one that does not load."""
    cfg, t = run.reward_model, run.timeouts
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise RewardModelLoadError(f"reward_model.path {folder} has no config.json; fix: point it at a local HF "
                                   "model folder (nothing is downloaded)")
    kind = model_kind(folder, cfg.kind)
    device = resolve_device(cfg.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise RewardModelLoadError("reward_model.device=cuda but this job sees no GPU; check resources.reward."
                                   "gpus_per_node (resources.rollout's with reward_model.placement=rollout)")
    dtype = resolve_dtype(cfg.dtype, device)
    if kind == DISCRIMINATIVE:
        return DiscriminativeRM(folder, policy_tokenizer, cfg, device, dtype)
    return GenerativeJudge(folder, run, device, dtype, t.engine_start_s, t.generate_s)
