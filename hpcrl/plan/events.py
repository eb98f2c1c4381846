"""The event simulation ``hpcrl plan`` runs: the whole pipeline in modelled seconds.

It simulates the events :mod:`hpcrl.plan.model`'s docstring lists. The reference simulation
(``tests/plan_reference.py``, the tests' oracle) looks at every sequence of every engine at every event. Here:

- **an engine keeps a step clock.** Every running sequence gains one token per decoding step, so a sequence
  admitted at step ``P0`` with ``r`` tokens to go finishes at step ``P0 + r`` whatever else runs; a heap of
  those finish steps gives the next finish in O(log n), and between two finishes (or admissions, or a full
  KV cache) the step time is constant, so one multiplication advances the clock;
- **one heap of events for the run.** An engine's next event changes only when that engine changes (a
  finish, an admission, an abort, a load), so it is pushed then, and stale entries are skipped; an event
  touches only its own job, except a new weight version, which every job sees;
- **lengths are drawn once per sweep** (:class:`~hpcrl.plan.model.Draws`), not once per candidate.

Everything else (the trainer, the budget, the order of admission, drains, aborts, loads, the KV-cache rule) is
the reference's, line for line; ``tests/test_plan_fast.py`` holds the two within 1 % on the same cases.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Optional

from hpcrl.config.knobs import starts_allowed
from hpcrl.config.simulated import SimulatedConfig
from hpcrl.plan.model import EPS_S, INF, Draws, Knobs, Prediction, ServiceOrder, draws_for, steady_prediction


class Seq:
    __slots__ = ("group", "length", "prompt", "produced", "p0", "adm")

    def __init__(self, group: "Group", length: int, prompt: int):
        self.group, self.length, self.prompt, self.produced, self.p0, self.adm = group, length, prompt, 0, 0, -1


class Group:
    __slots__ = ("index", "version_start", "created_s", "finished_s", "open", "tokens")

    def __init__(self, index: int, version_start: int, created_s: float, n: int, tokens: int):
        self.index, self.version_start, self.created_s = index, version_start, created_s
        self.open, self.tokens = n, tokens
        self.finished_s = 0.0


def completed(seqs: list[Seq]) -> list[Group]:
    """The groups whose last sequence is among ``seqs`` (which just finished)."""
    done = []
    for s in seqs:
        g = s.group
        g.open -= 1
        if g.open == 0:
            done.append(g)
    return done


class Batch:
    """One engine's continuous batch on a step clock (module docstring); the reference's ``Batch`` otherwise."""

    def __init__(self, sim: SimulatedConfig, max_num_seqs: int):
        self.sim, self.max_num_seqs = sim, max_num_seqs
        self.base, self.per_seq, self.prefill = sim.decode_base_s, sim.decode_per_seq_s, sim.prefill_per_token_s
        self.kv = sim.kv_cache_tokens
        self.P = 0  # decoding steps taken
        self.heap: list = []  # (finish step, admission number, seq); an entry whose seq left is skipped
        self.running: dict[int, Seq] = {}  # admission number -> seq, in admission order
        self.waiting: deque[Seq] = deque()
        self.adm = 0
        self.prefill_due_s = 0.0
        self.mark_s = 0.0
        self.busy_s = 0.0
        self.usage = 0

    def add(self, seqs: list[Seq], now: float) -> None:
        """``seqs`` join the queue at ``now`` (one group, or the parked ones after a load)."""
        if not self.running:
            self.mark_s = now
        self.waiting.extend(seqs)
        self._admit()

    def _admit(self) -> None:
        waiting, running, heap, P = self.waiting, self.running, self.heap, self.P
        if self.kv:
            while waiting and len(running) < self.max_num_seqs:
                s = waiting[0]
                ctx = s.prompt + s.produced
                if not self.sim.kv_admits(self.usage, len(running), ctx):
                    break
                waiting.popleft()
                self.adm += 1
                s.adm, s.p0 = self.adm, P
                running[self.adm] = s
                heapq.heappush(heap, (P + s.length - s.produced, self.adm, s))
                self.usage += ctx
                self.prefill_due_s += self.prefill * ctx
            return
        adm, push, ctx = self.adm, heapq.heappush, 0
        for _ in range(min(len(waiting), self.max_num_seqs - len(running))):
            s = waiting.popleft()
            adm += 1
            s.adm, s.p0 = adm, P
            running[adm] = s
            push(heap, (P + s.length - s.produced, adm, s))
            c = s.prompt + s.produced
            ctx += c
            self.prefill_due_s += self.prefill * c
        self.adm = adm
        self.usage += ctx

    def _k(self) -> int:
        heap, running = self.heap, self.running
        while heap[0][1] not in running:  # preempted
            heapq.heappop(heap)
        k = heap[0][0] - self.P
        if self.kv:
            left = self.sim.kv_steps_left(self.usage, len(running))
            if left is not None and left < k:
                return left
        return k

    def next_finish_s(self) -> float:
        if not self.running:
            return INF
        return self.mark_s + self.prefill_due_s + self._k() * (self.base + self.per_seq * len(self.running))

    def step_next(self) -> list[Seq]:
        """Run to the batch's next event (:meth:`next_finish_s`); the sequences that finished there."""
        running, heap = self.running, self.heap
        k = self._k()
        end = self.mark_s + self.prefill_due_s + k * (self.base + self.per_seq * len(running))
        self.P += k
        self.usage += k * len(running)
        self.busy_s += end - self.mark_s
        self.prefill_due_s = 0.0
        self.mark_s = end
        done = []
        P = self.P
        while heap and heap[0][0] <= P:
            _, adm, s = heapq.heappop(heap)
            if running.get(adm) is s:
                del running[adm]
                s.produced = s.length
                self.usage -= s.prompt + s.length
                done.append(s)
        if self.kv:
            self._preempt()
        if self.waiting:
            self._admit()
        return done

    def run_to_group(self, horizon: float) -> tuple[float, list[Group]]:
        """:meth:`step_next` until a group completes, before ``horizon``: (its time, the groups), or (the next
        finish, []) at or after ``horizon``. One loop without calls for the common case (nothing waits, no KV
        limit, so no finish admits anything); otherwise :meth:`step_next` one by one."""
        if self.waiting or self.kv:
            while True:
                t = self.next_finish_s()
                if t == INF or t >= horizon - EPS_S:
                    return t, []
                groups = completed(self.step_next())
                if groups:
                    return t, groups
        running, heap = self.running, self.heap
        P, mark, busy, usage, pd = self.P, self.mark_s, self.busy_s, self.usage, self.prefill_due_s
        base, per_seq, pop, limit = self.base, self.per_seq, heapq.heappop, horizon - EPS_S
        groups: list[Group] = []
        t = INF
        while heap:
            m = len(running)
            k = heap[0][0] - P
            end = mark + pd + k * (base + per_seq * m)
            if end >= limit:
                t = end
                break
            P += k
            usage += k * m
            busy += end - mark
            pd = 0.0
            mark = end
            while heap and heap[0][0] <= P:
                _, adm, s = pop(heap)
                del running[adm]
                s.produced = s.length
                usage -= s.prompt + s.length
                g = s.group
                g.open -= 1
                if g.open == 0:
                    groups.append(g)
            if groups:
                t = end
                break
        self.P, self.mark_s, self.busy_s, self.usage, self.prefill_due_s = P, mark, busy, usage, pd
        return t, groups

    def advance_to(self, t: float) -> list[Seq]:
        """Run until ``t``; the sequences that finished."""
        done: list[Seq] = []
        while self.running and self.next_finish_s() <= t + EPS_S:
            done += self.step_next()
        running = self.running
        if running and t > self.mark_s:
            step = self.base + self.per_seq * len(running)
            avail = t - self.mark_s
            prefill = min(self.prefill_due_s, avail)
            self.prefill_due_s -= prefill
            steps = int((avail - prefill) / step)
            used = prefill + steps * step
            self.P += steps
            self.usage += steps * len(running)
            self.busy_s += used - prefill
            self.mark_s = self.mark_s + used
            self.busy_s += prefill
        return done

    def _preempt(self) -> None:
        running = self.running
        while running and self.sim.kv_steps_left(self.usage, len(running)) == 0:
            adm = next(reversed(running))
            s = running.pop(adm)
            s.produced += self.P - s.p0
            self.usage -= s.prompt + s.produced
            self.waiting.appendleft(s)

    def abort(self, now: float) -> list[Seq]:
        """Every sequence leaves with what it has (partial rollout)."""
        self.advance_to(now)
        out = list(self.running.values())
        for s in out:
            s.produced += self.P - s.p0
        out += self.waiting
        self.running, self.heap, self.prefill_due_s, self.usage = {}, [], 0.0, 0
        self.waiting.clear()
        return out


class _Job:
    """One rollout job (the reference's ``_Job``), whose batch may run ahead of the run's clock (:meth:`run_ahead`)."""

    def __init__(self, rank: int, k: Knobs, sim: SimulatedConfig, draws: Draws):
        self.rank, self.k, self.sim, self.draws = rank, k, sim, draws
        self.batch = Batch(sim, k.max_num_seqs)
        self.version, self.consumed_at = -1, 0
        self.in_flight = 0  # started and not yet committed
        self.parked: list[Seq] = []
        self.loading_until: Optional[float] = None
        self.target = self._target_consumed = 0
        self.gen = 0  # its newest entry in the run's event heap
        self.pending: list[Group] = []  # completed by running ahead, committed at ``pending_s``
        self.pending_s = INF
        self.draining = False  # the reference's ``_Job.draining``
        self.held: list[Group] = []

    def start_load(self, now: float, version: int, consumed: int) -> None:
        self.loading_until, self.target, self._target_consumed = now + self.sim.weight_load_s, version, consumed

    def service(self, now: float, pipe: "Pipeline") -> None:
        if self.loading_until is not None:
            if now + EPS_S < self.loading_until:
                return
            self.loading_until, self.version, self.consumed_at = None, self.target, self._target_consumed
            if self.parked:
                self.batch.add(self.parked, now)
            self.parked = []
        newest, consumed = pipe.newest(now)
        if newest > self.version:
            if self.k.partial_rollout:
                self.parked = self.batch.abort(now)
                self.start_load(now, newest, consumed)
            elif not self.in_flight:
                pipe.commit(self.held, now, finished=False)
                self.held, self.draining = [], False
                self.start_load(now, newest, consumed)
            else:
                self.draining = not self.k.commit_while_draining
            return
        k, draws, batch = self.k, self.draws, self.batch
        limit, bound, jobs = self.consumed_at + k.budget, k.group_bound, k.rollout_jobs
        for _ in range(starts_allowed(k.budget_share, self.in_flight, bound, limit - pipe.started, pipe.uncommitted,
                                      jobs)):  # all the rule allows, in one turn (as the admission lock serves a job)
            index = pipe.started
            pipe.started += 1
            pipe.uncommitted += 1
            lengths = draws.responses(index)
            prompt = draws.prompt(index)
            g = Group(index, self.version, now, k.n, sum(lengths))
            batch.add([Seq(g, length, prompt) for length in lengths], now)
            self.in_flight += 1
            pipe.starts.append((self.version, self.rank))

    def run_ahead(self, horizon: float) -> float:
        """Take the batch's own finishes before ``horizon`` until one completes a group (kept in ``pending``);
        the job's next event: that finish, the load's end, or its next finish at or after ``horizon``.

        Nothing but this job's own events and a new weight version changes its batch, and a version
        reaches a job before ``horizon`` only without partial rollout, where it changes nothing in a batch
        with groups in flight: so this is what the reference does event by event."""
        if self.loading_until is not None:
            return self.loading_until
        if self.pending:
            return self.pending_s
        t, groups = self.batch.run_to_group(horizon)
        if groups:
            self.pending, self.pending_s = groups, t
        return t

    def take(self, now: float) -> list[Group]:
        """The groups it commits at ``now`` (its batch run to ``now``); while draining it holds them."""
        groups = []
        if self.pending and self.pending_s <= now + EPS_S:
            groups, self.pending, self.pending_s = self.pending, [], INF
        groups += completed(self.batch.advance_to(now))
        self.in_flight -= len(groups)
        if self.draining:
            for g in groups:
                g.finished_s = now
            self.held += groups
            return []
        return groups


class Pipeline:
    """The trainer and the rollout jobs of one candidate run on one event heap (module docstring)."""

    def __init__(self, sim: SimulatedConfig, k: Knobs, draws: Draws, data_seed: int = 0, overhead_s: float = 0.0):
        self.sim, self.k, self.overhead_s = sim, k, overhead_s
        self.trainer_sim = SimulatedConfig(**{**vars(sim), "trainer_gpus": k.trainer_gpus})
        self.jobs = [_Job(r, k, sim, draws) for r in range(k.rollout_jobs)]
        self.order = ServiceOrder(k.rollout_jobs, data_seed)
        self.started = 0
        self.uncommitted = 0  # groups started and not committed, the fleet's in flight (the admission record's)
        self.queue: deque[Group] = deque()
        self.published: list[tuple[float, int, int]] = [(0.0, 0, 0)]
        self.step, self.consumed, self.version = 0, 0, 0
        self.busy_until: Optional[float] = None
        self._publishing_until: Optional[float] = None
        self.update_ends: list[tuple[float, int, float]] = []
        self.lags: list[int] = []
        self.latencies: list[float] = []
        self.events: list = []  # (time, kind, rank, gen): kind 0 a job's event, 1 the trainer's or a version's
        self.starts: list[tuple[int, int]] = []  # (version, job) of each group started, in prompt order
        self._seen_newest = 0

    def newest(self, now: float) -> tuple[int, int]:
        for at, v, consumed in reversed(self.published):
            if at <= now + EPS_S:
                return v, consumed
        return -1, 0

    def horizon(self, now: float) -> float:
        """The earliest a weight version newer than those available at ``now`` can be available: a published
        one's time, else the running update's end (or, idle, ``now`` plus the shortest update) plus publish
        and overhead. Without partial rollout a version never touches a running batch: no horizon."""
        if not self.k.partial_rollout:
            return INF
        pending = [at for at, _, _ in self.published if at > now + EPS_S]
        if pending:
            return min(pending)
        start = self.busy_until if self.busy_until is not None else now + self.trainer_sim.update_model_s(0)
        return start + self.sim.publish_s + self.overhead_s

    def _trainer(self, now: float, total: int) -> None:
        """The reference's ``Pipeline._trainer``; its new times go on the event heap."""
        k = self.k
        if self.busy_until is not None and now + EPS_S >= self.busy_until:
            self.busy_until = None
            self.step += 1
            self.consumed += k.groups_per_update
            if self.step % k.trigger_parameter_sync_step == 0 or self.step == total:
                self._publishing_until = now + self.sim.publish_s
                self.version += 1
                at = now + self.sim.publish_s + self.overhead_s
                self.published.append((at, self.version, self.consumed))
                heapq.heappush(self.events, (self._publishing_until, 1, -1, 0))
                heapq.heappush(self.events, (at, 1, -1, 0))
        if self._publishing_until is not None:
            if now + EPS_S < self._publishing_until:
                return
            self._publishing_until = None
        if self.busy_until is None and self.step < total and len(self.queue) >= k.groups_per_update:
            taken = [self.queue.popleft() for _ in range(k.groups_per_update)]
            tokens = sum(g.tokens for g in taken)
            self.lags += [self.version - g.version_start for g in taken]
            if self.step >= 1:
                self.latencies += [g.finished_s - g.created_s for g in taken]
            upd = self.trainer_sim.update_model_s(tokens)
            self.busy_until = now + upd
            self.update_ends.append((now + upd, tokens, upd))
            heapq.heappush(self.events, (self.busy_until, 1, -1, 0))

    def _push(self, job: _Job, now: float) -> None:
        job.gen += 1
        t = job.run_ahead(self.horizon(now))
        if t < INF:
            heapq.heappush(self.events, (t, 0, job.rank, job.gen))

    def _due(self, now: float) -> list[_Job]:
        """Pop every event at ``now``; the jobs whose own event it is."""
        due, events = [], self.events
        while events and events[0][0] <= now + EPS_S:
            _, kind, rank, gen = heapq.heappop(events)
            if kind == 0 and self.jobs[rank].gen == gen:
                due.append(self.jobs[rank])
        return due

    def run(self, updates: int, limit_events: int = 5_000_000) -> Prediction:
        """Simulate ``updates`` local updates; the steady window's prediction."""
        for job in self.jobs:
            job.start_load(0.0, 0, 0)
            self._push(job, 0.0)
        iterations = 0
        while self.step < updates:
            iterations += 1
            while self.events and self.events[0][1] == 0 and self.jobs[self.events[0][2]].gen != self.events[0][3]:
                heapq.heappop(self.events)  # stale
            if not self.events:
                raise RuntimeError(f"plan: {self.k} deadlocks (no event left)")
            if iterations > limit_events:
                raise RuntimeError(f"plan: the simulation of {self.k} did not finish in {limit_events} events")
            now = self.events[0][0]
            due = sorted(self._due(now), key=lambda j: j.rank)
            for job in due:
                self.commit(job.take(now), now)
            self._trainer(now, updates)
            newest = self.newest(now)[0]
            serve = due
            if newest > self._seen_newest:
                self._seen_newest, serve = newest, self.jobs
            keys = self.order.key(newest)
            for job in sorted(serve, key=lambda j: keys[j.rank]):
                self.commit(job.take(now), now)  # nothing new: it ran to ``now`` or holds no event there
                job.service(now, self)
            self._trainer(now, updates)
            for job in serve:
                self._push(job, now)
        for job in self.jobs:  # the busy time up to the end, as the reference (whose batches all stop at ``now``)
            b = job.batch
            if b.mark_s > now:  # ran ahead, busy all the way (it stops only where nothing runs)
                b.busy_s -= b.mark_s - now
            else:
                b.advance_to(now)
        return steady_prediction(self.update_ends, updates, [j.batch.busy_s for j in self.jobs], self.lags,
                                 self.latencies, self.k)

    def commit(self, groups: list[Group], now: float, finished: bool = True) -> None:
        """Groups become visible to the trainer (their shard is sealed) at ``now``; ``finished``: they finished
        now too (else a drain held them since their finish)."""
        self.uncommitted -= len(groups)
        for g in groups:
            if finished:
                g.finished_s = now
            self.queue.append(g)


def predict(sim: SimulatedConfig, k: Knobs, updates: int, data_seed: int = 0, empirical=None,
            overhead_s: float = 0.0, draws: Optional[Draws] = None) -> Prediction:
    """The reference's ``predict`` (tests/plan_reference.py), fast (module docstring); ``draws`` shared by the
    candidates of a sweep."""
    draws = draws if draws is not None else draws_for(sim, k, data_seed, empirical)
    return Pipeline(sim, k, draws, data_seed, overhead_s).run(updates)
