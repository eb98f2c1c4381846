"""Tool-call parsers: an assistant turn's text -> the calls it asks for (``agent.tool_parser``).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
  (the format of Qwen 2.5/3 and the Hermes models; ``arguments`` may also be a JSON string).
- ``tiny``: the built-in tiny model's format, for its 64-word vocabulary without braces or
  quotes: ``( 3 + 4 )`` calls the one configured tool with the text inside the innermost
  parentheses -- after the last ``(`` before the first ``)``, to the end of the turn if no ``)``
  follows -- as its only argument. So ``( ( 5`` calls ``5``: a stray ``(`` before the expression
  does not turn the call into a syntax error (the toy task's reward for asking teaches the tiny
  model exactly that token; read from the first ``(``, such calls all failed). The tiny syntax
  has no nested expressions.

Each parser returns ``(calls, error)``: ``error`` (one line) when the turn tried to call a tool
but the call does not parse; the agent counts it as a tool error and ends the episode.
Add a format with a class here and its line in the registry, :data:`hpcrl.config.registries.TOOL_PARSERS`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional


@dataclass
class ToolCall:
    """One call the model asked for."""

    name: str
    arguments: dict


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (module docstring)."""

    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self, tokenizer, tool_names: list[str]):
        self.tool_names = tool_names

    def parse(self, text: str) -> tuple[list[ToolCall], Optional[str]]:
        """The calls in ``text``, or the reason one does not parse."""
        calls = []
        for raw in self.BLOCK.findall(text):
            try:
                d = json.loads(raw)
                args = d.get("arguments", {}) if isinstance(d, dict) else None
                if isinstance(args, str):
                    args = json.loads(args)
            except json.JSONDecodeError as e:
                return [], f"tool call is not JSON ({e}): {raw.strip()[:120]}"
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(args, dict):
                return [], f"tool call needs a string 'name' and an object 'arguments': {raw.strip()[:120]}"
            calls.append(ToolCall(d["name"], args))
        if not calls and "<tool_call>" in text:
            return [], "<tool_call> without its closing </tool_call>"
        return calls, None


class TinyParser:
    """``( expression )`` calls the one configured tool (module docstring)."""

    ARGUMENT = {"calculator": "expression", "python": "code"}

    def __init__(self, tokenizer, tool_names: list[str]):
        if len(tool_names) != 1 or tool_names[0] not in self.ARGUMENT:
            raise ValueError(f"agent.tool_parser=tiny calls exactly one tool, calculator or python; "
                             f"agent.tools has {tool_names or 'none'}")
        self.tool = tool_names[0]
        self.eos = tokenizer.eos_token or ""

    def parse(self, text: str) -> tuple[list[ToolCall], Optional[str]]:
        """The call in ``text`` (at most one), or the reason it does not parse."""
        if self.eos:
            text = text.replace(self.eos, " ")
        close = text.find(")")
        start = text.rfind("(", 0, close if close >= 0 else len(text))  # the innermost call
        if start < 0:  # a ")" before any "(": the call opens after it
            start = text.find("(")
        if start < 0:
            return [], None
        end = text.find(")", start + 1)
        inner = text[start + 1:] if end < 0 else text[start + 1:end]
        if not inner.strip():
            return [], "empty tool call ()"
        return [ToolCall(self.tool, {self.ARGUMENT[self.tool]: inner.strip()})], None
