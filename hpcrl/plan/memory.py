"""Will the trainer fit? Its peak memory per GPU, predicted from the config and the model's ``config.json``, and
the check ``hpcrl run`` (and its dry run) and ``hpcrl plan`` make with it (:func:`memory_lines`): with
``resources.trainer.gpu_memory_gib`` set, a config whose prediction does not fit is refused in one line naming the
prediction, its largest term, and the settings that would make it fit (tried in order, cheapest first) with what
they predict; without it the prediction is shown, unchecked. A CPU trainer is not predicted (the sizing probe
measures its host memory: docs/long-responses.md).

The terms (bytes per trainer GPU; W the trainer's ranks, sp the sequence-parallel size, d the training dtype's
bytes, P the model's parameters, Pt the trained ones: P, or the LoRA adapter's):

- **parameters**: P d; ZeRO-3 P d / W plus what is gathered at once (the larger of the embedding and two
  layers); with ``offload_param`` only that working set (the rest sits in host memory);
- **gradients**: Pt x 4 x 1.5 (ZeRO 0: fp32 accumulation and the step's temporaries, :data:`ZERO0_GRADIENT_COPIES`),
  Pt d + Pt 4 / W (ZeRO 1), Pt 4 / W (ZeRO 2), Pt (d + 4) / W (ZeRO 3), plus DeepSpeed's communication buckets
  (:data:`BUCKET_ELEMENTS` elements, twice);
- **optimizer**: Adam's two moments and, in bf16, the fp32 master weights: Pt (8 + 4) / W for ZeRO >= 1 (Pt 8,
  ZeRO 0 fp32); nothing with ``offload_optimizer``;
- **reference** (a KL term, full fine-tuning): a second copy of the parameters under the same rules;
- **activations** of the largest micro-batch (N tokens, N / sp on each GPU of a sequence-parallel group): per token
  and layer :func:`layer_bytes_per_token`, plus what sits outside the layers (embeddings, final norm, the backward's
  temporaries: (9 d + 32) h per token); with ``gradient_checkpointing`` what each layer keeps
  (:data:`CHECKPOINTED_LAYER_HD` h d per token and layer: its input and what the recompute holds) plus, at the
  peak, one layer recomputed with its backward's temporaries ((12 d + 40) h more per token). Measured on CPU in fp32 (per token, two and four layers, hidden 256 / 512 / 896, MLP
  4 h / 5.4 h): 118.6 KiB per layer at hidden 896 (predicted 121.5), totals within 8 %;
- **log-probs**: one chunk of ``actor.logprob_chunk_mib`` of float32 logits (its log-softmax and gradients reuse
  what the chunk's recompute frees), or the whole response's if that is smaller. The checkpointed terms were fitted
  to the trainer's own update on the Qwen2.5-0.5B shape with 2 and 24 layers (bench/bench_trainer_memory.py:
  measured and predicted side by side; within 25 % of each case there).

N is the largest micro-batch a config can form: with ``use_dynamic_bsz`` the larger of the budget and the
longest sequence (prompt + ``rollout.response_length``: a longer row runs alone), else ``ppo_micro_batch_size``
groups of ``rollout.n`` rows at the longest sequence. The no-grad passes before the update keep no activations
and are smaller. What torch's allocator adds (fragmentation) and the CUDA context are not terms: the check keeps
:data:`HEADROOM` of the GPU free for them. The terms were measured on CPU in fp32 (bench/bench_trainer_memory.py
prints prediction and measurement side by side); no GPU has checked them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from hpcrl.config.checks import bad
from hpcrl.config.names import BUILTIN_MODELS

GIB = 2**30
BUCKET_ELEMENTS = 50_000_000
"""DeepSpeed's reduce and all-gather buckets, elements (hpcrl/trainer/build.py sets them)."""
CHECKPOINTED_LAYER_HD = 5.75
"""Bytes a checkpointed layer keeps per token, in units of hidden x dtype bytes: its input (1), and what the
non-reentrant recompute and the rotary and norm inputs hold (measured: the full-depth 0.5B shape, fp32, one response
of 2,048 and of 8,192 tokens through the trainer's update, bench/bench_trainer_memory.py). Measured as the host's
high-water mark, which includes glibc heap the process could not reuse: a plain transformers step with every large
tensor its own mapping (``MALLOC_MMAP_THRESHOLD_=131072``) kept 1.0 per layer, so on a GPU's allocator this term may
be ~5x too large (conservative) until it is refitted against ``torch.cuda.max_memory_allocated``."""
ZERO0_GRADIENT_COPIES = 1.5
"""Without ZeRO, float32 gradients held at the update's peak, in copies of the trained parameters (the step's
temporaries: fitted with :data:`CHECKPOINTED_LAYER_HD` to the 2- and 24-layer 0.5B shapes)."""
HEADROOM = 0.10
"""Share of the GPU's memory the check leaves for the allocator's fragmentation, the CUDA context and NCCL."""
CONTEXT_GIB = 1.0
"""Memory outside torch's allocator (the CUDA context, NCCL's buffers), GiB, also left free."""


@dataclass(frozen=True)
class ModelShape:
    """What the prediction needs of a decoder-only transformer (from its ``config.json``)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    params: int
    """All parameters (0: computed from the shape)."""
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * self.intermediate + 2 * h

    @property
    def total_params(self) -> int:
        if self.params:
            return self.params
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @classmethod
    def of_folder(cls, folder: Path) -> "ModelShape":
        """The shape in ``folder/config.json`` (a Hugging Face model folder)."""
        return cls.of_file(Path(folder) / "config.json")

    @classmethod
    def of_file(cls, path: Path) -> "ModelShape":
        """The shape in a model's ``config.json`` (the text config of a multimodal one)."""
        cfg = json.loads(Path(path).read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        return cls(vocab=int(cfg["vocab_size"]), hidden=int(cfg["hidden_size"]),
                   intermediate=int(cfg.get("intermediate_size", 4 * cfg["hidden_size"])),
                   layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads), params=0,
                   tied=bool(cfg.get("tie_word_embeddings", False)))


def layer_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> float:
    """Activations one decoder layer keeps per token for its backward: q, k, v with their rotary copies, the
    attention output, the MLP's gate, up, activation and product in the training dtype, and the two RMS norms'
    float32 copies (module docstring)."""
    return dtype_bytes * (9 * shape.hidden + 4 * shape.intermediate) + 16 * shape.hidden


def update_working_bytes(shape: ModelShape, *, tokens: int, rows: int, response_tokens: int, checkpointing: bool,
                         dtype_bytes: int, chunk_mib: Optional[float]) -> float:
    """Activations and logits of one micro-batch of ``tokens`` tokens (``rows`` rows, ``response_tokens`` of them
    predicted) on one GPU; ``chunk_mib`` None: the padded path before 2026-12-06 (the whole ``[B, T, V]`` logits and
    six float32 ``[B, L, V]`` copies around the log-softmax)."""
    d, h = dtype_bytes, shape.hidden
    per_layer = layer_bytes_per_token(shape, d)
    if checkpointing:  # what each checkpointed layer keeps, and at the peak one layer recomputed with its backward's
        # temporaries
        acts = tokens * (shape.layers * CHECKPOINTED_LAYER_HD * h * d + per_layer + (12 * d + 40) * h)
    else:  # every layer's activations, and what sits outside them (embeddings, final norm, backward temporaries)
        acts = tokens * (shape.layers * per_layer + (9 * d + 32) * h)
    if chunk_mib is None:  # the whole [B, T, V] logits, then [B, L, V] gathered and three float32 copies of it
        logits = tokens * shape.vocab * d + response_tokens * shape.vocab * (d + 12)
    else:  # one chunk's float32 logits (its log-softmax and gradients reuse what the chunk's recompute frees)
        logits = min(chunk_mib * 2**20, response_tokens * shape.vocab * 4.0)
    return acts + logits


@dataclass
class MemoryTerms:
    """The predicted peak of one trainer GPU, by term (bytes)."""

    parameters: float
    gradients: float
    optimizer: float
    reference: float
    activations: float
    """Activations and log-prob chunks of the largest micro-batch."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.reference + self.activations

    def largest(self) -> tuple[str, float]:
        named = {"parameters": self.parameters, "gradients": self.gradients, "optimizer states": self.optimizer,
                 "the KL reference's parameters": self.reference, "activations and logits": self.activations}
        return max(named.items(), key=lambda kv: kv[1])

    def line(self) -> str:
        return (f"{self.total / GIB:.1f} GiB (parameters {self.parameters / GIB:.1f}, gradients "
                f"{self.gradients / GIB:.1f}, optimizer {self.optimizer / GIB:.1f}, reference {self.reference / GIB:.1f}, "
                f"activations and logits {self.activations / GIB:.1f})")


def lora_params(shape: ModelShape, rank: int, targets) -> int:
    """Adapter parameters of rank ``rank`` on the named projections of every layer (all-linear: all seven)."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    names = dims if targets == "all-linear" else [t for t in targets if t in dims]
    return shape.layers * rank * sum(sum(dims[n]) for n in names)


def largest_micro_tokens(cfg) -> tuple[int, int, int]:
    """(tokens, rows, response tokens) of the largest micro-batch the config can form on one GPU (module docstring)."""
    actor, n = cfg.actor, cfg.rollout.n
    longest = (cfg.data.max_prompt_length or 0) + cfg.rollout.response_length
    sp = actor.ulysses_sequence_parallel_size
    if actor.use_dynamic_bsz:
        group_tokens = max(actor.ppo_max_token_len_per_gpu * sp, longest)
        rows = max(1, group_tokens // max(longest, 1))
        return math.ceil(group_tokens / sp), rows, math.ceil(min(group_tokens, rows * cfg.rollout.response_length) / sp)
    rows = actor.ppo_micro_batch_size * n
    return math.ceil(rows * longest / sp), rows, math.ceil(rows * cfg.rollout.response_length / sp)


def predict(cfg, shape: ModelShape, world: int, cuda: bool = True) -> MemoryTerms:
    """The peak of one trainer GPU (``world`` trainer ranks) under ``cfg`` (module docstring)."""
    actor = cfg.actor
    d = 2 if actor.bf16_on(cuda) else 4
    P = shape.total_params
    Pt = lora_params(shape, actor.lora_rank, actor.lora_target_modules) if cfg.lora else P
    live = max(shape.vocab * shape.hidden, 2 * shape.layer_params) * d
    stage, W = actor.zero_stage, max(1, world)
    if stage < 3:
        params = P * d
    else:
        params = live + (0 if actor.offload_param else P * d / W)
    bucket = 2 * BUCKET_ELEMENTS * d if stage >= 2 else 0
    grads = {0: Pt * 4 * ZERO0_GRADIENT_COPIES, 1: Pt * d + Pt * 4 / W, 2: Pt * 4 / W,
             3: Pt * (d + 4) / W}[stage] + bucket
    if cfg.lora:
        grads = Pt * 4 + bucket
    master = 4 if d == 2 else 0
    optimizer = 0.0 if actor.offload_optimizer else Pt * (8 + master) / (W if stage >= 1 else 1)
    reference = params if (cfg.needs_reference and not cfg.lora) else 0.0
    tokens, rows, resp = largest_micro_tokens(cfg)
    acts = update_working_bytes(shape, tokens=tokens, rows=rows, response_tokens=resp,
                                checkpointing=actor.gradient_checkpointing, dtype_bytes=d,
                                chunk_mib=actor.logprob_chunk_mib)
    return MemoryTerms(params, grads, optimizer, reference, acts)


def usable_gib(gpu_memory_gib: float) -> float:
    """Of a GPU's memory, what the prediction may fill (:data:`HEADROOM`, :data:`CONTEXT_GIB`)."""
    return gpu_memory_gib * (1 - HEADROOM) - CONTEXT_GIB


FIXES = (
    ("actor.gradient_checkpointing=true", {"gradient_checkpointing": True}),
    ("actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=16384",
     {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 16384}),
    ("actor.zero_stage=3", {"zero_stage": 3}),
    ("actor.offload_optimizer=true", {"offload_optimizer": True}),
    ("actor.offload_param=true", {"offload_param": True}),
    ("actor.ulysses_sequence_parallel_size=2", {"ulysses_sequence_parallel_size": 2}),
    ("actor.ulysses_sequence_parallel_size=4", {"ulysses_sequence_parallel_size": 4}),
    ("actor.ulysses_sequence_parallel_size=8", {"ulysses_sequence_parallel_size": 8}),
    ("actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=8192",
     {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 8192}),
)
"""What the check tries, in order, cumulatively: the cheapest settings first (checkpointing costs ~1/3 more compute,
offload costs host-to-GPU copies, sequence parallelism needs more GPUs per sequence)."""


def fitting_settings(cfg, shape: ModelShape, world: int, gpu_memory_gib: float) -> Optional[tuple[list[str], MemoryTerms]]:
    """The settings of :data:`FIXES`, added in order until the prediction fits (each kept only if the config can take
    it: sequence parallelism must divide the ranks and the heads), and the prediction then; None if none fits."""
    import copy

    trial, chosen = copy.deepcopy(cfg), []
    for words, fields in FIXES:
        sp = fields.get("ulysses_sequence_parallel_size", trial.actor.ulysses_sequence_parallel_size)
        if sp > 1 and (world % sp or shape.heads % sp or not (shape.kv_heads % sp == 0 or sp % shape.kv_heads == 0)):
            continue
        if all(getattr(trial.actor, k) == v for k, v in fields.items()):
            continue
        trial.actor = replace(trial.actor, **fields)
        chosen = [c for c in chosen if not c.startswith("actor.ulysses") or "ulysses" not in words] + [words]
        terms = predict(trial, shape, world)
        if terms.total <= usable_gib(gpu_memory_gib) * GIB:
            return chosen, terms
    return None


def model_shape(cfg) -> Optional[ModelShape]:
    """The shape of ``model.path`` (None: a built-in model, or a folder without a readable config.json)."""
    if cfg.model.path in BUILTIN_MODELS:
        return None
    folder = Path(cfg.model.path).expanduser()
    try:
        return ModelShape.of_folder(folder)
    except (OSError, ValueError, KeyError):
        return None


def memory_lines(cfg, shape: Optional[ModelShape] = None, world: Optional[int] = None) -> list[str]:
    """The prediction's line (none on a CPU trainer or without a model shape); ConfigError when it does not fit
    ``resources.trainer.gpu_memory_gib`` (module docstring)."""
    res = cfg.resources.trainer
    shape = shape or model_shape(cfg)
    if res.gpus_per_node == 0 or shape is None:
        return []
    world = world or res.world_size
    terms = predict(cfg, shape, world)
    what = (f"trainer memory per GPU (predicted, {world} ranks, {shape.total_params / 1e9:.2f}B parameters): "
            f"{terms.line()}")
    gib = res.gpu_memory_gib
    if gib is None:
        return [what + "; not checked: set resources.trainer.gpu_memory_gib (e.g. 80) to refuse a config that "
                "cannot fit"]
    usable = usable_gib(gib)
    if terms.total <= usable * GIB:
        return [what + f"; fits {usable:.0f} of the {gib:g} GiB (resources.trainer.gpu_memory_gib)"]
    name, size = terms.largest()
    found = fitting_settings(cfg, shape, world, gib)
    fix = (f"add {' '.join(found[0])} (predicted {found[1].total / GIB:.1f} GiB)" if found else
           "no actor.* setting fits: give the trainer more GPUs (resources.trainer.nodes) or a smaller "
           "rollout.response_length")
    raise bad("resources.trainer.gpu_memory_gib", gib,
              f"a GPU that holds the trainer's predicted peak of {terms.total / GIB:.1f} GiB per GPU ({usable:.0f} of "
              f"{gib:g} GiB may be filled; largest term: {name}, {size / GIB:.1f} GiB)", fix)
