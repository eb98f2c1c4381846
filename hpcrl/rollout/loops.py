"""The agent loops a run uses, by name: which loop a prompt row is generated with, and the loops
built once for a rollout job (the tool agent only when a row uses it: it checks the tokenizer's
chat template and builds the tools)."""
from __future__ import annotations

from typing import Callable, Iterable

from hpcrl.config import AgentConfig, names
from hpcrl.rollout.agent_loop import AgentLoop

SINGLE_TURN, TOOL_AGENT = names.AGENT_LOOPS
"""The loops' names (``agent.default``, a row's ``agent_name``)."""


def _single_turn(cfg: AgentConfig, tokenizer) -> AgentLoop:
    from hpcrl.rollout.single_turn import SingleTurnLoop
    return SingleTurnLoop()


def _tool_agent(cfg: AgentConfig, tokenizer) -> AgentLoop:
    from hpcrl.rollout.tool_agent import ToolAgentLoop
    return ToolAgentLoop(cfg, tokenizer)


LOOPS: dict[str, Callable[[AgentConfig, object], AgentLoop]] = {SINGLE_TURN: _single_turn, TOOL_AGENT: _tool_agent}
"""Loop builder by name (the allowed names: :data:`hpcrl.config.names.AGENT_LOOPS`)."""


def loop_name(row: dict, cfg: AgentConfig) -> str:
    """The loop a prompt row is generated with: its ``agent_name``, else ``agent.default``."""
    return row.get("agent_name") or cfg.default


def make_loops(cfg: AgentConfig, tokenizer, rows: Iterable[dict]) -> dict[str, AgentLoop]:
    """The loops the rows name, built once; ValueError (naming the allowed ones) for a name with no loop."""
    wanted = sorted({loop_name(r, cfg) for r in rows})
    unknown = [n for n in wanted if n not in LOOPS]
    if unknown:
        raise ValueError(f"agent loop {unknown[0]!r} (a row's agent_name or agent.default); allowed: {', '.join(LOOPS)}")
    return {name: LOOPS[name](cfg, tokenizer) for name in wanted}
