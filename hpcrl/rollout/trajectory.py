"""One trajectory in flight, whatever agent loop generates it: plain data, JSON both ways.

::

    pending -> generating -> [processing_tools -> generating -> ...] -> terminated

A single-turn trajectory goes pending -> generating -> terminated (possibly in several engine calls,
when partial rollout cuts it at a weight switch); the tool agent adds tool turns. Every token keeps
its mask (1: sampled by the model, 0: a tool's response), its log-prob under the distribution it was
sampled from (0 on tool tokens) and the weight version that produced it. Because the whole state is
data, a group stopped anywhere (mid-generation, mid-tool-call) is saved by the rollout job and
continued by its successor (``in_flight.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hpcrl.rundir.json_record import JsonRecord, RecordError
from hpcrl.rollout.engine import FINISH_LENGTH, FINISH_STOP

PENDING, GENERATING, PROCESSING_TOOLS, TERMINATED = "pending", "generating", "processing_tools", "terminated"
STATES = (PENDING, GENERATING, PROCESSING_TOOLS, TERMINATED)


@dataclass
class TrajectoryState(JsonRecord):
    """Where one trajectory is: its state, its response so far, its counters."""

    state: str = PENDING
    """One of :data:`STATES`."""
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
    tool_error: str = ""
    """The first tool error's message (a call that did not parse, an unknown tool, a tool that failed)."""
    pending_calls: list[dict] = field(default_factory=list)
    """Calls parsed from the last turn, not yet answered (``{name, arguments}``)."""
    segments: int = 0
    """Engine calls so far (a turn cut by an abort is two)."""
    finish_reason: Optional[str] = None
    """Why it ended (the engine's stop or length, or an agent loop's own reason); None until then."""
    greedy: bool = False
    """Decoded at temperature 0: remax's baseline of its group (scored, never trained; a state saved by an
    older hpcrl has no such field and is a sampled trajectory)."""

    def check(self) -> None:
        """A known state, and one entry per token in every per-token list."""
        if self.state not in STATES:
            raise RecordError(f"trajectory state {self.state!r}; allowed: {', '.join(STATES)}")
        if not len(self.tokens) == len(self.mask) == len(self.logprobs) == len(self.versions):
            raise RecordError("trajectory: tokens, mask, log-probs and versions differ in length")

    @property
    def done(self) -> bool:
        """It has terminated (nothing left to generate or call)."""
        return self.state == TERMINATED

    @property
    def num_turns(self) -> int:
        """Assistant turns plus tool-response turns."""
        return self.assistant_turns + self.user_turns

    def add(self, tokens: list[int], logprobs: list[float], version: int, model: bool) -> None:
        """Append tokens the model sampled (``model``) or a tool's response."""
        self.tokens += tokens
        self.logprobs += logprobs
        self.mask += [1 if model else 0] * len(tokens)
        self.versions += [version] * len(tokens)

    def reopen(self) -> bool:
        """Take back the last token of a trajectory that ended on one the model sampled (EOS, or the length cap)
        and let it generate from there again, as if an abort had cut it just before that token: a partial
        rollout's continuation under the version the job loads next, with every token keeping the version that
        sampled it (the rollout job's carry of a group that could be trained beyond the lag bound). False, and
        nothing changed, for a trajectory that did not end so (on a tool's response, a tool error, max turns)."""
        if self.state != TERMINATED or self.finish_reason not in (FINISH_STOP, FINISH_LENGTH) or \
                not self.mask or self.mask[-1] != 1:
            return False
        for column in (self.tokens, self.mask, self.logprobs, self.versions):
            column.pop()
        self.state, self.finish_reason = GENERATING, None
        self.assistant_turns = max(0, self.assistant_turns - 1)  # the turn is counted again when it ends
        return True

    def terminate(self, reason: str) -> None:
        """End it with ``reason``; calls still pending are dropped."""
        self.state, self.finish_reason, self.pending_calls = TERMINATED, reason, []
