"""The agent loops a run uses, by name: which loop a prompt row is generated with, and the loops
built once for a rollout job (the tool agent only when a row uses it: it checks the tokenizer's
chat template and builds the tools)."""
from __future__ import annotations

from typing import Iterable

from hpcrl.config import AgentConfig
from hpcrl.config.names import SINGLE_TURN, TOOL_AGENT
from hpcrl.config.registries import AGENT_LOOPS, resolve
from hpcrl.rollout.agent_loop import AgentLoop

__all__ = ["SINGLE_TURN", "TOOL_AGENT", "loop_name", "make_loops"]
"""The loops' names (keys of :data:`hpcrl.config.registries.AGENT_LOOPS`), re-exported for the callers."""


def loop_name(row: dict, cfg: AgentConfig) -> str:
    """The loop a prompt row is generated with: its ``agent_name``, else ``agent.default``."""
    return row.get("agent_name") or cfg.default


def make_loops(cfg: AgentConfig, tokenizer, rows: Iterable[dict]) -> dict[str, AgentLoop]:
    """The loops the rows name, built once; ValueError (naming the allowed ones) for a name with no loop."""
    wanted = sorted({loop_name(r, cfg) for r in rows})
    unknown = [n for n in wanted if n not in AGENT_LOOPS]
    if unknown:
        raise ValueError(f"agent loop {unknown[0]!r} (a row's agent_name or agent.default); allowed: "
                         f"{', '.join(AGENT_LOOPS)}")
    return {name: resolve(AGENT_LOOPS[name]).build(cfg, tokenizer) for name in wanted}
