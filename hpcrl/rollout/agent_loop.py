"""The agent-loop protocol: how a prompt becomes a group of trajectories, whatever the loop.

An :class:`AgentLoop` advances the unfinished trajectories of one group under one weight version
until each has terminated or must wait (its engine call was aborted for new weights, or the gate
closed between two of its steps). :func:`run_group` drives any loop: it enters the gate, lets the
loop step, and repeats until every trajectory has terminated. The trajectories are
:class:`~hpcrl.rollout.trajectory.TrajectoryState` (one type, JSON both ways), so a group parked at
a weight switch or stopped with its job is saved and continued whatever its loop.

Loops: ``single_turn.py`` (one response per trajectory) and ``tool_agent.py`` (multi-turn with tool
calls); ``loops.py`` builds the ones a run's rows name. A new loop is one file implementing
:class:`AgentLoop` and one line in the registry, :data:`hpcrl.config.registries.AGENT_LOOPS`.

Seeds are derived here only: a group's from the data seed and its prompt index, each engine call's
from the group's, the trajectory's position and how many calls it has made.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

from hpcrl.config import AgentConfig
from hpcrl.rollout.engine import Engine, EngineRunner
from hpcrl.rollout.gate import EngineGate
from hpcrl.rollout.trajectory import TrajectoryState

SEED_MOD = 2**63


def group_seed(data_seed: int, prompt_index: int) -> int:
    """The seed of the group of ``prompt_index``: the same prompt gets the same seed in any job."""
    return (data_seed * 1_000_003 + prompt_index) % SEED_MOD


def call_seed(seed: int, position: int, segment: int) -> int:
    """The seed of one engine call: trajectory ``position`` of a group seeded ``seed``, its ``segment``-th call."""
    return (seed + 1_000_003 * position + 7919 * segment) % SEED_MOD


@dataclass
class GroupContext:
    """What every step of one group's generation needs."""

    engine: Engine
    gate: EngineGate
    prompt_ids: list[int]
    seed: int
    """:func:`group_seed` of the prompt."""
    budget: int
    """Tokens a trajectory may have in all (``rollout.response_length``; tool tokens count)."""


class AgentLoop(abc.ABC):
    """One way to generate a group (module docstring); runs on the engine's event loop."""

    name: str = ""
    """The loop's name in ``agent.default`` and a row's ``agent_name`` (its key in the registry,
    :data:`hpcrl.config.registries.AGENT_LOOPS`)."""

    @classmethod
    def build(cls, cfg: AgentConfig, tokenizer) -> "AgentLoop":
        """The loop a rollout job or the evaluation builds once (a loop that needs the agent config or the
        tokenizer overrides this)."""
        return cls()

    @abc.abstractmethod
    async def step(self, ctx: GroupContext, trajs: list[TrajectoryState], version: int) -> None:
        """Advance every unfinished trajectory in ``trajs`` under ``version`` until it terminates or must
        wait for the gate (an abort for new weights, the gate closed, the job stopping)."""

    def reward_info(self, traj: TrajectoryState) -> Optional[dict]:
        """What the reward function gets as ``extra_info`` besides the row's own (None: nothing)."""
        return None


def run_group(loop: AgentLoop, ctx: GroupContext, trajs: list[TrajectoryState], runner: EngineRunner,
              timeout_s: float, what: str) -> list[TrajectoryState]:
    """Run a group's trajectories (fresh or saved) to the end; between rounds the group waits at the gate
    (weights switching; at most ``timeout_s``), and every round is bounded by ``timeout_s`` too.
    GroupAborted if the job stops."""
    while not all(t.done for t in trajs):
        version = ctx.gate.enter(timeout_s)
        runner.call(lambda: loop.step(ctx, trajs, version), timeout_s, what)
    return trajs
