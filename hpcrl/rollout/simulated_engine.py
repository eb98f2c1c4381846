"""The simulated engine (``rollout.engine=simulated``): a GPU's generation time, slept, not computed.

What it models is vLLM's continuous batching: at most ``rollout.max_num_seqs`` sequences run; each
decoding step gives every running sequence one token and takes ``decode_base_s + decode_per_seq_s *
running`` modelled seconds; a sequence entering the batch first costs ``prefill_per_token_s`` per token
of its prompt. With ``simulated.kv_cache_tokens`` the running sequences' prompts and tokens must fit the
KV cache (``SimulatedConfig.kv_admits``): a step that would not fit preempts the newest running sequence,
which waits at the head of the queue and pays its prefill again (vLLM's recompute). One scheduler task on
the runner's loop advances the batch from event to event (the next sequence to finish, a new request, an
abort), so a step costs no Python work: it sleeps ``modelled / simulated.time_scale`` wall seconds, and
carries what a sleep overshoots into the next, so the batch keeps to its phase model under load. Response
lengths are drawn per sequence from ``simulated.lengths`` (EOS included), capped by the call's budget.

What it returns is real data: token ids of the model's vocabulary (no special token except a final EOS)
and log-probs, both drawn from the call's seed, so a group is reproducible. :meth:`abort_all` hands back
the tokens so far (the waiting sequences: none); a response continued after an abort (partial rollout:
prompt + tokens so far) keeps the length it was drawn with while this process lives (a continuation
another job picks up from saved state draws its remaining length again). Weights are taken (the real
files or broadcast arrived already) and the switch sleeps ``weight_load_s``. No torch is imported.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from hpcrl.config.simulated import SimulatedConfig, empirical_run
from hpcrl.logs.run_logs import read_lengths
from hpcrl.rundir.paths import RunDir
from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Engine, EngineOptions, Sample
from hpcrl.weights.base import WeightVersion

log = logging.getLogger("hpcrl.rollout.simulated")

FIRST_TOKEN_ID = 3
"""Made-up tokens are drawn from [3, vocab): the tiny vocabulary's pad, eos and unk come first."""


def empirical_lengths(spec: str) -> Optional[np.ndarray]:
    """The lengths ``simulated.lengths=empirical:RUN`` draws from (None for a named distribution)."""
    run = empirical_run(spec)
    return read_lengths(RunDir(run).staleness, spec) if run is not None else None


def response_length(sim: SimulatedConfig, seed: int, index: int, empirical: Optional[np.ndarray] = None) -> int:
    """The drawn length (before the cap) of response ``index`` of a call seeded ``seed``: ``hpcrl plan`` draws the
    same lengths for the same prompts."""
    return int(sim.draw_lengths(np.random.default_rng([seed % 2**63, index]), 1, empirical)[0])


def _key(ids: list[int]) -> str:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


@dataclass(eq=False)  # identity: two sequences are never "equal"
class _Seq:
    """One sequence of the modelled batch."""

    prompt: list[int]
    tokens: np.ndarray
    """The whole response it will sample if nothing stops it (its drawn length, capped)."""
    logprobs: np.ndarray
    stops: bool
    """It ends with EOS (else at the cap: length)."""
    produced: int = 0
    done: asyncio.Future = field(default=None)  # type: ignore[assignment]

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.produced


class SimulatedEngine(Engine):
    """Continuous batching, slept (module docstring)."""

    @classmethod
    def build(cls, opts: EngineOptions, cfg) -> "SimulatedEngine":
        """With the ``simulated`` section's model and ``rollout.max_num_seqs`` (the batch it models)."""
        return cls(opts, cfg.simulated, cfg.rollout.max_num_seqs)

    def __init__(self, opts: EngineOptions, sim: SimulatedConfig, max_num_seqs: int = 256):
        self.sim = sim
        self.max_new_tokens = opts.max_new_tokens
        self.max_num_seqs = max_num_seqs
        model = json.loads((Path(opts.model_dir) / "config.json").read_text())
        self.vocab = int(model["vocab_size"])
        eos = model.get("eos_token_id")
        self.eos_id = int(eos[0] if isinstance(eos, list) else eos if eos is not None else 1)
        self.empirical = empirical_lengths(self.sim.lengths)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._prefill_due_s = 0.0  # modelled prefill not yet slept
        self._usage = 0  # KV-cache tokens the running sequences hold (prompt + tokens so far)
        self._wake: Optional[asyncio.Event] = None
        self._scheduler: Optional[asyncio.Task] = None
        self._aborting = False
        self._continued: dict[str, list[tuple[np.ndarray, np.ndarray, bool]]] = {}  # sequence at abort -> rests
        self.busy_model_s = 0.0
        """Modelled seconds the batch was running (for tests and benchmarks)."""
        self.tokens_out = 0
        log.info("simulated engine: no model; decode step %.4fs + %.6fs/seq, prefill %.2gs/token, max %d seqs, "
                 "lengths %s (mean %.0f) capped at %d, weight switch %.2fs, time_scale %g (modelled seconds)",
                 self.sim.decode_base_s, self.sim.decode_per_seq_s, self.sim.prefill_per_token_s, self.max_num_seqs,
                 self.sim.lengths, self.sim.length_mean, self.max_new_tokens, self.sim.weight_load_s,
                 self.sim.time_scale)

    # ---- the interface
    async def generate(self, prompt_ids: list[int], n: int, seed: int,
                       max_new_tokens: Optional[int] = None, greedy: bool = False) -> list[Sample]:
        # greedy (remax's baseline) is drawn like any other response: the made-up tokens carry no meaning
        cap = max_new_tokens or self.max_new_tokens
        seqs = [self._new_seq(prompt_ids, seed, i, cap) for i in range(n)]
        for s in seqs:
            s.done = asyncio.get_running_loop().create_future()
            self._waiting.append(s)
        self._kick()
        await asyncio.gather(*(s.done for s in seqs))
        return [s.done.result() for s in seqs]

    async def abort_all(self) -> None:
        if self._running or self._waiting:
            self._aborting = True
            self._kick()

    async def load_weights(self, version: WeightVersion) -> str:
        await asyncio.sleep(self.sim.weight_load_s / self.sim.time_scale)
        return "simulated"

    def close(self) -> None:
        if self._scheduler is not None and not self._scheduler.done():
            self._scheduler.cancel()

    # ---- sequences
    def _new_seq(self, prompt_ids: list[int], seed: int, index: int, cap: int) -> _Seq:
        """A sequence's whole response, drawn from (seed, index); a continuation of an aborted one keeps its rest."""
        rests = self._continued.get(_key(prompt_ids))
        if rests:  # several aborted responses may share a prefix (the prompt, when none had a token yet)
            tokens, logprobs, stops = rests.pop(0)
            if not rests:
                del self._continued[_key(prompt_ids)]
            if len(tokens) > cap:
                tokens, logprobs, stops = tokens[:cap], logprobs[:cap], False
            return _Seq(list(prompt_ids), tokens, logprobs, stops)
        length = response_length(self.sim, seed, index, self.empirical)
        stops = length <= cap
        length = min(length, cap)
        rng = np.random.default_rng([seed % 2**63, index, 1])
        tokens = rng.integers(FIRST_TOKEN_ID, self.vocab, size=length)
        tokens[tokens == self.eos_id] = FIRST_TOKEN_ID
        if stops:
            tokens[-1] = self.eos_id
        logprobs = -rng.exponential(1.0, size=length).astype(np.float32) - 1e-3
        return _Seq(list(prompt_ids), tokens.astype(np.int32), logprobs, stops)

    def _finish(self, s: _Seq, aborted: bool) -> None:
        """Hand back what ``s`` sampled; an aborted one leaves its rest for its continuation."""
        n = s.produced
        if aborted and s.remaining > 0:
            key = _key(s.prompt + s.tokens[:n].tolist())
            self._continued.setdefault(key, []).append((s.tokens[n:], s.logprobs[n:], s.stops))
            reason = FINISH_ABORT
        else:
            reason = FINISH_STOP if s.stops else FINISH_LENGTH
        self.tokens_out += n
        if not s.done.done():
            s.done.set_result(Sample(s.tokens[:n].copy(), s.logprobs[:n].copy(), reason))

    # ---- the scheduler
    def _kick(self) -> None:
        """Wake the scheduler (a new request, an abort), starting it if it is not running."""
        if self._scheduler is None or self._scheduler.done():  # a fresh event: it binds to the running loop
            self._wake = asyncio.Event()
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())
        self._wake.set()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            s = self._waiting[0]
            context = len(s.prompt) + s.produced
            if not self.sim.kv_admits(self._usage, len(self._running), context):
                if not self._running:
                    raise RuntimeError(f"simulated engine: one sequence of {context} tokens (+1) does not fit "
                                       f"simulated.kv_cache_tokens={self.sim.kv_cache_tokens}; raise it")
                break
            self._waiting.popleft()
            self._running.append(s)
            self._usage += context
            self._prefill_due_s += self.sim.prefill_per_token_s * context

    def _preempt(self) -> None:
        """While the next step does not fit the KV cache, the newest running sequence waits again (recompute)."""
        while self._running and self.sim.kv_steps_left(self._usage, len(self._running)) == 0:
            s = self._running.pop()
            self._usage -= len(s.prompt) + s.produced
            self._waiting.appendleft(s)

    async def _schedule(self) -> None:
        """Run the batch; a failure of the model fails every request in it (none waits forever)."""
        try:
            await self._run_batch()
        except BaseException as e:
            log.exception("simulated engine: the scheduler failed")
            for s in self._running + list(self._waiting):
                if not s.done.done():
                    s.done.set_exception(e if isinstance(e, Exception) else RuntimeError("simulated engine stopped"))
            self._running, self._prefill_due_s, self._usage = [], 0.0, 0
            self._waiting.clear()
            raise

    async def _run_batch(self) -> None:
        """Advance the batch event to event until nothing is running or waiting.

        The batch's modelled time is the loop's wall time times time_scale, counted from one mark to the next
        (the sleeps, what they overshoot, and this loop's own work in between): what is not yet a whole step is
        carried, so under load the batch keeps to its phase model instead of falling behind it."""
        loop = asyncio.get_running_loop()
        carry_s = 0.0  # modelled time passed and not yet spent on prefill or whole steps
        mark = loop.time()
        while self._running or self._waiting:
            if self._aborting:
                self._abort_now()
                carry_s, mark = 0.0, loop.time()
                continue
            self._admit()
            step = self.sim.decode_step_s(len(self._running))
            k = min(s.remaining for s in self._running)
            left = self.sim.kv_steps_left(self._usage, len(self._running))
            k = k if left is None else min(k, left)
            now = loop.time()
            carry_s, mark = carry_s + (now - mark) * self.sim.time_scale, now
            due = self._prefill_due_s + k * step
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, due - carry_s) / self.sim.time_scale)
                timed_out = False
            except asyncio.TimeoutError:
                timed_out = True
            now = loop.time()
            slept, mark = carry_s + (now - mark) * self.sim.time_scale, now
            if timed_out:  # the whole stretch passed, even if the timer fired a hair early
                slept = max(slept, due)
            prefill = min(self._prefill_due_s, slept)
            self._prefill_due_s -= prefill
            steps = min(k, int((slept - prefill) / step + 1e-9))
            carry_s = max(0.0, slept - prefill - steps * step)
            self.busy_model_s += prefill + steps * step
            self._advance(steps)

    def _advance(self, steps: int) -> None:
        for s in self._running:
            s.produced += steps
        self._usage += steps * len(self._running)
        ended = [s for s in self._running if s.remaining == 0]
        self._running = [s for s in self._running if s.remaining > 0]
        self._usage -= sum(len(s.prompt) + s.produced for s in ended)
        for s in ended:
            self._finish(s, aborted=False)
        self._preempt()

    def _abort_now(self) -> None:
        """Every running and waiting sequence returns what it has (within the step the abort arrived in)."""
        self._aborting = False
        for s in self._running + list(self._waiting):
            self._finish(s, aborted=True)
        self._running, self._prefill_due_s, self._usage = [], 0.0, 0
        self._waiting.clear()
