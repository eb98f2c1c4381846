"""The single-turn loop: one response per trajectory, possibly sampled in segments under several
versions (``async_training.partial_rollout``).

A fresh group is one engine call for its ``n`` responses (the engine batches them). A response cut by
an abort (new weights) continues as its own request: prompt + its tokens so far, with what is left of
its budget, under the next version. It ends with EOS (stop) or at ``rollout.response_length`` tokens
(length). Every token keeps the version that sampled it, so the trainer's per-token lag and importance
weights see exactly which policy produced what.
"""
from __future__ import annotations

import asyncio

from hpcrl.config import names
from hpcrl.rollout.agent_loop import AgentLoop, GroupContext, call_seed
from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH, Sample
from hpcrl.rollout.trajectory import GENERATING, TrajectoryState


def extend(traj: TrajectoryState, sample: Sample, version: int, budget: int) -> None:
    """Append what one engine call sampled under ``version``; end the response if the engine did
    (stop, length) or its budget is spent."""
    traj.state = GENERATING
    traj.add(sample.response_ids.tolist(), sample.logprobs.tolist(), version, model=True)
    traj.segments += 1
    if sample.finish_reason != FINISH_ABORT:
        traj.assistant_turns = 1
        traj.terminate(sample.finish_reason)
    elif len(traj.tokens) >= budget:
        traj.assistant_turns = 1
        traj.terminate(FINISH_LENGTH)


class SingleTurnLoop(AgentLoop):
    """One response per trajectory (module docstring)."""

    name = names.SINGLE_TURN

    async def step(self, ctx: GroupContext, trajs: list[TrajectoryState], version: int) -> None:
        todo = [j for j, t in enumerate(trajs) if not t.done]
        sampled = [j for j in todo if not trajs[j].greedy]
        if all(t.segments == 0 for t in trajs):  # a fresh group: its n sampled responses in one call
            todo = sampled + [j for j in todo if trajs[j].greedy]
            calls = await asyncio.gather(ctx.engine.generate(ctx.prompt_ids, len(sampled), ctx.seed), *(
                ctx.engine.generate(ctx.prompt_ids, 1, ctx.seed, greedy=True) for j in todo[len(sampled):]))
        else:
            calls = await asyncio.gather(*(
                ctx.engine.generate(ctx.prompt_ids + trajs[j].tokens, 1, call_seed(ctx.seed, j, trajs[j].segments),
                                    max_new_tokens=ctx.budget - len(trajs[j].tokens), greedy=trajs[j].greedy)
                for j in todo))
        samples = [s for call in calls for s in call]
        for j, s in zip(todo, samples):
            extend(trajs[j], s, version, ctx.budget)
