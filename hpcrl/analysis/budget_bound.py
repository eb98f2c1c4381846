"""The budget-aware bound: what the admission budget adds to the ideal-overlap bound (``ceiling.py``).

The ideal-overlap bound ``max(generation + switch, update + publish)`` lets the rollout run as far ahead of
the trainer as it likes. The admission budget does not (``control/admission.py``, as verl's
``max_required_samples``): while a job holds version ``v`` the fleet may have started at most
``consumed(v) + B`` groups, ``B = floor((1 + s) * K * R)``, ``consumed(v) = v * K * R``. Counting starts:

- update ``j`` needs ``j * R`` committed groups, so the ``j * R``-th start has happened;
- the ``x``-th start needs a version ``v`` with ``x <= v*K*R + B``: update ``j`` needs version
  ``v_j = ceil((j*R - B) / (K*R))`` loaded, published after update ``v_j * K``;
- before that load at most ``(v_j - 1)*K*R + B`` groups had started, so at least
  ``n_j = j*R - (v_j - 1)*K*R - B`` (``0 < n_j <= K*R``) of update ``j``'s groups start after it, and at most
  ``K*R`` start there (all the budget the load frees).

So a chain runs through every period of ``K`` updates: update ``v_j*K`` ends -> publish -> weight switch ->
``n_j`` of the (at most ``K*R``) groups started at the load finish -> update ``j`` runs -> the updates after
it up to the end of its period ``j' = ceil(j/K)*K`` run. From the end of update ``v_j*K`` to the end of
update ``j'`` there are ``j' - v_j*K`` update slots, hence per update::

    step >= (publish + switch + g(n_j of K*R) + (j' - j + 1) * update) / (j' - v_j*K)   for each j of a period

with ``g(n of k)`` the expected ``n``-th smallest of ``k`` group latencies (a group's first start to its
finish, drawn from the run's own groups: a long tail makes ``g(2 of 4)`` more than half of ``g(4 of 4)``).
Publish, switch and update are the run's own per-version and per-update times. s=0, K=1: the on-policy
sequence ``publish + switch + slowest of R groups + update``; s=0.5, R=4: ``... + 2nd fastest of 4 + ...``;
s=1, K=1: the chain spans two updates; K=2, s=0: ``(publish + switch + slowest of 2R + update) / 2``.
The budget-aware bound is the larger of this and the ideal-overlap bound.

It is a bound in expectation over the run's measured latencies, with the mean update time; control-plane
latencies (polling, commits) are not in it. Against the planner's event simulation on its own latencies it
is the simulated step within 4 % for K=1 (``tests/test_budget_bound.py``); for K >= 2 the update on the
chain trains on the groups that finished first, which are shorter than the mean, so there it can be up to
8 % above what the planner reaches (K=2, R=4, s=0.5).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from hpcrl.config.knobs import admission_budget


@dataclass(frozen=True)
class Link:
    """Update ``j`` of a period and the start it waits for (module docstring)."""

    update: int
    span_updates: int
    """``j' - v_j*K``: update slots from the end of update ``v_j*K`` (then the version j needs is published) to
    the end of j's period."""
    chain_updates: int
    """``j' - j + 1``: updates on the chain (j and those after it in its period)."""
    needed_groups: int
    """``n_j``: groups of its batch that can only start once that version is loaded."""


def links(K: int, R: int, B: int) -> list[Link]:
    """One period of ``K`` updates (the pattern repeats every K), in the notation of the module docstring."""
    if K < 1 or R < 1 or B < K * R:
        raise ValueError(f"need K >= 1, R >= 1 and B >= K*R (s >= 0); got K={K}, R={R}, B={B}")
    out = []
    for j in range(B // R + 1, B // R + 1 + K):  # past the start-up, where updates wait for version >= 1
        v = -((B - j * R) // (K * R))  # ceil((j*R - B) / (K*R))
        end = -(-j // K) * K  # j' = ceil(j / K) * K
        out.append(Link(j, end - v * K, end - j + 1, j * R - (v - 1) * K * R - B))
    return out


def order_statistic_mean(values, n: int, k: int) -> float:
    """Expected ``n``-th smallest of ``k`` independent draws from the empirical distribution of ``values``."""
    x = np.sort(np.asarray(values, dtype=float))
    if not 1 <= n <= k or len(x) == 0:
        raise ValueError(f"need 1 <= n <= k and some values; got n={n}, k={k}, {len(x)} values")
    F = np.arange(len(x) + 1) / len(x)  # F(x_(i)) = i / N, with F = 0 below the smallest
    at_most = np.array([sum(math.comb(k, m) * f ** m * (1 - f) ** (k - m) for m in range(n, k + 1)) for f in F])
    return float(np.dot(x, np.diff(at_most)))


@dataclass
class BudgetChain:
    """The chain of the module docstring for one run: its per-version and per-update phase times."""

    K: int
    R: int
    B: int
    publish_s: float
    """Per version."""
    switch_s: float
    """Per version (one rollout job's load)."""
    update_s: float
    """Per update."""
    group_latencies_s: list[float]
    """The run's group latencies (first start to finish), wall seconds."""

    def step_s(self, link: Link) -> float:
        """The step time ``link`` forces."""
        g = order_statistic_mean(self.group_latencies_s, link.needed_groups, self.K * self.R)
        return (self.publish_s + self.switch_s + g + link.chain_updates * self.update_s) / link.span_updates

    def with_staleness(self, s: float) -> "BudgetChain":
        """The same run's chain under another staleness_threshold (B recomputed as RunConfig.admission_budget)."""
        return dataclasses.replace(self, B=admission_budget(s, self.K, self.R))

    @property
    def binding(self) -> Link:
        return max(links(self.K, self.R, self.B), key=self.step_s)

    @property
    def per_update_s(self) -> float:
        """The least step time the budget allows (the largest over a period's links)."""
        return self.step_s(self.binding)

    def describe(self) -> str:
        b = self.binding
        g = order_statistic_mean(self.group_latencies_s, b.needed_groups, self.K * self.R)
        return (f"publish {self.publish_s:.2f}s + switch {self.switch_s:.2f}s + {_nth(b.needed_groups)} fastest of "
                f"{self.K * self.R} groups {g:.2f}s + "
                + (f"{b.chain_updates} x " if b.chain_updates > 1 else "") + f"update {self.update_s:.2f}s"
                + (f", over {b.span_updates} updates" if b.span_updates > 1 else "") + " per update")


def _nth(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
