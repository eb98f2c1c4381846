"""What a rollout job did with one weight version: one row of ``logs/rollout-<writer>.jsonl`` (:class:`VersionStats`),
and what each finished group adds to it (:class:`GroupInfo`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hpcrl.logs import metric_names as M
from hpcrl.rollout.engine import FINISH_LENGTH
from hpcrl.rollout.trajectory import TrajectoryState
from hpcrl.samples.schema import Group


@dataclass
class GroupInfo:
    """What a finished group adds to its version's counters besides the group itself."""

    truncated: int
    """Responses cut by length."""
    turns: list[int]
    """Turns (assistant + tool) of each trajectory."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_latency_s: float = 0.0
    resumed: bool = False
    """Continued from the state a previous job of this writer saved."""
    tool_error: str = ""
    """``<sample id>: <message>`` of the group's first tool error."""
    sample: dict = field(default_factory=dict)
    """One response of the group (its first), as the rollout log's ``sample/*`` columns."""

    @classmethod
    def of(cls, trajs: list[TrajectoryState], resumed: bool, group_id: str, sample: dict) -> "GroupInfo":
        """The counters of a finished group's trajectories."""
        errors = [f"{group_id}/{j}: {t.tool_error}" for j, t in enumerate(trajs) if t.tool_error]
        return cls(sum(t.finish_reason == FINISH_LENGTH for t in trajs), [t.num_turns for t in trajs],
                   sum(t.tool_calls for t in trajs), sum(t.tool_errors for t in trajs),
                   sum(t.tool_latency_s for t in trajs), resumed, errors[0][:300] if errors else "", sample)


def sample_columns(sample_id: str, prompt, response: str, reward: float) -> dict:
    """The rollout log's ``sample/*`` columns for one response (the prompt's last message, both cut)."""
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", ""))
    return {M.SAMPLE_ID: sample_id, M.SAMPLE_PROMPT: text[:200], M.SAMPLE_RESPONSE: response[:500],
            M.SAMPLE_REWARD: reward}


@dataclass
class VersionStats:
    """Counters of one weight version, written as a row when the next version is loaded."""

    param_version: int
    started_s: float = field(default_factory=time.time)
    groups: int = 0
    trajectories: int = 0
    tokens: int = 0
    truncated: int = 0
    partial_groups: int = 0
    resumed_groups: int = 0
    lag_carried: int = 0
    lag_dropped: int = 0
    pause_s: float = 0.0
    idle_s: float = 0.0
    load_s: float = 0.0
    reward_sum: float = 0.0
    turns_sum: int = 0
    turns_max: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_latency_s: float = 0.0
    sync: dict = field(default_factory=dict)
    """How the version arrived (the transport's ``last_load``: path, transfer/apply seconds, bytes)."""
    first_tool_error: str = ""
    """``<sample id>: <message>`` of the version's first tool error."""
    sample: dict = field(default_factory=dict)
    """One response of the version (:data:`hpcrl.logs.metric_names.SAMPLE_ID` ...), for the console."""
    prompts: dict = field(default_factory=dict)
    """What max_prompt_length did to the prompt file (filtered, truncated): the same in every row of a job."""

    def count(self, group: Group, truncated: int) -> None:
        """Add one finished group (``truncated`` of its responses were cut by length)."""
        self.groups += 1
        self.truncated += truncated
        self.trajectories += len(group.trajectories)
        self.tokens += sum(len(t.response_ids) for t in group.trajectories)
        self.reward_sum += sum(t.reward for t in group.trajectories)

    def withdraw(self, group: Group) -> None:
        """Take back a counted group refused at commit (it finishes again, and is counted then)."""
        self.groups -= 1
        self.trajectories -= len(group.trajectories)
        self.tokens -= sum(len(t.response_ids) for t in group.trajectories)
        self.reward_sum -= sum(t.reward for t in group.trajectories)

    def count_agent(self, turns: list[int], tool_calls: int, tool_errors: int, tool_latency_s: float) -> None:
        """Add a group's agent counters (turns per trajectory, its tool calls, failures, seconds in tools)."""
        self.turns_sum += sum(turns)
        self.turns_max = max([self.turns_max, *turns])
        self.tool_calls += tool_calls
        self.tool_errors += tool_errors
        self.tool_latency_s += tool_latency_s

    def note_group(self, tool_error: str, sample: dict) -> None:
        """Keep the version's first tool error and its first sampled response."""
        self.first_tool_error = self.first_tool_error or tool_error
        self.sample = self.sample or sample

    def row(self, writer: str) -> dict:
        """The log row of this version, its wall time ending now."""
        wall = max(time.time() - self.started_s, 1e-9)
        trajs = max(self.trajectories, 1)
        return {M.WRITER: writer, M.PARAM_VERSION: self.param_version, M.GROUPS: self.groups,
                M.TRAJECTORIES: self.trajectories, M.TOKENS: self.tokens, M.WALL_S: wall,
                M.ROLLOUT_IDLE_RATIO: min(1.0, self.idle_s / wall), M.LOAD_WEIGHTS_S: self.load_s,
                M.TOKENS_PER_S: self.tokens / wall, M.RESPONSE_CLIP_RATIO: self.truncated / trajs,
                M.PARTIAL_GROUPS: self.partial_groups, M.RESUMED_GROUPS: self.resumed_groups, M.PAUSE_S: self.pause_s,
                M.LAG_CARRIED: self.lag_carried, M.LAG_DROPPED: self.lag_dropped,
                M.NUM_TURNS_MEAN: self.turns_sum / trajs, M.NUM_TURNS_MAX: self.turns_max,
                M.TOOL_CALLS_MEAN: self.tool_calls / trajs, M.TOOL_ERRORS: self.tool_errors,
                M.TOOL_LATENCY_S: self.tool_latency_s / max(self.tool_calls, 1),
                M.ROLLOUT_REWARD_MEAN: self.reward_sum / trajs, M.TIME_S: time.time(), **self.sync,
                **self.prompts, **self.sample, **({M.TOOL_FIRST_ERROR: self.first_tool_error} if self.first_tool_error
                                                 else {})}
