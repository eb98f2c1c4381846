"""What went wrong in the rollout jobs, counted: reward functions that raised, tool calls that failed,
prompts filtered or cut by ``data.max_prompt_length``; with the first message and sample id of each
kind. Read from the rollout jobs' per-version rows (``logs/rollout-<writer>.jsonl``:
:data:`hpcrl.logs.metric_names.PROBLEM_COUNTS` and the ``*/first_error`` texts); shown by ``hpcrl status``
and the report (``hpcrl run`` counts them per version line, :mod:`hpcrl.launcher.progress`).
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from hpcrl.logs import metric_names as M


@dataclass
class Problems:
    """One writer's problems over the rows read."""

    writer: str
    reward_errors: int = 0
    """Responses whose reward function raised (each scored 0)."""
    tool_errors: int = 0
    """Tool calls that failed or did not parse (each ended its episode)."""
    prompts_filtered: int = 0
    """Prompts of the file dropped for length (the same for the whole job)."""
    prompts_truncated: int = 0
    """Prompts cut to the length limit."""
    first_reward_error: str = ""
    """``v<version> <sample id>: <message>`` of the first reward error."""
    first_tool_error: str = ""
    """The same for the first tool error."""

    @property
    def any(self) -> bool:
        return bool(self.reward_errors or self.tool_errors or self.prompts_filtered or self.prompts_truncated)

    def line(self) -> str:
        """``w000: reward errors 16 (first: v3 w000/12/0: ZeroDivisionError: ...); 3 prompts filtered``."""
        parts = []
        if self.reward_errors:
            parts.append(f"reward errors {self.reward_errors}" + (f" (first: {self.first_reward_error})"
                                                                   if self.first_reward_error else ""))
        if self.tool_errors:
            parts.append(f"tool errors {self.tool_errors}" + (f" (first: {self.first_tool_error})"
                                                               if self.first_tool_error else ""))
        if self.prompts_filtered:
            parts.append(f"{self.prompts_filtered} prompts filtered (over data.max_prompt_length)")
        if self.prompts_truncated:
            parts.append(f"{self.prompts_truncated} prompts truncated to data.max_prompt_length")
        return f"{self.writer}: " + ("; ".join(parts) if parts else "none")


def _int(value) -> int:
    try:
        return int(value) if value == value else 0  # NaN (a row of an older hpcrl) counts as 0
    except (TypeError, ValueError):
        return 0


def tally(writer: str, rows: list[dict]) -> Problems:
    """The problems in one writer's rows."""
    p = Problems(writer)
    for r in rows:
        p.reward_errors += _int(r.get(M.REWARD_ERRORS))
        p.tool_errors += _int(r.get(M.TOOL_ERRORS))
        p.prompts_filtered = max(p.prompts_filtered, _int(r.get(M.PROMPTS_FILTERED)))
        p.prompts_truncated = max(p.prompts_truncated, _int(r.get(M.PROMPTS_TRUNCATED)))
        for attr, key in (("first_reward_error", M.REWARD_FIRST_ERROR), ("first_tool_error", M.TOOL_FIRST_ERROR)):
            text = r.get(key)
            if isinstance(text, str) and text and not getattr(p, attr):
                setattr(p, attr, f"v{r.get(M.PARAM_VERSION)} {text}")
    return p


def problems_of(rollout: pd.DataFrame) -> list[Problems]:
    """Each writer's problems in a report's rollout frame (one row per writer and version)."""
    if rollout.empty or M.WRITER not in rollout:
        return []
    return [tally(str(w), rows.to_dict("records")) for w, rows in rollout.groupby(M.WRITER, sort=True)]


def problems_table(rollout: pd.DataFrame) -> pd.DataFrame:
    """One row per writer: reward errors, tool errors, prompts filtered / truncated, first messages."""
    return pd.DataFrame([{"writer": p.writer, "reward errors": p.reward_errors, "tool errors": p.tool_errors,
                          "prompts filtered": p.prompts_filtered, "prompts truncated": p.prompts_truncated,
                          "first reward error": p.first_reward_error or "-",
                          "first tool error": p.first_tool_error or "-"} for p in problems_of(rollout)])
