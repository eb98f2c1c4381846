"""The reference event simulation of ``hpcrl plan`` (a test helper, not part of the package): the whole pipeline in
modelled seconds, the oracle :mod:`hpcrl.plan.events` (what ``hpcrl plan`` runs) is held equal to
(``tests/test_plan_fast.py``).

It replays the events :mod:`hpcrl.plan.model`'s docstring lists. Every event scans every engine (O(jobs x running)
per event), which is slow at cluster sizes, and plain to check line by line against the jobs: that is what it is
for.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from hpcrl.config.knobs import starts_allowed
from hpcrl.config.simulated import SimulatedConfig
from hpcrl.plan.model import (EPS_S, INF, Draws, Knobs, Prediction, ServiceOrder, draws_for, prompt_seed,
                              steady_prediction)

__all__ = ["Knobs", "Prediction", "Pipeline", "predict", "prompt_seed"]


@dataclass(eq=False)
class _Seq:
    group: "_Group"
    length: int
    produced: int = 0
    prompt: int = 0

    @property
    def context(self) -> int:
        """Tokens it holds in the KV cache (prompt + tokens so far)."""
        return self.prompt + self.produced


@dataclass(eq=False)
class _Group:
    index: int
    version_start: int
    created_s: float = 0.0
    finished_s: float = 0.0
    seqs: list = field(default_factory=list)
    open: int = 0


class _Batch:
    """One engine's continuous batch, advanced to a given time (the simulated engine's arithmetic)."""

    def __init__(self, sim: SimulatedConfig, max_num_seqs: int):
        self.sim, self.max_num_seqs = sim, max_num_seqs
        self.running: list[_Seq] = []  # in admission order: the newest is preempted first
        self.waiting: deque[_Seq] = deque()
        self.prefill_due_s = 0.0
        self.mark_s = 0.0  # time the current stretch began
        self.busy_s = 0.0
        self.usage = 0  # KV-cache tokens held by the running sequences

    def add(self, seq: _Seq, now: float) -> None:
        if not self.running:
            self.mark_s = now
        self.waiting.append(seq)
        self._admit()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            if not self.sim.kv_admits(self.usage, len(self.running), s.context):
                break
            self.waiting.popleft()
            self.running.append(s)
            self.usage += s.context
            self.prefill_due_s += self.sim.prefill_per_token_s * s.context

    def _k(self) -> int:
        """Steps to the batch's next event: a sequence finishes, or the cache is full."""
        k = min(s.length - s.produced for s in self.running)
        left = self.sim.kv_steps_left(self.usage, len(self.running))
        return k if left is None else min(k, left)

    def next_finish_s(self) -> float:
        if not self.running:
            return INF
        return self.mark_s + self.prefill_due_s + self._k() * self.sim.decode_step_s(len(self.running))

    def advance_to(self, t: float) -> list[_Seq]:
        """Run until ``t``; the sequences that finished."""
        done: list[_Seq] = []
        while self.running and self.next_finish_s() <= t + EPS_S:
            end = self.next_finish_s()
            self._steps(self._k(), end)
            done += [s for s in self.running if s.produced >= s.length]
            self.usage -= sum(s.context for s in self.running if s.produced >= s.length)
            self.running = [s for s in self.running if s.produced < s.length]
            self._preempt()
            self._admit()
        if self.running and t > self.mark_s:
            avail = t - self.mark_s
            prefill = min(self.prefill_due_s, avail)
            self.prefill_due_s -= prefill
            steps = int((avail - prefill) / self.sim.decode_step_s(len(self.running)))
            used = prefill + steps * self.sim.decode_step_s(len(self.running))
            self._steps(steps, self.mark_s + used, prefill_done=False, busy_s=used - prefill)
            self.busy_s += prefill
        return done

    def _preempt(self) -> None:
        """While the next step does not fit the cache, the newest running sequence waits again (recompute)."""
        while self.running and self.sim.kv_steps_left(self.usage, len(self.running)) == 0:
            s = self.running.pop()
            self.usage -= s.context
            self.waiting.appendleft(s)

    def _steps(self, k: int, end: float, prefill_done: bool = True, busy_s: Optional[float] = None) -> None:
        for s in self.running:
            s.produced += k
        self.usage += k * len(self.running)
        self.busy_s += (end - self.mark_s) if busy_s is None else busy_s
        if prefill_done:
            self.prefill_due_s = 0.0
        self.mark_s = end

    def abort(self, now: float) -> list[_Seq]:
        """Every sequence leaves with what it has (partial rollout)."""
        self.advance_to(now)
        out = self.running + list(self.waiting)
        self.running, self.prefill_due_s, self.usage = [], 0.0, 0
        self.waiting.clear()
        return out


class _Job:
    """One rollout job: admission, drain or abort at a version switch, the load."""

    def __init__(self, rank: int, k: Knobs, sim: SimulatedConfig, draws: Draws):
        self.rank, self.k, self.sim, self.draws = rank, k, sim, draws
        self.batch = _Batch(sim, k.max_num_seqs)
        self.version, self.consumed_at = -1, 0
        self.in_flight: list[_Group] = []
        self.parked: list[_Seq] = []
        self.loading_until: Optional[float] = None
        self.target = 0
        self.load_s = 0.0
        self.draining = False  # a newer version is out, groups are in flight, no partial rollout
        self.held: list[_Group] = []  # finished while draining: committed when the drain ends

    def start_load(self, now: float, version: int, consumed: int) -> None:
        self.loading_until, self.target, self._target_consumed = now + self.sim.weight_load_s, version, consumed
        self.load_s += self.sim.weight_load_s

    def service(self, now: float, pipe: "Pipeline") -> None:
        """Finish a load, switch to a newer version, or admit groups."""
        if self.loading_until is not None:
            if now + EPS_S < self.loading_until:
                return
            self.loading_until, self.version, self.consumed_at = None, self.target, self._target_consumed
            for s in self.parked:
                self.batch.add(s, now)
            self.parked = []
        newest, consumed = pipe.newest(now)
        if newest > self.version:
            if self.k.partial_rollout:
                self.parked = self.batch.abort(now)
                self.start_load(now, newest, consumed)
            elif not self.in_flight:
                pipe.commit(self.held)  # the drain is over: what it collected is sealed, then the load
                self.held, self.draining = [], False
                self.start_load(now, newest, consumed)
            else:
                self.draining = not self.k.commit_while_draining
            return  # draining: no admission until the load
        k = self.k
        for _ in range(starts_allowed(k.budget_share, len(self.in_flight), k.group_bound,
                                      self.consumed_at + k.budget - pipe.started, pipe.uncommitted, k.rollout_jobs)):
            g = _Group(pipe.started, self.version, created_s=now)
            pipe.started += 1
            pipe.uncommitted += 1
            prompt = self.draws.prompt(g.index)
            for length in self.draws.responses(g.index):
                g.seqs.append(_Seq(g, length, prompt=prompt))
                self.batch.add(g.seqs[-1], now)
            g.open = self.k.n
            self.in_flight.append(g)

    def next_event_s(self) -> float:
        return self.loading_until if self.loading_until is not None else self.batch.next_finish_s()

    def advance_to(self, t: float) -> list[_Group]:
        """Run the batch to ``t``; the groups that finished (committed at once)."""
        done = []
        for s in self.batch.advance_to(t):
            s.group.open -= 1
            if s.group.open == 0:
                self.in_flight.remove(s.group)
                done.append(s.group)
        return done


class Pipeline:
    """The trainer and the rollout jobs of one candidate run, stepped event to event (module docstring)."""

    def __init__(self, sim: SimulatedConfig, k: Knobs, data_seed: int = 0, empirical=None, overhead_s: float = 0.0,
                 draws: Optional[Draws] = None):
        self.sim, self.k, self.overhead_s = sim, k, overhead_s
        self.trainer_sim = SimulatedConfig(**{**vars(sim), "trainer_gpus": k.trainer_gpus})
        draws = draws if draws is not None else draws_for(sim, k, data_seed, empirical)
        self.jobs = [_Job(r, k, sim, draws) for r in range(k.rollout_jobs)]
        self.order = ServiceOrder(k.rollout_jobs, data_seed)
        self.started = 0
        self.uncommitted = 0  # groups started and not committed: the fleet's in flight (the admission record's)
        self.queue: deque[tuple[_Group, int]] = deque()  # committed groups, tokens
        self.published: list[tuple[float, int, int]] = [(0.0, 0, 0)]  # (available at, version, consumed)
        self.step, self.consumed, self.version = 0, 0, 0
        self.busy_until: Optional[float] = None
        self._publishing_until: Optional[float] = None
        self.update_ends: list[tuple[float, int, float]] = []  # (end, tokens, update seconds)
        self.lags: list[int] = []
        self.latencies: list[float] = []  # of the groups of updates 2..N

    def commit(self, groups: list[_Group]) -> None:
        """Groups become visible to the trainer (their shard is sealed)."""
        self.uncommitted -= len(groups)
        self.queue.extend((g, sum(s.length for s in g.seqs)) for g in groups)

    def newest(self, now: float) -> tuple[int, int]:
        """The newest version available at ``now`` and its consumed_groups."""
        for at, v, consumed in reversed(self.published):
            if at <= now + EPS_S:
                return v, consumed
        return -1, 0

    def _trainer(self, now: float, total: int) -> None:
        k = self.k
        if self.busy_until is not None and now + EPS_S >= self.busy_until:
            self.busy_until = None
            self.step += 1
            self.consumed += k.groups_per_update
            if self.step % k.trigger_parameter_sync_step == 0 or self.step == total:
                self._publishing_until = now + self.sim.publish_s
                self.version += 1
                self.published.append((now + self.sim.publish_s + self.overhead_s, self.version, self.consumed))
        if self._publishing_until is not None:  # the trainer publishes before it takes the next batch
            if now + EPS_S < self._publishing_until:
                return
            self._publishing_until = None
        if self.busy_until is None and self.step < total and len(self.queue) >= k.groups_per_update:
            taken = [self.queue.popleft() for _ in range(k.groups_per_update)]
            tokens = sum(t for _, t in taken)
            self.lags += [self.version - g.version_start for g, _ in taken]
            if self.step >= 1:
                self.latencies += [g.finished_s - g.created_s for g, _ in taken]
            upd = self.trainer_sim.update_model_s(tokens)
            self.busy_until = now + upd
            self.update_ends.append((now + upd, tokens, upd))

    def run(self, updates: int, limit_events: int = 5_000_000) -> Prediction:
        """Simulate ``updates`` local updates; the steady window's prediction."""
        now, events = 0.0, 0
        for job in self.jobs:
            job.start_load(0.0, 0, 0)
        while self.step < updates:
            events += 1
            if events > limit_events:
                raise RuntimeError(f"plan: the simulation of {self.k} did not finish in {limit_events} events")
            cands = [j.next_event_s() for j in self.jobs] + [self.busy_until if self.busy_until is not None else INF]
            cands.append(self._publishing_until if self._publishing_until is not None else INF)
            cands += [at for at, _, _ in self.published if at > now]
            t = min(cands)
            if t == INF:
                raise RuntimeError(f"plan: {self.k} deadlocks (no event left at t={now:.1f}s)")
            now = t
            for job in self.jobs:
                done = job.advance_to(now)
                for g in done:
                    g.finished_s = now
                if job.draining:
                    job.held += done
                else:
                    self.commit(done)
            self._trainer(now, updates)
            keys = self.order.key(self.newest(now)[0])
            for job in sorted(self.jobs, key=lambda j: keys[j.rank]):
                job.service(now, self)
            self._trainer(now, updates)
        return self._prediction(updates)

    def _prediction(self, updates: int) -> Prediction:
        return steady_prediction(self.update_ends, updates, [j.batch.busy_s for j in self.jobs], self.lags,
                                 self.latencies, self.k)


def predict(sim: SimulatedConfig, k: Knobs, updates: int, data_seed: int = 0, empirical=None,
            overhead_s: float = 0.0, draws: Optional[Draws] = None) -> Prediction:
    """The steady step time, throughput, busy shares and lag of ``updates`` local updates of run ``k`` (the
    reference simulation; :func:`hpcrl.plan.events.predict` is the fast one)."""
    return Pipeline(sim, k, data_seed, empirical, overhead_s, draws).run(updates)
