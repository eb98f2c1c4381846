"""The tool agent: a multi-turn trajectory as a state machine, resumable in any state.

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

The whole state (:class:`AgentTrajectory`) is plain data with a JSON form, so a trajectory
stopped anywhere -- mid-generation or mid-tool-call -- is saved and resumed by a restarted
job (``hpcrl/rollout/resume.py``); tool calls that were running are simply run again.

What it waits for: the engine (every call is bounded by the caller's ``EngineRunner``
deadline), the tools (each bounded by its own wall-clock limit), and between two turns the
:class:`~hpcrl.rollout.partial.EngineGate`: when the gate is closed (weights switching, job
stopping) :meth:`ToolAgent.advance` returns and the group parks there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional

from hpcrl.config import AgentConfig, names
from hpcrl.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Engine, EngineRunner
from hpcrl.rollout.partial import EngineGate
from hpcrl.rollout.tool_parsers import PARSERS, ToolCall
from hpcrl.rollout.tools import ToolResult, make_tools

SINGLE_TURN, TOOL_AGENT = names.AGENT_LOOPS
"""The agent loops: one response per trajectory, or the tool agent of this file."""
PENDING, GENERATING, PROCESSING_TOOLS, TERMINATED = "pending", "generating", "processing_tools", "terminated"
AGENT_STATES = (PENDING, GENERATING, PROCESSING_TOOLS, TERMINATED)
FINISH_TOOL_ERROR = "tool_error"
"""A tool call failed or did not parse: the episode ends there, counted."""
FINISH_MAX_TURNS = "max_turns"
"""``agent.max_assistant_turns`` or ``max_user_turns`` reached with a call still asked for."""
TOOL_POLL_S = 0.05
"""How often a running tool call looks whether the job is stopping."""


@dataclass
class AgentTrajectory:
    """Where one trajectory is: its state, its response so far, its counters. Plain data, JSON both ways."""

    state: str = PENDING
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 on tokens the model sampled, 0 on tool tokens."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Version that sampled each model token; a tool token has its turn's version."""
    turn_start: int = 0
    """Index in ``tokens`` where the current assistant turn began."""
    assistant_turns: int = 0
    user_turns: int = 0
    """Tool-response turns appended."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_latency_s: float = 0.0
    pending_calls: list[dict] = field(default_factory=list)
    """Calls parsed from the last turn, not yet answered (``{name, arguments}``)."""
    segments: int = 0
    """Engine calls so far (a turn cut by an abort is two)."""
    finish_reason: Optional[str] = None

    def to_json(self) -> dict:
        """The state as JSON-ready data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "AgentTrajectory":
        """The state :meth:`to_json` wrote; ValueError if it is not one."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) - names or d.get("state") not in AGENT_STATES:
            raise ValueError(f"not an agent trajectory state: {str(d)[:200]}")
        t = cls(**d)
        if not len(t.tokens) == len(t.mask) == len(t.logprobs) == len(t.versions):
            raise ValueError("agent trajectory state: tokens, mask, log-probs and versions differ in length")
        return t

    @property
    def num_turns(self) -> int:
        """Assistant turns plus tool-response turns."""
        return self.assistant_turns + self.user_turns

    def reward_info(self) -> dict:
        """The counters the reward function gets in ``extra_info``."""
        return {"num_turns": self.num_turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors}

    def add(self, tokens: list[int], logprobs: list[float], version: int, model: bool) -> None:
        """Append tokens the model sampled (``model``) or a tool's response."""
        self.tokens += tokens
        self.logprobs += logprobs
        self.mask += [1 if model else 0] * len(tokens)
        self.versions += [version] * len(tokens)

    def terminate(self, reason: str) -> None:
        self.state, self.finish_reason, self.pending_calls = TERMINATED, reason, []


def agent_loop(row: dict, cfg: AgentConfig) -> str:
    """The loop a prompt row is generated with: its ``agent_name``, else ``agent.default``."""
    return row.get("agent_name") or cfg.default


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


class ToolAgent:
    """Runs :class:`AgentTrajectory` state machines on the engine's event loop (module docstring)."""

    def __init__(self, cfg: AgentConfig, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tools = make_tools(cfg.tools)
        self.parser = PARSERS[cfg.tool_parser](tokenizer, sorted(self.tools))
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("agent: the tokenizer has no chat template to render tool responses with")
        self.prefix = template_prefix(tokenizer)

    async def advance(self, traj: AgentTrajectory, engine: Engine, gate: EngineGate, version: int,
                      prompt_ids: list[int], seed: int, budget: int) -> None:
        """Run ``traj`` until it terminates, or until it must wait: its generation was aborted
        (new weights), the gate closed between two steps, or the job is stopping mid-tool-call."""
        while traj.state != TERMINATED:
            if traj.state == PENDING:
                traj.state, traj.turn_start = GENERATING, len(traj.tokens)
            if traj.state == GENERATING:
                if not gate.is_open():
                    return
                if not await self._generate(traj, engine, version, prompt_ids, seed, budget):
                    return
            if traj.state == PROCESSING_TOOLS and not await self._run_tools(traj, gate, version, budget):
                return

    async def _generate(self, traj: AgentTrajectory, engine: Engine, version: int, prompt_ids: list[int],
                        seed: int, budget: int) -> bool:
        """One engine call of the current turn; False if it was aborted (continue after the switch)."""
        left = budget - len(traj.tokens)
        (sample,) = await engine.generate(prompt_ids + traj.tokens, 1, seed + 7919 * traj.segments,
                                          max_new_tokens=left)
        traj.segments += 1
        traj.add(sample.response_ids.tolist(), sample.logprobs.tolist(), version, model=True)
        if sample.finish_reason == FINISH_ABORT and len(traj.tokens) < budget:
            return False
        self._end_turn(traj, FINISH_LENGTH if sample.finish_reason != FINISH_STOP else FINISH_STOP, budget)
        return True

    def _end_turn(self, traj: AgentTrajectory, reason: str, budget: int) -> None:
        """The assistant turn is complete: decide what comes next from its text."""
        traj.assistant_turns += 1
        if reason == FINISH_LENGTH or len(traj.tokens) >= budget:
            traj.terminate(FINISH_LENGTH)
            return
        calls, error = self.parser.parse(self.tokenizer.decode(traj.tokens[traj.turn_start:], skip_special_tokens=False))
        if error is not None:
            traj.tool_errors += 1
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
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult("", ok=False, error=f"unknown tool {call.name!r}; tools: {', '.join(self.tools)}")
        try:
            result = tool(**call.arguments)
        except Exception as e:  # noqa: BLE001 - bad arguments are the model's error, not the job's
            result = ToolResult("", ok=False, error=f"{type(e).__name__}: {e}")
        result.latency_s = time.monotonic() - t0
        return result

    async def _run_tools(self, traj: AgentTrajectory, gate: EngineGate, version: int, budget: int) -> bool:
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


def generate_agent_group(agent: ToolAgent, engine: Engine, runner: EngineRunner, gate: EngineGate,
                         prompt_ids: list[int], trajs: list[AgentTrajectory], seed: int, budget: int,
                         timeout_s: float, what: str) -> list[AgentTrajectory]:
    """Run a group's trajectories (fresh or saved) to the end, together on the engine's loop; between
    rounds the group waits at the gate (weights switching). GroupAborted if the job stops."""
    while any(t.state != TERMINATED for t in trajs):
        version = gate.enter(timeout_s)
        runner.call(lambda: asyncio.gather(*(
            agent.advance(t, engine, gate, version, prompt_ids, seed + 1_000_003 * j, budget)
            for j, t in enumerate(trajs) if t.state != TERMINATED)), timeout_s, what)
    return trajs
