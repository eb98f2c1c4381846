"""What both of ``hpcrl plan``'s simulations share: the events they replay, a candidate's knobs, what they predict,
the response and prompt lengths per prompt index, and the order in which rollout jobs take the budget.

Both simulations run the whole pipeline in modelled seconds. They replay, without sleeping, what the jobs do
(hpcrl/rollout/main.py, hpcrl/trainer/main.py) on the phase model of the ``simulated`` section:

- each rollout job has one engine batch with the simulated engine's arithmetic (a decoding step is
  ``decode_base_s + decode_per_seq_s * running``, prefill per prompt token, at most ``max_num_seqs``, and with
  ``kv_cache_tokens`` the KV-cache rule of ``SimulatedConfig.kv_admits``: the newest sequence is preempted
  when a step would not fit);
- a job starts a group (n sequences) while the admission rule allows, the same function the admission lock
  applies (``hpcrl.config.knobs.may_start``): the shared budget has a start left (``started < consumed_groups(v)
  + B``, v the version it holds), the job is below its bound (``rollout.max_concurrent_groups``, ``auto``: what
  its engine decodes at once) and, sharing by load, below the even share of what the fleet may have in flight;
  the group generates prompt index ``started`` (the shared claim hands indices out in order); a job that asks
  takes every start the rule allows in one turn (``hpcrl.config.knobs.starts_allowed``, as the admission lock
  serves it in one acquisition), and jobs acting at the same instant ask in
  :class:`~hpcrl.plan.model.ServiceOrder`;
- a finished group is committed at once, except while its job drains for a new version (no partial rollout),
  which commits what it collected when the drain ends, as ``RolloutJob._drain`` does; the trainer takes R
  committed groups in commit order, updates for
  ``update_model_s(tokens)``, publishes every K updates for ``publish_s`` (the version's ``consumed_groups`` =
  what it consumed);
- a job that sees a newer version drains its groups (or, with partial rollout, aborts them and keeps their
  tokens), loads for ``weight_load_s`` with nothing running, then continues.

Response lengths are drawn as the simulated engine draws them (the same seed per prompt index), so a
simulated run and its prediction see the same lengths. Control-plane latencies (polling, file writes) are
``overhead_s`` per version at most; everything else is the model.

Two simulations implement these events: ``tests/plan_reference.py`` scans every engine at every event (the
reference, the tests' oracle) and :mod:`hpcrl.plan.events` keeps one heap of events and one heap of finishes per
engine (what ``hpcrl plan`` runs). ``tests/test_plan_fast.py`` holds them equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from hpcrl.config.knobs import Knobs as RunKnobs
from hpcrl.config.simulated import SimulatedConfig

INF = float("inf")
EPS_S = 1e-12
"""Two event times closer than this are the same instant (both simulations)."""


@dataclass(frozen=True, kw_only=True)
class Knobs(RunKnobs):
    """One candidate run: a run's async knobs (:class:`hpcrl.config.knobs.Knobs`: s, K, R, partial rollout, n, the
    rollout jobs, their ``max_concurrent_groups`` and how they share the budget) and what the simulation needs
    besides."""

    trainer_gpus: int = 1
    """GPUs of the trainer (the update's per-token time is divided by them)."""
    response_length: int = 1024
    """The responses' cap (``rollout.response_length``)."""
    prompt_tokens: int = 16
    """Prompt length when no :class:`Draws` with the data's prompt lengths is given."""
    commit_while_draining: bool = False
    """A rollout job draining for a new version (no partial rollout) seals the groups that finish meanwhile only
    when the drain ends (``RolloutJob._drain`` collects, ``_seal`` follows): False models that; True a job that
    seals them as they finish (what that change would buy)."""

    @property
    def budget(self) -> int:
        """B, the config's :func:`hpcrl.config.knobs.admission_budget`."""
        return self.admission_budget


@dataclass
class Prediction:
    """What the simulation says about the steady part of a run (updates 2..N)."""

    updates: int
    window_s: float
    tokens: int
    trainer_busy: float
    """Share of the window the trainer spends updating."""
    rollout_busy: float
    """Share of the window a rollout job's engine has sequences running (mean over jobs)."""
    lag_mean: float
    lag_max: int
    group_latencies_s: list = field(default_factory=list)
    """Each trained group's first start to its finish (what the budget-aware bound draws from)."""
    updates_per_version: int = 1
    """K: a parameter-sync period is this many updates."""

    @property
    def step_s(self) -> float:
        """Seconds per local update (R groups)."""
        return self.window_s / max(self.updates, 1)

    @property
    def sync_period_s(self) -> float:
        """Seconds per parameter-sync period (K updates: what other tools call a step)."""
        return self.step_s * self.updates_per_version

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s > 0 else 0.0


def prompt_seed(data_seed: int, prompt_index: int) -> int:
    """The rollout job's group seed (hpcrl/rollout/agent_loop.py: group_seed; a test keeps them equal)."""
    return (data_seed * 1_000_003 + prompt_index) % 2**63


class Draws:
    """Per prompt index: the ``n`` response lengths (drawn as the simulated engine draws them, capped at
    ``response_length``) and the prompt length. Prompt index ``i`` is the ``i``-th group the fleet starts (the
    shared prompt claim hands indices out in order). Built once per sweep: every candidate reads the same."""

    def __init__(self, sim: SimulatedConfig, n: int, response_length: int, data_seed: int = 0,
                 empirical: Optional[np.ndarray] = None, prompts: Union[int, Sequence[int]] = 16):
        self.sim, self.n, self.cap, self.data_seed, self.empirical = sim, n, response_length, data_seed, empirical
        self._responses: list[list[int]] = []
        self._prompt_const = prompts if isinstance(prompts, int) else None
        self._prompt_rows = None if isinstance(prompts, int) else np.asarray(prompts, dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}

    def responses(self, index: int) -> list[int]:
        """The capped response lengths of the group of prompt ``index``."""
        while len(self._responses) <= index:
            seed = prompt_seed(self.data_seed, len(self._responses))
            self._responses.append([min(int(self.sim.draw_lengths(np.random.default_rng([seed, i]), 1,
                                                                  self.empirical)[0]), self.cap)
                                    for i in range(self.n)])
        return self._responses[index]

    def prompt(self, index: int) -> int:
        """Prompt tokens of prompt ``index`` (the rollout's PromptStream order: a seeded permutation per epoch)."""
        if self._prompt_const is not None:
            return self._prompt_const
        rows = len(self._prompt_rows)
        epoch, pos = divmod(index, rows)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = self._perms[epoch] = np.random.default_rng([self.data_seed, epoch]).permutation(rows)
        return int(self._prompt_rows[perm[pos]])

    def mean_response(self, groups: int) -> float:
        """Mean capped response length over the first ``groups`` groups."""
        self.responses(groups - 1)
        return float(np.mean(self._responses[:groups]))


def draws_for(sim: SimulatedConfig, k: Knobs, data_seed: int = 0, empirical=None) -> Draws:
    """The draws of one candidate with a constant prompt length (``k.prompt_tokens``)."""
    return Draws(sim, k.n, k.response_length, data_seed, empirical, k.prompt_tokens)


class ServiceOrder:
    """The order in which rollout jobs that act at the same instant take the admission budget.

    A real job notices a new weight version at its own poll and loads it; jobs that finish the load together
    take turns at the admission lock, each starting in its one turn as many groups as the admission rule lets it
    (``hpcrl.config.knobs.starts_allowed``: by load, up to an even share; first come, up to its bound), in the
    order they got there, which differs from version to version. Modelled as a seeded random order of the jobs per
    version."""

    def __init__(self, jobs: int, data_seed: int = 0):
        self.jobs, self.seed = jobs, data_seed
        self._keys: dict[int, np.ndarray] = {}

    def key(self, version: int) -> np.ndarray:
        """``key[rank]``: jobs act in increasing key while ``version`` is the newest."""
        keys = self._keys.get(version)
        if keys is None:
            rng = np.random.default_rng([self.seed, 7919, max(version, 0)])
            keys = self._keys[version] = rng.permutation(self.jobs)
        return keys


def steady_prediction(update_ends: list, updates: int, busy_s: list, lags: list, latencies: list,
                      k: Knobs) -> Prediction:
    """The prediction over updates 2..N from a simulation's record (both simulations)."""
    t0, t1 = update_ends[0][0], update_ends[updates - 1][0]
    window = t1 - t0
    busy_trainer = sum(u for _, _, u in update_ends[1:updates])
    busy_rollout = float(np.mean(busy_s)) * (updates - 1) / updates
    return Prediction(updates=updates - 1, window_s=window, tokens=sum(tok for _, tok, _ in update_ends[1:updates]),
                      trainer_busy=busy_trainer / window if window else 0.0,
                      rollout_busy=min(1.0, busy_rollout / window) if window else 0.0,
                      lag_mean=float(np.mean(lags)) if lags else 0.0, lag_max=max(lags, default=0),
                      group_latencies_s=latencies[:(updates - 1) * k.groups_per_update],
                      updates_per_version=k.trigger_parameter_sync_step)
