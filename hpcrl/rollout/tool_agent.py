"""The tool agent: a multi-turn trajectory as a state machine, resumable in any state (an
:class:`~hpcrl.rollout.agent_loop.AgentLoop`).

::

    pending -> generating -> processing_tools -> generating -> ... -> terminated

- **generating**: one assistant turn from prompt + everything so far, at most what is left of
  ``rollout.response_length`` (the budget covers tool tokens too, as in verl). Its tokens get
  mask 1, the engine's log-probs and the version that sampled them. An abort (new weights,
  partial rollout) keeps the tokens so far; the turn continues under the next version.
- the turn ends: tool calls are parsed from its text (:mod:`hpcrl.rollout.tool_parsers`). No
  call ends the episode (``stop``); a call that does not parse is a tool error;
  ``agent.max_assistant_turns`` / ``max_user_turns`` end it (``max_turns``); else the first
  ``agent.max_parallel_calls`` calls become the state's ``pending_calls``.
- **processing_tools**: the pending calls run at once (threads; the Python tool is a
  subprocess with its own limits). A failed call ends the episode cleanly (``tool_error``,
  counted). Otherwise the results, each cut to ``agent.max_tool_response_chars`` characters,
  are rendered as ``tool`` messages through the tokenizer's chat template, without the prefix
  the template puts before every conversation (found once by diffing one against two empty
  turns, as verl does), and appended with mask 0.

The whole state (:class:`~hpcrl.rollout.trajectory.TrajectoryState`) is plain data with a JSON
form, so a trajectory stopped anywhere -- mid-generation or mid-tool-call -- is saved and resumed
by a restarted job (``hpcrl/rollout/in_flight.py``); tool calls that were running are simply run again.

What it waits for: the engine (every call is bounded by the caller's ``EngineRunner``
deadline), the tools (each bounded by its own wall-clock limit), and between two turns the
:class:`~hpcrl.rollout.gate.EngineGate`: when the gate is closed (weights switching, job
stopping) :meth:`ToolAgentLoop.advance` returns and the group parks there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Optional

from hpcrl.config import AgentConfig, names, registries
from hpcrl.process import faults
from hpcrl.rollout.agent_loop import AgentLoop, GroupContext, call_seed
from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from hpcrl.rollout.gate import EngineGate
from hpcrl.rollout.tool_parsers import ToolCall
from hpcrl.rollout.tools import ToolResult, make_tools
from hpcrl.rollout.trajectory import GENERATING, PENDING, PROCESSING_TOOLS, TERMINATED, TrajectoryState

FINISH_TOOL_ERROR = "tool_error"
"""A tool call failed or did not parse: the episode ends there, counted."""
FINISH_MAX_TURNS = "max_turns"
"""``agent.max_assistant_turns`` or ``max_user_turns`` reached with a call still asked for."""
TOOL_POLL_S = 0.05
"""How often a running tool call looks whether the job is stopping."""


def template_prefix(tokenizer) -> str:
    """What the chat template writes before any conversation (e.g. a default system prompt):
    one empty turn is prefix + T, two are prefix + 2T."""
    def render(k: int) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": ""}] * k, tokenize=False,
                                             add_generation_prompt=False)

    one, two = render(1), render(2)
    n = 2 * len(one) - len(two)
    if n < 0 or not two.startswith(one[:n]):
        raise ValueError("the tokenizer's chat template does not repeat turns the same way: cannot append "
                         "tool responses to a conversation with it")
    return one[:n]


class ToolAgentLoop(AgentLoop):
    """Runs trajectory state machines with tool calls on the engine's event loop (module docstring)."""

    name = names.TOOL_AGENT

    @classmethod
    def build(cls, cfg: AgentConfig, tokenizer) -> "ToolAgentLoop":
        """With the run's tools and parser, on the tokenizer's chat template."""
        return cls(cfg, tokenizer)

    def __init__(self, cfg: AgentConfig, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tools = make_tools(cfg.tools)
        self.parser = registries.resolve(registries.TOOL_PARSERS[cfg.tool_parser])(tokenizer, sorted(self.tools))
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("agent: the tokenizer has no chat template to render tool responses with")
        self.prefix = template_prefix(tokenizer)

    async def step(self, ctx: GroupContext, trajs: list[TrajectoryState], version: int) -> None:
        await asyncio.gather(*(self.advance(t, ctx, version, j) for j, t in enumerate(trajs) if not t.done))

    def reward_info(self, traj: TrajectoryState) -> Optional[dict]:
        """The counters the reward function gets in ``extra_info``."""
        return {"num_turns": traj.num_turns, "tool_calls": traj.tool_calls, "tool_errors": traj.tool_errors}

    async def advance(self, traj: TrajectoryState, ctx: GroupContext, version: int, position: int) -> None:
        """Run ``traj`` (the ``position``-th of its group) until it terminates, or until it must wait: its
        generation was aborted (new weights), the gate closed between two steps, or the job is stopping
        mid-tool-call."""
        while traj.state != TERMINATED:
            if traj.state == PENDING:
                traj.state, traj.turn_start = GENERATING, len(traj.tokens)
            if traj.state == GENERATING:
                if not ctx.gate.is_open():
                    return
                if not await self._generate(traj, ctx, version, position):
                    return
            if traj.state == PROCESSING_TOOLS and not await self._run_tools(traj, ctx.gate, version, ctx.budget):
                return

    async def _generate(self, traj: TrajectoryState, ctx: GroupContext, version: int, position: int) -> bool:
        """One engine call of the current turn; False if it was aborted (continue after the switch)."""
        budget = ctx.budget
        left = budget - len(traj.tokens)
        (sample,) = await ctx.engine.generate(ctx.prompt_ids + traj.tokens, 1, call_seed(ctx.seed, position, traj.segments),
                                              max_new_tokens=left, greedy=traj.greedy)
        traj.segments += 1
        traj.add(sample.response_ids.tolist(), sample.logprobs.tolist(), version, model=True)
        if sample.finish_reason == FINISH_ABORT and len(traj.tokens) < budget:
            return False
        self._end_turn(traj, FINISH_LENGTH if sample.finish_reason != FINISH_STOP else FINISH_STOP, budget)
        return True

    def _end_turn(self, traj: TrajectoryState, reason: str, budget: int) -> None:
        """The assistant turn is complete: decide what comes next from its text."""
        traj.assistant_turns += 1
        if reason == FINISH_LENGTH or len(traj.tokens) >= budget:
            traj.terminate(FINISH_LENGTH)
            return
        calls, error = self.parser.parse(self.tokenizer.decode(traj.tokens[traj.turn_start:], skip_special_tokens=False))
        if error is not None:
            traj.tool_errors += 1
            traj.tool_error = traj.tool_error or f"the call did not parse: {error}"
            traj.terminate(FINISH_TOOL_ERROR)
        elif not calls:
            traj.terminate(FINISH_STOP)
        elif traj.assistant_turns >= self.cfg.max_assistant_turns or traj.user_turns >= self.cfg.max_user_turns:
            traj.terminate(FINISH_MAX_TURNS)
        else:
            traj.pending_calls = [dataclasses.asdict(c) for c in calls[:self.cfg.max_parallel_calls]]
            traj.state = PROCESSING_TOOLS

    def call_tool(self, call: ToolCall) -> ToolResult:
        """One call (in a worker thread); never raises."""
        t0 = time.monotonic()
        faults.point("tool_call")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult("", ok=False, error=f"unknown tool {call.name!r}; tools: {', '.join(self.tools)}")
        try:
            result = tool(**call.arguments)
        except Exception as e:  # noqa: BLE001 - bad arguments are the model's error, not the job's
            result = ToolResult("", ok=False, error=f"{type(e).__name__}: {e}")
        result.latency_s = time.monotonic() - t0
        return result

    async def _run_tools(self, traj: TrajectoryState, gate: EngineGate, version: int, budget: int) -> bool:
        """Answer the pending calls; False (state unchanged, calls still pending) if the job stops meanwhile."""
        tasks = [asyncio.ensure_future(asyncio.to_thread(self.call_tool, ToolCall(**c))) for c in traj.pending_calls]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=TOOL_POLL_S)
            if gate.stopping:
                for t in tasks:
                    t.cancel()
                return False
        results = [t.result() for t in tasks]
        traj.tool_calls += len(results)
        traj.tool_latency_s += sum(r.latency_s for r in results)
        failed = sum(not r.ok for r in results)
        if failed:
            traj.tool_errors += failed
            traj.tool_error = traj.tool_error or next(r.error for r in results if not r.ok)
            traj.terminate(FINISH_TOOL_ERROR)
            return True
        ids = self.tool_response_ids([self._truncate(r.text) for r in results])
        traj.user_turns += 1
        turn_version = traj.versions[-1] if traj.versions else version
        traj.add(ids, [0.0] * len(ids), turn_version, model=False)
        traj.pending_calls = []
        if len(traj.tokens) >= budget:
            del traj.tokens[budget:], traj.mask[budget:], traj.logprobs[budget:], traj.versions[budget:]
            traj.terminate(FINISH_LENGTH)
        else:
            traj.state, traj.turn_start = GENERATING, len(traj.tokens)
        return True

    def _truncate(self, text: str) -> str:
        limit = self.cfg.max_tool_response_chars
        return text if len(text) <= limit else text[:limit] + "...(truncated)"

    def tool_response_ids(self, texts: list[str]) -> list[int]:
        """Tokens of the tool messages and the next assistant turn's header, as the chat template
        writes them after the conversation so far (its conversation prefix stripped)."""
        text = self.tokenizer.apply_chat_template([{"role": "tool", "content": t} for t in texts], tokenize=False,
                                                  add_generation_prompt=True)
        if text.startswith(self.prefix):
            text = text[len(self.prefix):]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
