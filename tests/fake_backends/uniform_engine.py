"""An engine that samples every token uniformly from the vocabulary: the smallest honest engine (its log-probs are
exactly those of the distribution it samples from, log 1/V). It ignores the weights it is given."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from hpcrl.rollout.engine import FINISH_LENGTH, FINISH_STOP, Engine, EngineOptions, Sample


class UniformEngine(Engine):
    """Uniform sampling over the model's vocabulary, EOS included (a response ends when it is drawn)."""

    def __init__(self, opts: EngineOptions):
        config = json.loads((Path(opts.model_dir) / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        eos = config.get("eos_token_id")
        self.eos_id = int(eos[0] if isinstance(eos, list) else eos if eos is not None else 0)
        self.max_new_tokens = opts.max_new_tokens
        self.versions: list[int] = []

    async def generate(self, prompt_ids: list[int], n: int, seed: int,
                       max_new_tokens: Optional[int] = None, greedy: bool = False) -> list[Sample]:
        cap = max_new_tokens or self.max_new_tokens
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            tokens = rng.integers(0, self.vocab, cap).astype(np.int32)
            stops = np.flatnonzero(tokens == self.eos_id)
            end = int(stops[0]) + 1 if len(stops) else cap
            out.append(Sample(tokens[:end], np.full(end, -math.log(self.vocab), np.float32),
                              FINISH_STOP if len(stops) else FINISH_LENGTH))
        return out

    async def abort_all(self) -> None:
        """Every call returns at once: nothing is ever in flight."""

    async def load_weights(self, version) -> str:
        self.versions.append(version.version)
        return "ignored"
